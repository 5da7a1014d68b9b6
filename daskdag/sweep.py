"""Sweeps: one DAG over many inputs, cut into chunks that run as independent Dask graphs.

Each chunk of items is the graph :func:`daskdag.graph.build` makes for one call, over a spec
whose node functions take a whole chunk (:class:`~daskdag.chunked.Chunked`): vectorized with
``jax.vmap`` for ``Node(vmap=True)``, else item by item. On a cluster a chunk runs as one task
on one worker. Shared inputs are scattered once and every chunk refers to them. A few chunks are in flight at a time; their results are written into the
stacked outputs as they finish and their intermediates released, so memory stays bounded however
many items there are. A chunk that fails is rerun item by item, to name the item and keep the rest.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from dataclasses import dataclass, replace
from typing import Any

import cloudpickle
import dask
import distributed
import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from .chunked import Chunked
from .cluster import workers
from .errors import NodeError
from .graph import build
from .plan import Plan, make_plan
from .spec import Spec
from .stacked import Stacked, item_shapes


@dataclass(frozen=True)
class Sweep:
    """What every chunk shares: the plan over the chunked spec, and which names carry items."""

    plan: Plan
    values: dict[str, Any]  # inputs as given
    batched: frozenset[str]  # inputs that carry the item axis
    broadcast: frozenset[str]  # shared inputs differentiated per item: broadcast in each chunk
    carrying: frozenset[str]  # inputs and nodes whose values carry the item axis
    cotangents: dict[str, Any]
    size: int

    def shared(self, name: str) -> bool:
        return name not in self.batched and name not in self.broadcast

    def chunk(self, start: int, stop: int):
        """The Dask graph of items ``start:stop``: ``{output: (value, {input: grad})}``."""
        values = {}
        for i, v in self.values.items():
            if i in self.batched:
                v = jax.tree.map(lambda a: a[start:stop], v)
            elif i in self.broadcast:
                v = jax.tree.map(lambda a: jnp.broadcast_to(a, (stop - start, *jnp.shape(a))), v)
            values[i] = v
        return build(self.plan, values, self.cotangents, batched=True)


def plan_sweep(spec: Spec, outputs, values, batched, wrt, cotangents, size) -> Sweep:
    broadcast = frozenset(wrt) - frozenset(batched)
    carrying = set(batched) | broadcast
    nodes = {}
    for n in spec.order:
        node = spec.nodes[n]
        in_axes = tuple(0 if d in carrying else None for d in node.deps)
        if 0 in in_axes:  # nodes of shared inputs alone stay as they are: one key, run once
            carrying.add(n)
            node = replace(node, fn=Chunked(node, in_axes), jit=False, vmap=False)
        nodes[n] = node
    plan = make_plan(replace(spec, nodes=nodes), outputs, tuple(wrt))
    return Sweep(plan, values, frozenset(batched), broadcast, frozenset(carrying), cotangents, size)


def default_chunk_size(size: int, parallelism: int) -> int:
    """About four chunks per parallel slot, for balance, and at most 256 items per chunk."""
    return max(1, min(256, math.ceil(size / (4 * parallelism))))


def run(sweep: Sweep, chunk_size: int, client, in_flight: int, progress: bool, errors: str):
    """Compute every chunk, ``in_flight`` at a time. Returns ``(computed, failed)``.

    ``computed``: ``{output: (value, {input: grad})}`` stacked over the items (NaN rows for
    failed items; shaped by :func:`~daskdag.stacked.item_shapes` when no item gave any);
    ``failed``: ``{item: NodeError}`` (``errors='collect'``); with ``errors='raise'`` the first
    failure raises.
    """
    shared = {}
    if client is not None:  # shared inputs go to the cluster once, not once per chunk
        # (hash=False: a key of this call's own, which no earlier call's release can take away)
        shared = {i: client.scatter([v], hash=False)[0] for i, v in sweep.values.items()
                  if sweep.shared(i)}
        sweep = replace(sweep, values={**sweep.values, **shared})
    submit, wait_any, close = _engine(client, in_flight, list(shared.values()), pin=not any(
        sweep.plan.spec.nodes[n].needs for n in sweep.plan.needed))
    stacked = {o: (Stacked(sweep.size), {i: Stacked(sweep.size) for i in sweep.plan.wrt})
               for o in sweep.plan.outputs}
    failed: dict[int, NodeError] = {}
    chunks = iter([(s, min(s + chunk_size, sweep.size)) for s in range(0, sweep.size, chunk_size)])
    pending, broken = {}, []  # broken: chunks that failed, with errors='raise'
    bar = tqdm(total=sweep.size, unit="item", disable=not progress)
    try:
        while True:
            while not broken and len(pending) < in_flight and (c := next(chunks, None)) is not None:
                pending[submit(sweep.chunk(*c))] = c
            if not pending:
                break
            for fut in wait_any(list(pending)):
                start, stop = pending.pop(fut)
                try:
                    _store(stacked, sweep, start, stop, fut.result())
                except NodeError:
                    if errors == "raise":  # finish what is in flight, then name the first item
                        broken.append((start, stop))
                        continue
                    _rerun_items(sweep, start, stop, submit, stacked, failed, errors)
                bar.update(stop - start)
        if broken:  # chunks went in in order, so the first failing item is in the lowest one
            _rerun_items(sweep, *min(broken), submit, stacked, failed, errors)
    finally:
        bar.close()
        for fut in pending:
            fut.cancel()
        close()
    return _finish(sweep, stacked), failed


def _rerun_items(sweep, start, stop, submit, stacked, failed, errors):
    """Each item of a failed chunk alone, in order: keep the good ones, name the bad ones."""
    futures = [submit(sweep.chunk(i, i + 1)) for i in range(start, stop)]
    for i, fut in zip(range(start, stop), futures):
        try:
            _store(stacked, sweep, i, i + 1, fut.result())
        except NodeError as e:
            err = NodeError(e.node, e.phase, e.original, item=i)
            if errors == "raise":
                raise err from e.original
            failed[i] = err


def _store(stacked, sweep, start, stop, computed):
    for o, (value, grads) in computed.items():
        stacked[o][0].put(start, stop, value, o in sweep.carrying)
        for i, g in grads.items():
            stacked[o][1][i].put(start, stop, g, True)


def _finish(sweep, stacked) -> dict:
    """``{output: (value, {input: grad})}``; where no item gave a result (none at all, or all
    failed), NaN rows shaped like one item's result, when that can be known without data."""
    values, grads = {}, {}
    if any(s.tree is None for v, g in stacked.values() for s in (v, *g.values())):
        values, grads = item_shapes(sweep.plan, sweep.values, sweep.batched)
    return {o: (v.result(values.get(o)), {i: s.result(grads.get(i)) for i, s in g.items()})
            for o, (v, g) in stacked.items()}


def _engine(client, in_flight, shared: list, pin: bool):
    """``submit(graph) -> future``, ``wait_any(futures) -> done`` and ``close()``.

    ``shared``: the futures of the scattered shared inputs.

    ``pin``: on a cluster, each chunk runs as one task on one worker (the one with the fewest
    chunks in flight; loosely, so the worker's death can still move it). Left to itself the
    scheduler split chunks over workers and shipped pullbacks and cotangents between them (a
    third of the 2-worker sweep benchmark's time), and a chunk's ~25 tasks each cost
    distributed's per-task overhead. Chunks whose nodes need resources stay task graphs, which
    the scheduler places node by node.
    """
    if client is None:  # Dask's local scheduler: each chunk synchronously, in_flight threads
        pool = concurrent.futures.ThreadPoolExecutor(in_flight, thread_name_prefix="daskdag-sweep")
        return (lambda graph: pool.submit(lambda: dask.compute(graph, scheduler="sync")[0]),
                lambda fs: concurrent.futures.wait(fs, return_when="FIRST_COMPLETED").done,
                lambda: pool.shutdown(cancel_futures=True))

    on: dict = {}  # future -> the worker its chunk was sent to, when pinned

    def wait_any(fs):
        with client.as_current():
            done = distributed.wait(fs, return_when="FIRST_COMPLETED").done
        for fut in done:
            on.pop(fut, None)
        return done

    if not pin:
        return client.compute, wait_any, lambda: None

    def submit(graph):
        addresses = list(workers(client))
        if not addresses:  # none yet (an adaptive cluster): let the scheduler place it
            return client.compute(graph)
        worker = min(addresses, key=lambda w: sum(1 for v in on.values() if v == w))
        whole = dask.delayed(graph)
        tasks = cloudpickle.dumps(dict(whole.__dask_graph__()))
        fut = client.submit(_run_chunk, tasks, whole.key, {f.key: f for f in shared}, pure=False,
                            workers=[worker], allow_other_workers=True)
        on[fut] = worker
        return fut

    return submit, wait_any, lambda: None


def _run_chunk(tasks: bytes, key, shared: dict):
    """A whole chunk as one task, in one worker: its graph run by Dask's synchronous scheduler,
    with the shared inputs, which distributed fetched for this task, as data."""
    graph = cloudpickle.loads(tasks)
    for k, value in shared.items():
        graph.update(dask.delayed(value, name=k, traverse=False).__dask_graph__())
    return dask.get(graph, key)


def parallelism(client) -> int:
    if client is None:
        return os.cpu_count() or 1
    return max(1, sum(w.get("nthreads", 1) for w in workers(client).values()))
