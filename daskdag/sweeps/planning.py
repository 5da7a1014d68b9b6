"""A sweep's plan: what every chunk of it shares (:class:`Sweep`), made once per DAG and one
item's shapes (:func:`prepare`, keyed by :func:`item_signature`), and how big its chunks are
(:func:`default_chunk_size`) and how many item steps each takes (:func:`chunk_steps`).

Each chunk is the graph :func:`daskdag.graph.build.build` makes for one call, over a spec whose
node functions take a whole chunk (:class:`~daskdag.sweeps.chunked.Chunked`: vectorized for
``Node(vmap=True)``, else item by item; :func:`plan_sweep`). The loop over the chunks is
:mod:`daskdag.sweeps.sweep`'s.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.graph.build import GradientSeeding, JacobianSeeding, build
from daskdag.graph.run import chain_of_elements
from daskdag.graph.stages import Stage, make_stages
from daskdag.model.leaves import is_array
from daskdag.model.plan import Plan, make_plan, ship
from daskdag.model.request import batch_size, batched_names, parsed
from daskdag.model.shapes import signature
from daskdag.model.spec import Node, Spec
from daskdag.sweeps.chunked import CHUNK, Chunked, chunk_of
from daskdag.transport.pickler import JaxArray
from daskdag.transport.transports import Transport


def is_dask_array(obj) -> bool:
    """Whether ``obj`` is a dask array (none can be while ``dask.array`` is not imported: it is
    imported for a sweep over dask arrays, or a store's lazy results)."""
    module = sys.modules.get("dask.array")
    return module is not None and isinstance(obj, module.Array)


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
    transport: Transport  # how chunk graphs take in their values (daskdag.transport.transports)
    # nodes of shared inputs differentiated per item, run once (daskdag.sweeps.shared.Through)
    through: Any = None
    # the kind of call lowered (daskdag.running.passes.Lowering): its inputs and results
    lowering: Any = None

    @property
    def vectorized(self) -> bool:
        """Every node that carries items runs as ``jit(vmap)`` over a chunk."""
        return all(chunk.node.vmap for n in self.plan.needed
                   if (chunk := chunk_of(self.plan.spec.nodes[n])) is not None)

    @property
    def by_item(self) -> bool:
        """No node that carries items is ``vmap=True``: each item is computed on its own, so
        a chunk cut into pieces gives the numbers it would have whole."""
        return not any(chunk.node.vmap for n in self.plan.needed
                       if (chunk := chunk_of(self.plan.spec.nodes[n])) is not None)

    def shared(self, name: str) -> bool:
        return name not in self.batched and name not in self.broadcast

    def carried(self) -> list[str]:
        """The inputs that carry items (the keys of :meth:`items`): batched ones, and shared ones
        differentiated per item."""
        return [i for i in self.values if not self.shared(i)]

    def items(self, start: int, stop: int) -> dict[str, Any]:
        """Items ``start:stop`` of the inputs that carry them: batched inputs sliced, shared
        inputs differentiated per item broadcast. Array leaves carry the items; other leaves
        (functions...) are shared."""
        def part(a):
            if is_dask_array(a):  # (a store's dask-array items: read chunk by chunk here)
                return np.asarray(a[start:stop])
            if not is_array(a):
                return a
            if self.transport.remote:
                return rows(a, start, stop)
            # (all of a JAX array: itself, where slicing would dispatch a copy)
            return a if start == 0 and stop == len(a) else a[start:stop]

        values = {}
        for i in self.carried():
            v = self.values[i]
            if i in self.batched:
                values[i] = jax.tree.map(part, v)
            else:
                values[i] = jax.tree.map(lambda a: jnp.broadcast_to(a, (stop - start, *jnp.shape(a)))
                                         if is_array(a) else a, v)
        return values

    def chunk(self, start: int, stop: int):
        """The Dask graph of items ``start:stop``: ``{output: (value, {input: grad})}``, the
        items' values inside it."""
        return self.graph(self.items(start, stop))

    def graph(self, values: dict):
        """The Dask graph of a chunk whose :meth:`carried` inputs (and any others given) are
        ``values``: the values themselves, or references (``dask.task_spec.TaskRef``) to them.
        Nothing else in it depends on which items, or how many, the chunk holds: items enter
        only as these inputs, and the seeds of the outputs' cotangents take the item count
        from the outputs when they run (:func:`daskdag.rules.seeds.seed`)."""
        rows = getattr(self.lowering, "rows", None)
        seeding = (GradientSeeding(self.cotangents, CHUNK) if rows is None
                   else JacobianSeeding(rows, CHUNK))
        return build(self.plan, {**self.values, **values}, seeding, self.transport)


def prepare(kind, xs, data: tuple, batched, transport: Transport, watch) -> Sweep:
    """A sweep of ``kind`` (a :class:`~daskdag.running.passes.Derivative`) compiled
    (:mod:`daskdag.running.programs`): the arguments checked, the kind lowered on one item
    (its inputs' first rows; ``wrt`` defaults to the batched inputs), and what every chunk of
    every sweep like it shares (:func:`plan_sweep`), but the values, their number and the
    cotangents, which :func:`~daskdag.sweeps.sweep.sweep` puts in. ``watch`` takes the
    fingerprints of the functions packed."""
    spec, names, values = parsed(kind.dag, xs, kind.outputs, watch.hold)
    batched = batched_names(values, batched)
    size = batch_size(values, batched)
    one = {i: jax.tree.map(lambda a: first_row(a, size), v) if i in batched else v
           for i, v in values.items()}
    for n in spec.order:  # (as they are now, before a kind that traces them runs their code)
        watch(n, spec.nodes[n].fn)
    lowering = kind.lower(spec, names, one, data, {i: one[i] for i in batched}, watch)
    lowered = lowering.plan.spec
    prints = {id(lowered.nodes[n].fn): watch(n, lowered.nodes[n].fn) for n in lowered.order}
    return replace(plan_sweep(lowered, names, {}, batched, lowering.plan.wrt, {}, 0, transport,
                              prints=prints), lowering=lowering)


def first_row(a, size: int):
    """An item's stand-in for a leaf of a batched input: its first row (zeros, where the batch
    holds none)."""
    if not is_array(a):
        return a
    return a[0] if size else np.zeros(a.shape[1:], a.dtype)


def item_signature(dag, xs, batched) -> tuple | None:
    """The inputs' structure and one item's shapes, as a preparation's key (the number of
    items changes nothing prepared); None where the arguments are not those of a sweep."""
    try:
        spec = {d for entry in dag.values() for d in (entry.deps if isinstance(entry, Node)
                                                      else entry[1])} - set(dag)
        values = {next(iter(spec)): xs} if len(spec) == 1 else dict(xs)
        names = batched_names(values, batched)
        return tuple((i, name in names, signature(item(v) if name in names else v))
                     for i, (name, v) in enumerate(values.items()))
    except Exception:
        return None


def item(value):
    """One item's stand-in: each array leaf's shape and dtype, less the item axis."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
                        if is_array(a) and a.ndim else a, value)


def rows(a, start: int, stop: int):
    """Rows ``start:stop`` of the array ``a``, to be packed: a JAX array's as a view of its NumPy
    value (slicing the JAX array would dispatch a copy, and packing copy it out again), a JAX
    array again on arrival."""
    if isinstance(a, jax.Array):
        return JaxArray(np.asarray(a)[start:stop])
    return a[start:stop]


def plan_sweep(spec: Spec, outputs, values, batched, wrt, cotangents, size, transport: Transport,
               prints: dict | None = None) -> Sweep:
    """What every chunk shares. ``transport``: how chunk graphs take in their values
    (:mod:`daskdag.transport.transports`); ``prints``: the node functions' fingerprints, by
    ``id``, as a preparation took them."""
    prints = {} if prints is None else prints
    broadcast = frozenset(w for w in wrt if w not in spec.nodes) - frozenset(batched)
    carrying = set(batched) | broadcast
    nodes = {}
    for n in spec.order:
        node = spec.nodes[n]
        in_axes = tuple(0 if d in carrying else None for d in node.deps)
        if 0 in in_axes:  # nodes of shared inputs alone stay as they are: one key, run once
            carrying.add(n)
            # Its function packed inside too: its content token keys the chunk's compiled
            # programs (shipping.current), so a change in place compiles anew.
            inner = replace(node, fn=transport.pack_function(f"node {n!r}: its function", node.fn,
                                                             prints=prints))
            node = replace(node, fn=Chunked(inner, in_axes, n), jit=False, vmap=False)
        nodes[n] = node
    plan = ship(make_plan(replace(spec, nodes=nodes), outputs, tuple(wrt)), transport)
    return Sweep(plan, values, frozenset(batched), broadcast, frozenset(carrying), cotangents, size,
                 transport)


def default_chunk_size(sweep: Sweep, parallelism: int) -> int:
    """Item by item: about four chunks per parallel slot, for balance, and at most 256 items
    per chunk. Vectorized (every node that carries items is ``vmap=True``, so a chunk is one
    program over its items): also about four per slot, so that items and results travel while
    other chunks compute, but none under :data:`VECTOR_CHUNK_BYTES` ``[0]`` of items (a chunk's
    fixed cost would outweigh it) unless that leaves a slot without a chunk, and none over
    ``[1]``, to bound memory."""
    size = sweep.size
    if not sweep.vectorized:
        return max(1, min(256, math.ceil(size / (4 * parallelism))))
    batch_bytes = sum(leaf.nbytes for i in sweep.batched
                      for leaf in jax.tree.leaves(sweep.values[i]) if is_array(leaf))
    item_bytes = max(1.0, batch_bytes / max(size, 1))
    least, most = (int(b // item_bytes) for b in VECTOR_CHUNK_BYTES)
    chunk = min(max(math.ceil(size / (4 * parallelism)), least), math.ceil(size / parallelism))
    return max(1, min(chunk, most))


VECTOR_CHUNK_BYTES = (16 * 2 ** 20, 64 * 2 ** 20)  # items per vectorized chunk, at least / at most


def chunk_steps(plan: Plan, items: int) -> int:
    """Item steps of a chunk of ``items`` under ``plan`` (of a chunked spec): each stage's
    forward pass item by item (:func:`steps_per_item`), and its backward pass
    (for all outputs at once) where a gradient passes through it."""
    steps = 0
    for s in make_stages(plan):
        per_item = steps_per_item(s, [plan.spec.nodes[n] for n in s.nodes])
        backward = any(set(s.nodes) & set(plan.backward[o]) for o in plan.outputs)
        steps += per_item * (2 if backward else 1)
    return items * steps


def steps_per_item(stage: Stage, nodes) -> int:
    """How often a chunk's forward pass of ``stage`` steps from one item to the next
    (:func:`~daskdag.sweeps.progress.checkpoint`): once per item-by-item node, or once for a
    chain of them linearized as one (:func:`daskdag.graph.run.linearize`)."""
    by_item = [n for n in nodes if (c := chunk_of(n)) is not None and not c.node.vmap]
    if len(nodes) > 1 and stage.has_pullback and by_item and chain_of_elements(nodes) is not None:
        return 1
    return len(by_item)
