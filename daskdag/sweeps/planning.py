"""A sweep's plan: what every chunk shares (:class:`Sweep`), prepared once per DAG and one
item's shapes (:func:`prepare`), and its chunks' sizes and item steps. Each chunk is the graph
:func:`daskdag.graph.build.build` makes for one call, over a spec whose nodes take a whole chunk
(:class:`~daskdag.sweeps.chunked.Chunked`).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.graph.build import GradientSeeding, JacobianSeeding, build
from daskdag.graph.tasks import chain_of_elements
from daskdag.graph.stages import Stage, make_stages
from daskdag.model.leaves import is_array, signature
from daskdag.model.plan import Plan, make_plan, ship
from daskdag.model.request import batch_size, batched_names, parsed
from daskdag.model.spec import Node, Spec
from daskdag.sweeps.chunked import CHUNK, Chunked, chunk_of
from daskdag.transport.pickler import JaxArray
from daskdag.transport.transports import Transport


def is_dask_array(obj) -> bool:
    """Whether ``obj`` is a dask array (without importing ``dask.array``)."""
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
    transport: Transport  # how chunk graphs take in their values
    through: Any = None  # nodes of shared inputs differentiated per item, run once (shared.py)
    lowered: Any = None  # the kind of call lowered (daskdag.running.passes.Lowered)
    # what the calls of the same preparation share while the plan is the same (:meth:`per_plan`)
    kept: dict = field(default_factory=dict, compare=False, repr=False)

    def _vmap(self) -> list[bool]:
        """Per node that carries items, whether it is ``vmap=True``."""
        return [chunk.node.vmap for n in self.plan.needed
                if (chunk := chunk_of(self.plan.spec.nodes[n])) is not None]

    @property
    def vectorized(self) -> bool:
        """Every node that carries items runs as ``jit(vmap)`` over a chunk."""
        return all(self._vmap())

    @property
    def by_item(self) -> bool:
        """No node that carries items is ``vmap=True``: a chunk cut into pieces gives the
        numbers it would have whole."""
        return not any(self._vmap())

    def per_plan(self, which, make: Callable[[], Any]) -> Any:
        """``make()``, made once while the plan is this one and kept with the preparation (a
        sweep whose shared work ran once has a plan of its own) under ``which``."""
        hit = self.kept.get(which)
        if hit is None or hit[0] is not self.plan:
            hit = self.kept[which] = (self.plan, make())
        return hit[1]

    def shared(self, name: str) -> bool:
        return name not in self.batched and name not in self.broadcast

    def carried(self) -> list[str]:
        """The inputs that carry items: batched ones, and those broadcast."""
        return [i for i in self.values if not self.shared(i)]

    def items(self, start: int, stop: int) -> dict[str, Any]:
        """Items ``start:stop`` of the inputs that carry them: batched inputs' array leaves
        sliced, broadcast inputs broadcast."""
        def part(a):
            if is_dask_array(a):  # a store's dask-array items, read chunk by chunk
                return np.asarray(a[start:stop])
            if not is_array(a):
                return a
            if self.transport.remote and isinstance(a, jax.Array):
                # To be packed: a view of its NumPy value, a JAX array again on arrival.
                return JaxArray(np.asarray(a)[start:stop])
            # All of an array: itself, where slicing a JAX array would dispatch a copy.
            return a if start == 0 and stop == len(a) else a[start:stop]

        def broadcast(a):
            return jnp.broadcast_to(a, (stop - start, *jnp.shape(a))) if is_array(a) else a

        return {i: jax.tree.map(part if i in self.batched else broadcast, self.values[i])
                for i in self.carried()}

    def graph(self, values: dict):
        """The Dask graph ``{output: (value, {input: grad})}`` of a chunk whose :meth:`carried`
        inputs (and any others given) are ``values``, or references (``TaskRef``) to them.
        Nothing else in it depends on which items, or how many, the chunk holds."""
        rows = getattr(self.lowered, "rows", None)
        seeding = (GradientSeeding(self.cotangents, CHUNK) if rows is None
                   else JacobianSeeding(rows, CHUNK))
        return build(self.plan, {**self.values, **values}, seeding, self.transport)


def prepare(kind, xs, data: tuple, batched, transport: Transport, watch) -> Sweep:
    """A sweep of ``kind`` (a :class:`~daskdag.running.passes.Derivative`) prepared: the
    arguments checked, the kind lowered on one item (its inputs' first rows), and what every
    chunk shares (:func:`plan_sweep`) but the values, their number and the cotangents.
    ``watch`` takes the fingerprints of the functions packed."""
    spec, names, values = parsed(kind.dag, xs, kind.outputs, watch.hold)
    batched = batched_names(values, batched)
    size = batch_size(values, batched)
    one = {i: jax.tree.map(lambda a: first_row(a, size), v) if i in batched else v
           for i, v in values.items()}
    for n in spec.order:  # as they are now, before a kind that traces them runs their code
        watch(n, spec.nodes[n].fn)
    lowered = kind.lower(spec, names, one, data, {i: one[i] for i in batched}, watch)
    runs = lowered.plan.spec  # (the DAG the passes run: lifted, for a forward kind)
    prints = {id(runs.nodes[n].fn): watch(n, runs.nodes[n].fn) for n in runs.order}
    return replace(plan_sweep(runs, names, {}, batched, lowered.plan.wrt, {}, 0, transport,
                              prints=prints), lowered=lowered)


def first_row(a, size: int):
    """A batched leaf's first row (zeros, where it has none)."""
    if not is_array(a):
        return a
    return a[0] if size else np.zeros(a.shape[1:], a.dtype)


def item_signature(dag, xs, batched) -> tuple | None:
    """The inputs' structure and one item's shapes, as a preparation's key; None where the
    arguments are not those of a sweep."""
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


def plan_sweep(spec: Spec, outputs, values, batched, wrt, cotangents, size, transport: Transport,
               prints: dict | None = None) -> Sweep:
    """What every chunk shares, each node that carries items as a :class:`Chunked`. ``prints``:
    the node functions' fingerprints, by ``id``."""
    prints = {} if prints is None else prints
    broadcast = frozenset(w for w in wrt if w not in spec.nodes) - frozenset(batched)
    carrying = set(batched) | broadcast
    nodes = {}
    for n in spec.order:
        node = spec.nodes[n]
        in_axes = tuple(0 if d in carrying else None for d in node.deps)
        if 0 in in_axes:  # nodes of shared inputs alone stay as they are, run once
            carrying.add(n)
            # Its function packed inside too: its content token keys the compiled programs,
            # so a change in place compiles anew.
            inner = replace(node, fn=transport.pack_function(f"node {n!r}: its function", node.fn,
                                                             prints=prints))
            node = replace(node, fn=Chunked(inner, in_axes, n), jit=False, vmap=False)
        nodes[n] = node
    plan = ship(make_plan(replace(spec, nodes=nodes), outputs, tuple(wrt)), transport)
    return Sweep(plan, values, frozenset(batched), broadcast, frozenset(carrying), cotangents, size,
                 transport)


def default_chunk_size(sweep: Sweep, parallelism: int) -> int:
    """About four chunks per parallel slot, for balance. Item by item: at most 256 items a
    chunk. Vectorized: none under :data:`VECTOR_CHUNK_BYTES` ``[0]`` of items (a chunk's fixed
    cost would outweigh it) unless that leaves a slot without a chunk, none over ``[1]``."""
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


def chunk_steps(sweep: Sweep, items: int) -> int:
    """Item steps of a chunk of ``items`` of ``sweep`` (:func:`item_steps` of its plan)."""
    return items * sweep.per_plan("item steps", lambda: item_steps(sweep.plan))


def item_steps(plan: Plan) -> int:
    """Steps a chunk takes per item: each stage's forward pass, and its backward pass where a
    gradient passes through it."""
    steps = 0
    for s in make_stages(plan):
        per_item = steps_per_item(s, [plan.spec.nodes[n] for n in s.nodes])
        backward = any(set(s.nodes) & set(plan.backward[o]) for o in plan.outputs)
        steps += per_item * (2 if backward else 1)
    return steps


def steps_per_item(stage: Stage, nodes) -> int:
    """How often a chunk's forward pass of ``stage`` steps from one item to the next: once per
    item-by-item node, or once for a chain of them linearized as one."""
    by_item = [n for n in nodes if (c := chunk_of(n)) is not None and not c.node.vmap]
    if len(nodes) > 1 and stage.has_pullback and by_item and chain_of_elements(nodes) is not None:
        return 1
    return len(by_item)
