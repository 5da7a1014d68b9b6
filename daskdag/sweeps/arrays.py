"""Sweeps over dask arrays chunked along the item axis, returning dask arrays of values and
gradients on the same item chunks: nothing runs until they are computed, so a sweep streams from
storage to storage. Each block is one task (:func:`_run_block`) running the sweep's chunk graph
over its items; the shared inputs, their constant nodes and the chunk graph are one task each.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
from dataclasses import replace
from typing import TYPE_CHECKING

import cloudpickle
import dask
import jax
import numpy as np
from dask.base import tokenize
from dask.delayed import Delayed
from dask.highlevelgraph import HighLevelGraph
from dask.task_spec import Task, TaskRef

import daskdag.config as config
from daskdag.errors import DAGError, NodeError
from daskdag.graph.assembly import key
from daskdag.model.leaves import is_array
from daskdag.model.request import batch_size, batched_names, parsed
from daskdag.running import cluster
from daskdag.running.jobs import LAZY
from daskdag.running.programs import Watch
from daskdag.sweeps import planning, progress
from daskdag.sweeps.chunked import stacked
from daskdag.sweeps.engines import bound, chunk_graph, run_chunk
from daskdag.sweeps.results import item_shapes
from daskdag.sweeps.shared import constants_part
from daskdag.transport import transports
from daskdag.transport.packing import unpack

if TYPE_CHECKING:
    import dask.array as da


def dask_leaves(values: dict, batched) -> list[tuple[str, da.Array]]:
    """``(input, leaf)`` for each leaf of the ``batched`` inputs that is a dask array."""
    return [(i, leaf) for i in batched for leaf in jax.tree.leaves(values[i])
            if planning.is_dask_array(leaf)]


def of_kind(kind, xs, data: tuple, batched, chunk_size, client, progress: bool, errors: str,
            every: int | None = None):
    """A sweep of ``kind`` over dask arrays, where a batched input holds one (else None): the
    kind's results as dask arrays, computing nothing. ``client``: the one in effect (checked
    now). ``every``: with no ``chunk_size`` and no dask array, the items cut into that many
    blocks (a sweep for Dask's multiprocessing scheduler)."""
    spec, _, values = parsed(kind.dag, xs, kind.outputs)
    batched = batched_names(values, batched)
    has_dask = bool(dask_leaves(values, batched))
    if not has_dask and every is None:
        return None
    if errors == "collect":
        raise DAGError("errors='collect' is not supported when batched inputs are dask arrays, "
                       "or a sweep runs on Dask's multiprocessing scheduler: the results are "
                       "computed as dask arrays, so there is no list of failed items to return; "
                       "use errors='raise' (a failing item raises its NodeError, naming the "
                       "item, when the arrays are computed)")
    if progress and every is None:
        raise DAGError("progress=True is not supported when batched inputs are dask arrays "
                       "(nothing runs at sweep time): show progress where the arrays are "
                       "computed, with dask.diagnostics.ProgressBar or distributed.progress")
    if every is not None and chunk_size is None and not has_dask:
        chunk_size = max(1, math.ceil(batch_size(values, batched) / every))
    aligned(values, batched, chunk_size)  # its checks first
    transport = transports.for_call(client, lazy=True)
    planned = planning.prepare(kind, stand_in(xs), data, batched, transport, Watch())
    given, cts = kind.inputs(planned.lowered, values, data, batched=planned.batched)
    inputs, chunks, size = aligned(given, batched, chunk_size)
    planned = replace(planned, size=size, cotangents=cts, values={
        i: stand_in(v) if i in batched else v for i, v in given.items()})
    if client is not None:
        cluster.check(client, planned.plan)
    shapes = _shapes(planned, spec)
    split = constants_part(planned) if config.get("share-sweep-work") else None
    if split is not None:  # nodes of shared inputs alone: one task each, for every block
        once, planned, made = split
        planned = replace(planned, values={**planned.values,
                                           **{n: made[n][0] for n in once.outputs}})
    computed = _block_graph(planned, inputs, chunks, shapes)
    lowered = planned.lowered
    info = replace(kind.info(lowered, data, "a sweep over dask arrays is prepared as it is made",
                             LAZY), call=kind.sweep_call)
    return kind.finish(lowered, info, computed, {})


def aligned(values: dict, batched, chunk_size: int | None) -> tuple[dict, tuple, int]:
    """``({input: tree}, item chunks, N)``: every array leaf of the ``batched`` inputs as a dask
    array chunked along the item axis alone, on the same chunks: ``chunk_size`` items each if
    given, else those of the first dask array."""
    import dask.array as da
    first = None
    for i, leaf in dask_leaves(values, batched):
        if any(math.isnan(c) for c in leaf.chunks[0]):
            raise DAGError(f"batched input {i!r} is a dask array whose chunk sizes are "
                           f"unknown: call its compute_chunk_sizes() first")
        first = first or leaf.chunks[0]
    size = batch_size(values, batched)
    items = da.core.normalize_chunks((chunk_size,), (size,))[0] if chunk_size else first

    def leaf_of(leaf):
        if planning.is_dask_array(leaf):
            want = (items, *((n,) for n in leaf.shape[1:]))
            return leaf if leaf.chunks == want else leaf.rechunk(want)
        if is_array(leaf):
            return da.from_array(np.asarray(leaf), chunks=(items, *np.shape(leaf)[1:]))
        return leaf

    trees = {i: jax.tree.map(leaf_of, values[i]) for i in batched}
    return trees, tuple(items), size  # type: ignore[arg-type]


def stand_in(tree):
    """``tree`` with each dask array leaf as a NumPy array of its shape and dtype holding no
    memory (one zero, broadcast), for checks and shapes."""
    return jax.tree.map(lambda a: np.broadcast_to(np.zeros((), a.dtype), a.shape)
                        if planning.is_dask_array(a) else a, tree)


def _shapes(planned, spec) -> tuple[dict, dict]:
    """One item's :func:`~daskdag.sweeps.results.item_shapes`; a :class:`DAGError` where
    ``jax.eval_shape`` cannot find them."""
    values, grads = item_shapes(planned)
    for o, v in values.items():
        if v is None:
            raise DAGError(f"the shape of output {o!r} cannot be found by tracing its nodes with "
                           f"jax.eval_shape (a node on its way has Python control flow on values, "
                           f"float(x), or non-JAX code); sweeps over dask arrays need it to "
                           f"describe the result arrays before computing them")
    for i in planned.plan.wrt:
        if i in spec.nodes and any(g[i] is None for g in grads.values()):
            raise DAGError(f"the shape of node {i!r} (named in wrt) cannot be found by tracing "
                           f"it with jax.eval_shape; sweeps over dask arrays need it")
    return values, grads


class _Slot:
    """Where block ``k``'s rows of the ``k``-th dask array go in a batched input."""

    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


class _Blocks:
    """What every block task needs besides its data: the task keys of the shared inputs, the
    inputs broadcast (differentiated per item), each batched input packed with :class:`_Slot`
    for its dask arrays, and the results' layout: per output, its value's and each gradient's
    leaves (``ShapeDtypeStruct``)."""

    def __init__(self, shared: dict, broadcast: list, templates: dict, layout: list):
        self.shared, self.broadcast = shared, broadcast
        self.templates, self.layout = templates, layout

    def leaves(self) -> list:
        return [a for _, v, grads in self.layout for a in (*v, *(g for _, gs in grads for g in gs))]


class _Deferred:
    """An object that travels as cloudpickled bytes, unpickled by :meth:`get` where a task needs
    it, never by the scheduler."""

    __slots__ = ("obj", "data")

    def __init__(self, obj=None, data: bytes | None = None):
        self.obj, self.data = obj, data

    def get(self):
        if self.obj is None:
            self.obj = cloudpickle.loads(self.data)
        return self.obj

    def __reduce__(self):
        data = self.data if self.data is not None else cloudpickle.dumps(self.obj)
        return _Deferred, (None, data)


def _block_graph(planned, inputs: dict, chunks: tuple, shapes: tuple[dict, dict]) -> dict:
    """``{output: (value, {input: grad})}`` as trees of dask arrays over the blocks."""
    values, grads = shapes
    layer: dict = {}
    keys = {}
    shared = [i for i in planned.values if planned.shared(i)]
    broadcast = [i for i in planned.carried() if i in planned.broadcast]
    computed_once = []  # nodes computed once, in their own tasks (shared.constants_part)
    for i in (*shared, *broadcast):  # one task each, packed as graph.build packs inputs
        if isinstance(planned.values[i], Delayed):
            keys[i] = planned.values[i].key
            computed_once.append(planned.values[i])
            continue
        packed = planned.transport.pack(f"input {i!r}", planned.values[i])
        keys[i] = key("input", i, tokenize(packed))  # compute_grads' key for it
        layer[keys[i]] = Task(keys[i], unpack, packed)
    arrays: list = []

    def slot(leaf):
        if planning.is_dask_array(leaf):
            arrays.append(leaf)
            return _Slot(len(arrays) - 1)
        return leaf

    templates = {i: planned.transport.pack(f"input {i!r}", jax.tree.map(slot, inputs[i]))
                 for i in planned.carried() if i in planned.batched}
    layout = [(o, jax.tree.leaves(values[o]),
               [(i, jax.tree.leaves(grads[o][i])) for i in planned.plan.wrt])
              for o in planned.plan.outputs]
    blocks = _Blocks({i: keys[i] for i in shared}, broadcast, templates, layout)
    tasks, results = chunk_graph(planned, {i: TaskRef(keys[i]) for i in shared})
    tokens = [t.token if hasattr(t, "token") else tokenize(t) for t in templates.values()]
    token = tokenize(results, [a.name for a in arrays], chunks, tokens)
    graph_key = f"daskdag-chunk-graph-{token}"
    layer[graph_key] = Task(graph_key, _Deferred.get, _Deferred((tasks, results, blocks)))
    name = f"daskdag-sweep-blocks-{token}"
    refs = [TaskRef(keys[i]) for i in (*shared, *broadcast)]
    starts = np.cumsum((0, *chunks))
    for b in range(len(chunks)):
        data = [TaskRef((a.name, b, *(0,) * (a.ndim - 1))) for a in arrays]
        layer[(name, b)] = Task((name, b), _run_block, TaskRef(graph_key), int(starts[b]),
                                *refs, *data)
    needs = _needs(planned.plan)
    with dask.annotate(resources=needs) if needs else contextlib.nullcontext():
        base = HighLevelGraph.from_collections(name, layer,
                                               dependencies=[*arrays, *computed_once])
    return _as_arrays(planned, base, name, token, chunks, shapes)


def _as_arrays(planned, base, name: str, token: str, chunks: tuple, shapes) -> dict:
    """``{output: (value, {input: grad})}``: each leaf a dask array over the blocks' results
    (layer ``name`` of ``base``), in the order of their flat results."""
    import dask.array as da
    values, grads = shapes
    flat = itertools.count()

    def array(label: str, aval) -> da.Array:
        k = next(flat)
        leaf = f"daskdag-{label}-{token}"
        ndim = len(aval.shape)
        keys = {b: (leaf, b, *(0,) * ndim) for b in range(len(chunks))}
        tasks: dict = {t: Task(t, operator.getitem, TaskRef((name, b)), k) for b, t in keys.items()}
        hlg = HighLevelGraph({**base.layers, leaf: tasks}, {**base.dependencies, leaf: {name}})
        return da.Array(hlg, leaf, chunks=(chunks, *((n,) for n in aval.shape)),
                        meta=np.empty((0,) * (ndim + 1), aval.dtype))

    def tree(label: str, avals):
        leaves = [array(f"{label}{j}", a) for j, a in enumerate(jax.tree.leaves(avals))]
        return jax.tree.structure(avals).unflatten(leaves)

    return {o: (tree(f"{o}-value", values[o]),
                {i: tree(f"{o}-grad-{i}", grads[o][i]) for i in planned.plan.wrt})
            for o in planned.plan.outputs}


def _needs(plan) -> dict:
    """The resources a block task needs: of each, the most any of its nodes needs."""
    needs: dict = {}
    for n in plan.needed:
        for r, amount in plan.spec.nodes[n].needs.items():
            needs[r] = max(needs.get(r, 0), amount)
    return needs


# -- in the task that runs a block ----------------------------------------------------------------

def _run_block(loaded: tuple, start: int, *args) -> list:
    """One block: the chunk graph over its items (``args``: the shared inputs, those broadcast,
    then the block of each dask array); its result leaves as NumPy arrays, in
    :meth:`_Blocks.leaves`' order. Its :class:`~daskdag.NodeError` names the first failing item
    (``start``: the block's first), found item by item where the block failed as a whole."""
    tasks, key, blocks = loaded
    shared = dict(zip(blocks.shared.values(), args))
    bcast = dict(zip(blocks.broadcast, args[len(shared):]))
    data = args[len(shared) + len(bcast):]
    size = len(data[0])
    if size == 0:
        return [np.empty((0, *a.shape), a.dtype) for a in blocks.leaves()]
    try:
        done = run_chunk(progress.ChunkRun(size, 0, lambda: False),
                         lambda: _run(tasks, key, blocks, shared, bcast, data, 0, size))
    except NodeError as e:
        if size == 1 or e.item is not None:
            raise _at(e, start + (e.item or 0)) from e.original
        for i in range(size):
            try:
                _run(tasks, key, blocks, shared, bcast, data, i, i + 1)
            except NodeError as one:
                raise _at(one, start + i) from one.original
        raise
    if done.failed or done.computed is None:
        first = min(done.failed)
        raise _at(done.failed[first], start + first) from done.failed[first].original
    return _flat(blocks, done.computed, size)


def _at(e: NodeError, item: int) -> NodeError:
    return NodeError(e.node, e.phase, e.original, item=item)


def _run(tasks, key, blocks: _Blocks, shared: dict, bcast: dict, data, lo: int, hi: int):
    items = {i: jax.tree.map(lambda a: data[a.k][lo:hi] if isinstance(a, _Slot) else a,
                             unpack(template)) for i, template in blocks.templates.items()}
    items.update({i: jax.tree.map(lambda a: np.broadcast_to(a, (hi - lo, *np.shape(a)))
                                  if is_array(a) else a, value) for i, value in bcast.items()})
    return dask.get(bound(tasks, shared, items), key)


def _flat(blocks: _Blocks, computed: dict, size: int) -> list:
    out = []
    for o, value_avals, grads in blocks.layout:
        value, gs = computed[o]
        out += _leaves(f"output {o!r}", value, value_avals, size)
        for i, avals in grads:
            out += _leaves(f"the gradient of {o!r} wrt {i!r}", gs[i], avals, size)
    return out


def _leaves(what: str, tree, avals: list, size: int) -> list:
    """``tree``'s leaves as NumPy arrays of ``size`` rows, checked against one item's ``avals``:
    :class:`~daskdag.sweeps.chunked.Items` stacked, a value the same for every item broadcast."""
    leaves = jax.tree.leaves(stacked(tree, numpy=True))
    if len(leaves) != len(avals):
        raise DAGError(f"{what} has {len(leaves)} array leaves, but jax.eval_shape gave it "
                       f"{len(avals)}")
    out = []
    for leaf, aval in zip(leaves, avals):
        a = np.asarray(leaf)
        if a.shape == tuple(aval.shape) and a.shape != (size, *aval.shape):
            a = np.broadcast_to(a, (size, *a.shape))  # the same for every item
        if a.shape != (size, *aval.shape):
            raise DAGError(f"{what} has a leaf shaped {a.shape[1:]} for one item, but "
                           f"jax.eval_shape gave {tuple(aval.shape)}")
        out.append(a.astype(aval.dtype, copy=False))
    return out
