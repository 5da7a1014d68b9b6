"""Sweeps: one DAG over many inputs, cut into chunks that run as independent Dask graphs, a few
in flight at a time, their results stacked as they finish. An item that fails is kept with its
chunk's results; a chunk that fails as a whole is rerun item by item, to name the item.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import time
from collections import deque
from dataclasses import replace
from functools import partial

import jax
import numpy as np

from daskdag.errors import DAGError, NodeError
from daskdag.model.leaves import is_array
from daskdag.model.request import (batch_size, check_chunk_size, check_errors, cotangents_for,
                                   given_values)
from daskdag.running import cluster, programs
from daskdag.running.jobs import not_on_processes, on_processes
from daskdag.running.compute import logger
from daskdag.running.programs import in_words
from daskdag.running.passes import names_key
from daskdag.running.resident import placing
from daskdag.sweeps import arrays, devices
from daskdag.sweeps.engines import Cluster, Lost, Threads
from daskdag.sweeps.planning import (Sweep, chunk_steps, default_chunk_size, is_dask_array,
                                     item_signature, prepare)
from daskdag.sweeps.progress import Progress, detached
from daskdag.sweeps.results import OnDevice, Stacked, item_shapes, rows
from daskdag.sweeps.shared import share
from daskdag.sweeps.store import Store, identity, items_hash
from daskdag.transport import transports


PIECE_SECONDS = 10.0  # with a store and no chunk_size: about the work of a piece


class Interrupted(KeyboardInterrupt):
    """Ctrl-C in a sweep with a store; its message says how many items the store holds."""


def of_kind(kind, xs, data: tuple, *, batched, chunk_size, client, local: str | None,
            progress: bool, errors: str, store=None):
    """A sweep of ``kind`` (a :class:`~daskdag.running.passes.Derivative`) over the items of
    ``xs`` and ``data``, on ``client``'s cluster or Dask's ``local`` scheduler: compiled for one
    item, run over chunks (:func:`sweep`; over dask arrays: :mod:`daskdag.sweeps.arrays`)."""
    check_errors(errors)
    check_chunk_size(chunk_size)
    if local == "processes":  # as dask arrays computed there, four blocks a core
        if store is not None:
            raise DAGError(not_on_processes(f"{kind.sweep_call} with store="))
        lazy = arrays.of_kind(kind, xs, data, batched, chunk_size, None, progress, errors,
                              every=4 * parallelism(None))
        return on_processes(lazy, progress)
    if store is None and arrays.dask_leaves({"": xs}, [""]):
        lazy = arrays.of_kind(kind, xs, data, batched, chunk_size, client, progress, errors)
        if lazy is not None:
            return lazy
    transport = transports.for_call(client)
    like = arrays.stand_in(xs)  # a store's dask-array items are read chunk by chunk
    program, why = programs.compile(
        kind.sweep_call, kind.dag, like, (names_key(kind.outputs), names_key(batched),
                                          names_key(kind.wrt), kind.options(data), transport),
        partial(prepare, kind, like, data, batched, transport),
        inputs=item_signature(kind.dag, like, batched))
    made = program.value
    lowered = made.lowered
    values, cts = kind.inputs(lowered, given_values(lowered.spec, xs), data,
                              batched=made.batched)
    on = devices.placement(made, client, local)
    computed, failed, chunks = sweep(made, values, cts, chunk_size, client, local, progress,
                                     errors, store=store, kind=kind, on=on)
    info = replace(kind.info(lowered, data, why, on.where() if on else in_words(client, local)),
                   call=kind.sweep_call, chunks=chunks)
    return kind.finish(lowered, info, computed, failed)


def sweep(planned: Sweep, values: dict, cotangents, chunk_size, client, local: str | None,
          progress: bool, errors: str, store=None, kind=None, on=None):
    """A prepared sweep over ``values``: :func:`run`'s ``(computed, failed, chunks)``, in chunks
    of ``chunk_size`` items (by default the store's, else sized for the devices ``on`` or the
    threads). ``store``: where each chunk's results are kept, and a sweep of the same ``kind``
    resumes; there, with no ``chunk_size`` and items computed one by one in memory, chunks run
    in pieces sized by time (:class:`_Pieces`), so that an early interrupt finds some saved."""
    size = batch_size(values, tuple(planned.batched))
    planned = replace(planned, values=values, size=size,
                      cotangents=cotangents_for(planned.plan.outputs, cotangents))
    found = cluster.check(client, planned.plan) if client is not None else None
    slots = parallelism(found) if local != "sync" else 1
    on_device = devices.results_on_device(planned, on)
    default = devices.chunk_size(planned, on, on_device) if on is not None else \
        default_chunk_size(planned, slots)
    in_flight = devices.DEPTH if on is not None else 2 * slots if client else slots
    kept, by_time = None, False
    if store is not None:
        blocks = [leaf.chunks[0][0] for _, leaf in arrays.dask_leaves(values, planned.batched)]
        kept = Store(store, identity(kind, planned, errors), chunk_size,
                     blocks[0] if blocks else default)
        by_time = chunk_size is None and not blocks and planned.by_item
        chunk_size = kept.chunk_size
        if kept.lazy is None:  # dask-array items: the results stay in the store
            kept.lazy = bool(blocks)
    try:
        return run(planned, chunk_size or default, client, in_flight=in_flight,
                   progress=progress, errors=errors, workers=found, store=kept,
                   by_time=by_time, local=local, on=on, on_device=on_device)
    finally:
        if kept is not None:
            kept.close()


def run(sweep: Sweep, chunk_size: int, client, in_flight: int, progress: bool, errors: str,
        workers: dict | None = None, store: Store | None = None, by_time: bool = False,
        local: str | None = None, on=None, on_device: bool = False):
    """Compute every chunk, ``in_flight`` at a time, after the work every item shares.
    ``workers``: ``client``'s workers, if known; ``on``: the devices the chunks run on;
    ``on_device``: the results are jax.Arrays. Returns ``(computed, failed, chunks)``: the
    results stacked over the items (NaN rows for failed items), ``{item: NodeError}`` (with
    ``errors='raise'``, the first failing item's error raises), and how many chunks ran. However
    it ends, nothing of the sweep stays running or held. Ctrl-C with a ``store`` raises
    :class:`Interrupted`, saying how much is saved."""
    kind = OnDevice if on is not None and on_device else Stacked
    stacked = None if store is not None and store.lazy else {
        o: (kind(sweep.size), {i: kind(sweep.size) for i in sweep.plan.wrt})
        for o in sweep.plan.outputs}
    logger.info("sweep_grads: outputs %s, wrt %s: %d items in chunks of %d, %d at a time, on %s",
                list(sweep.plan.outputs), list(sweep.plan.wrt), sweep.size, chunk_size, in_flight,
                on.where() if on is not None else in_words(client, None))
    failed: dict[int, NodeError] = {}
    chunks = 0
    if sweep.size:
        bar = Progress(sweep.size) if progress else None
        done = keep = None
        if store is not None:
            done = _resume(store, sweep, stacked, failed)
            if bar:
                bar.already(int(done.sum()))

            def keep(chunk: tuple[int, int], computed, fails):  # written as the sweep goes on
                devices.to_host(computed)
                pieces = [chunk]
                if errors == "raise" and fails:
                    # Only the items that succeeded: a resume computes the failed ones again.
                    pieces, fails = _between(chunk, fails) if computed is not None else [], None

                def write(a: int, b: int):
                    held = computed and jax.tree.map(lambda x: x[a - chunk[0]:b - chunk[0]],
                                                  _as_rows(sweep, *chunk, computed))
                    store.write(a, b, chunk_hash(sweep, a, b), held, fails)

                for piece in pieces:
                    store.later(partial(write, *piece))
        try:
            left = sweep.size - (int(done.sum()) if done is not None else 0)
            chunks = _run_chunks(share(sweep, left, chunk_size, client, local), chunk_size,
                                 client, in_flight, bar, errors, stacked, failed, workers,
                                 done, keep, by_time, local, on, on_device)
        except BaseException as e:
            if store is None:
                raise
            store.flush(raise_errors=False)  # what was computed is kept
            if not isinstance(e, KeyboardInterrupt):
                raise
            saved = int(done.sum()) + store.saved  # type: ignore[union-attr]
            if bar:
                bar.settle(saved)
            raise Interrupted(f"{saved} of {sweep.size} items saved in {store.name}; run the "
                              f"same call again to resume") from None
        else:
            if store is not None:
                store.flush()
        finally:
            if bar:
                bar.close()
    if stacked is None and store is not None:  # a lazy store's: dask arrays reading it
        return store.view(lambda: item_shapes(sweep)), failed, chunks
    results = _finish(sweep, stacked)
    if on_device and on is None:
        results = jax.device_put(results)
    return results, failed, chunks


def _resume(store: Store, sweep: Sweep, stacked: dict | None, failed: dict) -> np.ndarray:
    """The complete chunks of ``store`` (their inputs checked) into ``stacked`` (unless None)
    and ``failed``; returns which items they hold."""
    done = np.zeros(sweep.size, bool)
    for start, stop, computed, fails in store.complete(lambda a, b: chunk_hash(sweep, a, b),
                                                       read=stacked is not None):
        if computed:
            _store(stacked, sweep, start, stop, computed, every_row=True, failed=fails)
        failed.update(fails)
        done[start:stop] = True
    return done


def chunk_hash(sweep: Sweep, start: int, stop: int) -> str:
    """The hash of items ``start:stop`` of the batched inputs."""
    return items_hash({i: jax.tree.map(lambda a: np.asarray(a[start:stop])
                                       if is_array(a) or is_dask_array(a) else a,
                                       sweep.values[i]) for i in sweep.batched})


def _run_chunks(sweep, chunk_size, client, in_flight, bar, errors, stacked, failed, workers,
                done, keep, by_time, local, on, on_device) -> int:
    """Chunks in order, at most ``in_flight`` at once, on an engine: the devices ``on``, this
    process's threads (with ``local`` ``"sync"``, the calling thread), or ``client``'s cluster,
    where the shared inputs and the chunk graph stay for later calls
    (:func:`~daskdag.running.resident.placing`). An item that fails inside a chunk is kept
    with the chunk's results; a chunk that fails as a whole (a ``vmap=True`` node's program, a
    chunk of task graphs), or is lost with its workers, is rerun item by item, ahead of new
    chunks, to name its failing items and keep the others. With ``errors='raise'`` no new chunk
    starts after a failure; the error raised is the lowest failing item's, once everything
    before it is known to have succeeded.

    ``done``: items a store had already, not run again. ``keep(chunk, computed, failed)``: takes
    each chunk's results and failures before they count (a store writes them). Returns how many
    chunks ran, reruns included."""
    sent = 0
    shared = {i: v for i, v in sweep.values.items() if sweep.shared(i)}
    with contextlib.ExitStack() as stack:
        place = None if client is None else stack.enter_context(placing(client))
        engine: Threads | Cluster | devices.Devices
        if on is not None:
            engine = devices.Devices(on, shared, bar, chunk_size, host=not on_device)
        elif client is None:
            engine = Threads(in_flight, bar, here=local == "sync")
        else:
            pin = not any(sweep.plan.spec.nodes[n].needs for n in sweep.plan.needed)
            engine = Cluster(client, shared, pin, bar, place, workers, sweep.plan)
        stack.callback(engine.close)
        sweep = replace(sweep, values={**sweep.values, **engine.shared})
        chunks = deque((s, min(s + chunk_size, sweep.size))
                       for s in range(0, sweep.size, chunk_size))
        if done is not None:  # what a store holds is not run again
            chunks = deque(piece for c in chunks
                           for piece in _between(c, {i for i in range(*c) if done[i]}))
            if done.any() and sweep.by_item and not by_time:
                chunks = _spread(chunks, chunk_size, in_flight)
        work = _Pieces(chunks, by_time)
        reruns: deque = deque()
        broken: list = []  # failed chunks held back (errors='raise')
        pending: dict = {}
        began: dict = {}  # chunk -> when it was sent
        while True:
            halted = errors == "raise" and bool(failed or broken)  # no new chunks
            if halted and not pending and not reruns:  # all before the failures is known
                first = min(failed, default=sweep.size)
                if not broken or first < broken[0][0]:
                    raise failed[first] from failed[first].original
                reruns.extend(_items(broken.pop(0)))
            source = reruns or (() if halted else work)
            batch = [source.popleft()  # type: ignore[union-attr]  # never the empty tuple
                     for _ in range(min(len(source), in_flight - len(pending)))]
            if batch:
                futures = engine.submit(sweep, [(c, chunk_steps(sweep, c[1] - c[0]))
                                                for c in batch])
                sent += len(batch)
                pending.update(zip(futures, batch))
                began.update(dict.fromkeys(batch, time.monotonic()))
                for c in batch if bar else ():
                    bar.open(c)
            if not pending:
                return sent
            for fut in engine.wait_any(list(pending)):
                c = pending.pop(fut)
                err, seconds = _collect(engine, fut, sweep, c, stacked, failed, keep)
                work.took(c, time.monotonic() - began.pop(c) if seconds is None else seconds)
                if bar:
                    bar.close_chunk(c, c[1] - c[0] if err is None or c[1] - c[0] == 1 else 0)
                if err is None:
                    continue
                if isinstance(err, Lost) or c[1] - c[0] > 1 and errors != "raise":
                    reruns.extend(_items(c))  # item by item, ahead of new chunks
                elif c[1] - c[0] == 1:  # an item: named
                    if keep is not None:
                        keep(c, None, {c[0]: err})
                    failed[c[0]] = err
                else:
                    bisect.insort(broken, c)
            if bar:
                bar.refresh()


class _Pieces:
    """The chunks left to run, in order, taken whole, or ``by_time`` in pieces cut from their
    start: one item at first, then about :data:`PIECE_SECONDS` of work at the latest pieces'
    time per item (growing at most fourfold a piece). Only for item-by-item sweeps."""

    def __init__(self, chunks: deque, by_time: bool):
        self.chunks, self.by_time, self.size = chunks, by_time, 1
        self.per_item: list[float] = []  # seconds per item of the latest pieces

    def __len__(self) -> int:
        """The pieces that can be taken now."""
        if not self.by_time:
            return len(self.chunks)
        return sum(-(-(b - a) // self.size) for a, b in self.chunks)

    def popleft(self) -> tuple[int, int]:
        start, stop = self.chunks.popleft()
        if self.by_time and stop - start > self.size:
            self.chunks.appendleft((start + self.size, stop))
            return start, start + self.size
        return start, stop

    def took(self, piece: tuple[int, int], seconds: float) -> None:
        if not self.by_time:
            return
        self.per_item = [*self.per_item[-7:], seconds / (piece[1] - piece[0])]
        typical = sorted(self.per_item)[len(self.per_item) // 2]
        self.size = max(1, min(4 * self.size, int(PIECE_SECONDS / max(typical, 1e-6))))


def _spread(chunks: deque, chunk_size: int, in_flight: int) -> deque:
    """A resumed sweep's chunks, cut smaller where too few to keep ``in_flight`` slots busy."""
    missing = sum(b - a for a, b in chunks)
    piece = max(1, -(-missing // in_flight))
    if piece >= chunk_size:
        return chunks
    return deque((s, min(s + piece, b)) for a, b in chunks for s in range(a, b, piece))


def _items(chunk):
    return [(i, i + 1) for i in range(*chunk)]


def _between(chunk: tuple[int, int], left_out) -> list[tuple[int, int]]:
    """The runs of items of ``chunk`` between the items ``left_out``."""
    pieces, start = [], None
    for i in range(chunk[0], chunk[1] + 1):
        if i < chunk[1] and i not in left_out:
            start = i if start is None else start
        elif start is not None:
            pieces.append((start, i))
            start = None
    return pieces


def _collect(engine, fut, sweep, chunk: tuple[int, int], stacked, failed: dict, keep=None
             ) -> tuple[NodeError | Lost | None, float | None]:
    """Store a finished chunk's results, and its failed items in ``failed`` (``keep`` them
    first). Returns ``(error, seconds)``: the chunk's error if it failed as a whole, else None;
    the seconds it ran, where known."""
    start, stop = chunk
    try:
        computed, fails, seconds = engine.result(fut)
    except NodeError as e:
        return detached(e, start if stop - start == 1 else None), None
    except Lost as e:
        return e, None
    finally:
        engine.release(fut)
    fails = {start + i: detached(e, start + i) for i, e in sorted(fails.items())}
    if len(fails) == stop - start:  # nothing to keep but the failures
        computed = None
    if computed is not None and sweep.through is not None:
        try:
            computed = sweep.through.pull(computed, stop - start)
        except NodeError as e:
            return detached(e, start if stop - start == 1 else None), seconds
    if keep is not None:
        keep(chunk, computed, fails or None)
    if computed is not None:
        _store(stacked, sweep, start, stop, computed, failed=fails)
    failed.update(fails)
    return None, seconds


def _as_rows(sweep, start: int, stop: int, computed: dict) -> dict:
    """A chunk's ``computed`` results as NumPy arrays, one row per item (:func:`rows`)."""
    return jax.tree.map(np.asarray, {
        o: (rows(v, stop - start, o in sweep.carrying), {i: rows(g, stop - start, True)
                                                         for i, g in grads.items()})
        for o, (v, grads) in computed.items()})


def _store(stacked, sweep, start, stop, computed, every_row: bool = False, failed=()):
    """A chunk's results into ``stacked`` (unless None), but for its items that ``failed``.
    ``every_row``: every value has a row per item (:func:`_as_rows`), as a store's have."""
    if stacked is None:
        return
    for o, (value, grads) in computed.items():
        stacked[o][0].put(start, stop, value, every_row or o in sweep.carrying)
        for i, g in grads.items():
            stacked[o][1][i].put(start, stop, g, True)
    if failed:
        for value, grads in stacked.values():
            for s in (value, *grads.values()):
                s.forget(failed)


def _finish(sweep, stacked) -> dict:
    """The stacked results; where no item gave one, NaN rows shaped like one item's."""
    values, grads = item_shapes(sweep) if any(
        s.tree is None for v, g in stacked.values() for s in (v, *g.values())) else ({}, {})
    return {o: (v.result(values.get(o)), {i: s.result(grads.get(o, {}).get(i))
                                          for i, s in g.items()})
            for o, (v, g) in stacked.items()}


def parallelism(workers: dict | None) -> int:
    """Chunks that can run at once: threads of the cluster's ``workers``, else CPUs here."""
    if workers is None:
        return os.cpu_count() or 1
    return max(1, sum(w.get("nthreads", 1) for w in workers.values()))
