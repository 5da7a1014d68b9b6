"""Stages: the units a call runs as Dask tasks, between the plan and the graph.

In:  a :class:`~daskdag.model.plan.Plan`.
Out: its needed nodes grouped into :class:`Stage` s, in topological order. :func:`make_stages`
     runs nothing; :func:`linearize` runs a stage's nodes, in the stage's forward task.

A stage runs as one forward task and one backward task (for every output whose gradient passes
through it: :func:`daskdag.graph.tasks.backward` pulls their cotangents back together). Two kinds:

- **chains** of eager nodes ``n1 -> n2 -> ... -> nk``: each node but the last feeds only the next
  and is no requested output. Every edge in a chain is a dependency Dask could never use (the
  next node needs the value at once), while on a ``distributed`` cluster each task costs a
  scheduler round trip of a few milliseconds. The nodes run one by one, each under its own
  ``jax.vjp`` (or its kind's linearizer, :data:`daskdag.rules.pullback.LINEARIZERS`: a sweep's
  chunk runs one vjp per item), so they keep their semantics: called once, in order, op by
  op, Python control flow and side effects included. A node with several consumers ends its
  chain, so fan-out keeps its parallelism; a node that takes values from other stages starts a
  chain of its own, so fan-in does too (a stage starts once all its deps are there).
- **fused** groups of connected jittable nodes (``jit=True``; in a sweep, ``vmap=True``): one
  function of the group's inputs, linearized once as one XLA program (in a sweep,
  ``jit(vmap(vjp))`` over the chunk), so XLA sees across node boundaries. Several of its nodes
  may be used outside it (or be requested outputs); their values are the stage's ``exposed``
  values.

A stage whose cotangents all start at its own outputs is *closed* (:mod:`daskdag.graph.build`): its
forward task runs its backward pass too (:func:`daskdag.graph.tasks.forward_backward`); a fused one
then runs as one program (:func:`gradients`), as ``jax.jit`` of each output's
``value_and_grad`` would.

All nodes of a stage need the same resources. ``dask.config`` ``daskdag.fuse-chains`` (default
True): False makes every node its own stage.
"""

from __future__ import annotations

import contextlib
import graphlib
import threading
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

from dask.sizeof import sizeof
import jax.numpy as jnp

from daskdag.sweeps.chunked import Chunked, chunk_of
from daskdag.rules.custom import is_custom
from daskdag.errors import node_errors
from daskdag.model.plan import Plan
from daskdag.cancel import Cancelled
from daskdag.rules.pullback import ct_avals, differentiable_leaves, has_linearizer, linearizer
from daskdag.rules.pullback import linearize as vjp_linearize
from daskdag.transport.packing import current
from daskdag.model.spec import Node
from daskdag import config



@dataclass(frozen=True)
class Stage:
    """Nodes run in one task. ``sources[j][k]`` says where node ``j``'s ``k``-th dep comes from:
    ``("dep", i)`` is ``deps[i]``, a value from outside the stage (a free input or another
    stage's node); ``("node", i)`` is the stage's own node ``i``. ``active[j][k]``: that dep is
    differentiated (a ``wrt`` input or a node that depends on one). ``exposed``: indices of the
    nodes whose values leave the stage (used by other stages, or requested). ``fused``: its
    nodes run as one jitted function (see the module's docstring)."""

    nodes: tuple[str, ...]
    deps: tuple[str, ...]
    sources: tuple[tuple[tuple[str, int], ...], ...]
    active: tuple[tuple[bool, ...], ...]
    exposed: tuple[int, ...]
    needs: tuple  # the nodes' Dask resources, as sorted (name, amount) pairs
    fused: bool = False

    @property
    def name(self) -> str:
        """For task keys: ``B+C+D``, or ``n0+998more+n999`` for a long chain."""
        return abbreviate(self.nodes)

    @property
    def outputs(self) -> tuple[str, ...]:
        """The names of the exposed nodes."""
        return tuple(self.nodes[j] for j in self.exposed)

    @property
    def linearized(self) -> bool:
        """Some node runs under ``jax.vjp``: the forward task leaves a pullback."""
        return any(any(a) for a in self.active)

    @property
    def bare(self) -> bool:
        """The forward task's result is its one exposed value itself (no pullback, no tuple), so
        later stages read it directly."""
        return not self.linearized and len(self.exposed) == 1

    def dep_active(self) -> tuple[bool, ...]:
        """Per dep: differentiated by some node of the stage."""
        on = [False] * len(self.deps)
        for sources, active in zip(self.sources, self.active):
            for (kind, i), a in zip(sources, active):
                if kind == "dep" and a:
                    on[i] = True
        return tuple(on)


def make_stages(plan: Plan) -> tuple[Stage, ...]:
    """The plan's needed nodes as stages (see the module's docstring), in topological order."""
    spec, needed = plan.spec, set(plan.needed)
    fuse = config.get("fuse-chains")
    groups: list[list[str]] = []
    group_of: dict[str, int] = {}
    jittable: dict[int, bool] = {}
    takes: dict[int, set[int]] = {}  # group -> the groups it takes values from

    def consumers(d):
        return {c for c, _ in spec.uses.get(d, ()) if c in needed}

    def comes_after(e, g):  # group e takes values from g, directly or not
        seen, stack = set(), [e]
        while stack:
            h = stack.pop()
            if h == g:
                return True
            if h not in seen:
                seen.add(h)
                stack.extend(takes[h])
        return False

    for n in plan.needed:
        node, deps = spec.nodes[n], [d for d in dict.fromkeys(spec.nodes[n].deps) if d in group_of]
        kind = _jittable(node)
        joined = None
        for d in deps if fuse else ():
            g = group_of[d]
            if spec.nodes[d].needs != node.needs or jittable[g] != kind:
                continue
            if any(e in plan.wrt for e in deps if group_of[e] == g):
                continue  # (a node in wrt: its cotangent must leave its stage, see _stage)
            others = {group_of[e] for e in deps} - {g}
            if kind:  # fused: any connected group no other dep of n comes after
                if not any(comes_after(h, g) for h in others):
                    joined = g
                    break
            # chain: n follows d, its one consumer, and takes nothing g does not wait for
            # already (a stage starts once all its deps are there: a fan-in node joining one
            # branch's chain would hold that branch back until the others are done)
            elif groups[g][-1] == d and d not in plan.outputs and consumers(d) == {n} \
                    and others <= takes[g]:
                joined = g
                break
        if joined is None:
            joined = len(groups)
            groups.append([])
            jittable[joined], takes[joined] = kind, set()
        groups[joined].append(n)
        group_of[n] = joined
        takes[joined] |= {group_of[e] for e in deps} - {joined}
    # A group may grow past a later group's start (D joining B's in a diamond A->B,C->D): order
    # the groups by what they take from each other.
    order = graphlib.TopologicalSorter(takes).static_order()
    return tuple(_stage(plan, tuple(groups[g]), jittable[g] and len(groups[g]) > 1, consumers)
                 for g in order)


def _jittable(node: Node) -> bool:
    chunk = chunk_of(node)
    if chunk is not None:  # (a vmap node of the user's own code vectorizes itself)
        return chunk.node.vmap and not is_custom(chunk.node.fn)
    return node.jit


def _stage(plan: Plan, nodes: tuple[str, ...], fused: bool, consumers) -> Stage:
    spec, index = plan.spec, {n: j for j, n in enumerate(nodes)}
    deps: dict[str, int] = {}
    sources, active = [], []
    for n in nodes:
        ds = spec.nodes[n].deps
        sources.append(tuple(("node", index[d]) if d in index else
                             ("dep", deps.setdefault(d, len(deps))) for d in ds))
        active.append(tuple(d in plan.wrt or d in plan.active for d in ds))
    exposed = tuple(j for j, n in enumerate(nodes) if n in plan.outputs or n in plan.wrt
                    or any(c not in index for c in consumers(n)))
    needs = tuple(sorted(spec.nodes[nodes[0]].needs.items()))
    return Stage(nodes, tuple(deps), tuple(sources), tuple(active), exposed, needs, fused)


# -- running a stage ------------------------------------------------------------------------------

def linearize(stage: Stage, nodes: Sequence[Node], deps: Sequence[Any], dropped=None):
    """Run the stage's ``nodes`` on the values of its ``deps``. Returns the exposed values (a
    tuple), and with them its pullback when some node ran under ``jax.vjp``: ``(values,
    pullback)``. ``dropped()``, asked between two nodes, stops it (:class:`Cancelled`)."""
    if stage.fused:
        return _linearize_fused(stage, nodes, deps)
    if len(nodes) > 1 and stage.linearized:
        if not any(map(has_linearizer, nodes)):
            return _linearize_chain(stage, nodes, deps, dropped)
        if _items_chain(nodes):
            return _linearize_chain_of_items(stage, [chunk_of(n) for n in nodes], deps, dropped)
    values, pullbacks = [], []
    for name, node, sources, active in zip(stage.nodes, nodes, stage.sources, stage.active):
        if values and dropped is not None and dropped():
            raise Cancelled(f"the call no longer waits for node {name!r}")
        inputs = [deps[i] if kind == "dep" else values[i] for kind, i in sources]
        with node_errors(name, "forward"):
            if any(active):
                primal, pullback = linearizer(node)(inputs, active)
            else:
                primal, pullback = node.callable()(*inputs), None
        _not_none(name, primal)
        values.append(primal)
        pullbacks.append(pullback)
    exposed = tuple(values[j] for j in stage.exposed)
    if not stage.linearized:
        return exposed
    # Keep the values that a node's pullback may take as inputs; drop the rest now.
    taken = {i for sources, pb in zip(stage.sources, pullbacks) if pb is not None
             for kind, i in sources if kind == "node"}
    kept = [v if j in taken else None for j, v in enumerate(values)]
    return exposed, StagePullback(stage, pullbacks, kept)


class StagePullback:
    """The backward half of a chain stage: its nodes' pullbacks, and the values of its own nodes
    that later nodes took as inputs (a pullback that moved to another process takes its input
    residuals from them, see :class:`~daskdag.rules.pullback.Pullback`).

    Call: ``pullback(cts, deps, dropped=None)``, with one cotangent per exposed node (a flat
    tuple, see :mod:`daskdag.rules.pullback`; ``None`` where none flows) and the values of
    ``stage.deps``; returns a tuple aligned with ``stage.deps``: each dep's cotangent, ``None``
    where none flows. A node that fails is named in a :class:`~daskdag.NodeError`.
    ``dropped()``, asked between two nodes, stops it (:class:`Cancelled`) when true.
    """

    __slots__ = ("stage", "pullbacks", "values")

    def __init__(self, stage: Stage, pullbacks: Sequence[Any], values: Sequence[Any]):
        self.stage, self.pullbacks, self.values = stage, tuple(pullbacks), tuple(values)

    def __call__(self, cts: tuple, deps: Sequence[Any], dropped=None) -> tuple:
        stage = self.stage
        flowing: list = [None] * len(stage.nodes)
        for j, ct in zip(stage.exposed, cts):
            flowing[j] = ct
        out: list = [None] * len(stage.deps)
        ran = False
        for j in reversed(range(len(stage.nodes))):
            if self.pullbacks[j] is None or flowing[j] is None:  # held constant, or nothing flows
                continue
            if ran and dropped is not None and dropped():
                raise Cancelled(f"the call no longer waits for node {stage.nodes[j]!r}")
            inputs = [deps[i] if kind == "dep" else self.values[i] for kind, i in stage.sources[j]]
            with node_errors(stage.nodes[j], "backward"):
                shares = self.pullbacks[j](flowing[j], inputs)
            ran = True
            for (kind, i), share in zip(stage.sources[j], shares):
                if share is not None:
                    into = out if kind == "dep" else flowing
                    into[i] = share if into[i] is None else add(into[i], share)
        return tuple(out)

    @property
    def batching(self):
        """Its nodes' common :attr:`~daskdag.rules.pullback.Pullback.batching`, else None."""
        kinds = {pb.batching for pb in self.pullbacks if pb is not None}
        return kinds.pop() if len(kinds) == 1 else None

    @property
    def traceable(self) -> bool:
        """No node's pullback is the user's own code (:mod:`daskdag.rules.custom`): JAX can trace it."""
        return all(getattr(pb, "traceable", True) for pb in self.pullbacks if pb is not None)

    def residual_nbytes(self) -> int:
        """Bytes that moving it ships: the pullbacks' residuals and the kept values."""
        return (sum(pb.residual_nbytes() for pb in self.pullbacks if pb is not None)
                + sum(sizeof(v) for v in self.values if v is not None))

    def __reduce__(self):  # node pullbacks pickle as their portable forms, arrays out of band
        return StagePullback, (self.stage, self.pullbacks, self.values)


# -- fused stages ---------------------------------------------------------------------------------

class Fused:
    """A stage's nodes as one function: the values of its deps in, its exposed values (a
    tuple) out, each node called once, in order. ``fns``: the nodes' plain functions (item by
    item in a sweep); ``weakly``: held weakly where they can be, so that a cached ``Fused``
    (and JAX's compilations of it) keeps no user function alive. ``dropped()``, asked between
    two nodes, stops it (:class:`Cancelled`)."""

    def __init__(self, stage: Stage, fns: Sequence, dropped=None, weakly: bool = False):
        self.stage, self.dropped = stage, dropped
        self._fns = tuple(_weak(f) if weakly else partial(itself, f) for f in fns)

    @property
    def fns(self) -> tuple:
        return tuple(f() for f in self._fns)

    def __call__(self, *deps):
        values = []
        for name, fn, sources in zip(self.stage.nodes, self.fns, self.stage.sources):
            if values and self.dropped is not None and self.dropped():
                raise Cancelled(f"the call no longer waits for node {name!r}")
            with node_errors(name, "forward"):
                values.append(fn(*[deps[i] if kind == "dep" else values[i] for kind, i in sources]))
            _not_none(name, values[-1])
        return tuple(values[j] for j in self.stage.exposed)

    def __reduce__(self):
        return Fused, (self.stage, self.fns)


def _weak(fn):
    try:
        return weakref.ref(fn)
    except TypeError:
        return partial(itself, fn)


def itself(x):
    """``x``: as a task, a value kept on the cluster; bound with ``partial``, a picklable
    function that returns it."""
    return x


_fused_lock = threading.Lock()
_fused: dict = {}  # (stage, ids of fns) -> (its Chunked function, Fused), while its functions live


def _fused_function(stage: Stage, nodes: Sequence[Node]) -> Chunked:
    """The fused stage as one :class:`~daskdag.sweeps.chunked.Chunked` function, the same object while
    the same node functions live: its compiled programs are cached by function, so later calls
    and chunks compile nothing. In a sweep it is ``vmap`` ped over its deps' item axes;
    elsewhere it has none, and is only jitted."""
    chunks = [chunk_of(n) for n in nodes]
    fns = [current(c.node.fn) if c else current(n.fn) for c, n in zip(chunks, nodes)]
    key = (stage, tuple(map(id, fns)))
    with _fused_lock:
        hit = _fused.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[1].fns, fns)):
            return hit[0]
    fused = Fused(stage, fns, weakly=True)
    chunk = Chunked(Node(fused, stage.deps, vmap=True), _in_axes(stage, chunks))
    with _fused_lock:
        _fused[key] = chunk, fused
        for f in fns:  # the entry goes with the first of its functions to go
            with contextlib.suppress(TypeError):
                weakref.finalize(f, _fused.pop, key, None)
    return chunk


def _not_none(name: str, value) -> None:
    if value is None:  # None is an empty pytree to JAX: it would fail later, far from here
        with node_errors(name, "forward"):
            raise TypeError("its function returned None; a node must return its value, a JAX "
                            "array or a pytree of arrays (is a `return` missing?)")


def _linearize_chain(stage: Stage, nodes, deps, dropped):
    """A chain of eager nodes under one ``jax.vjp``, as the seed question's hand-written code
    takes the vjp of its common pipeline: each node still called once, in order, op by op
    (Python control flow and side effects as written), but one vjp's fixed cost for the chain
    instead of one per node. Its pullback is one too (:class:`FusedPullback`)."""
    fused = Fused(stage, [n.callable() for n in nodes], dropped)
    values, pullback = vjp_linearize(Node(fused, stage.deps), deps, stage.dep_active())
    return values, FusedPullback(stage, pullback, _avals(values))


def _linearize_chain_of_items(stage: Stage, chunks: Sequence[Chunked], deps, dropped):
    """A sweep's chain of item-by-item nodes, each item under one ``jax.vjp`` of the chain (see
    :func:`_linearize_chain`): :meth:`~daskdag.sweeps.chunked.Chunked.linearize_values` of the chain
    as one function over the chunk's items."""
    fused = Fused(stage, [c.node.callable() for c in chunks], dropped)
    chunk = Chunked(Node(fused, stage.deps), _in_axes(stage, chunks))
    values, pullback = chunk.linearize_values(deps, stage.dep_active(), len(stage.exposed))
    return values, FusedPullback(stage, pullback, _avals(values))


def _items_chain(nodes) -> bool:
    """A sweep's chain of item-by-item nodes of JAX code, linearized item by item as one."""
    chunks = [chunk_of(n) for n in nodes]
    return all(c is not None and not c.node.vmap and not has_linearizer(c.node) for c in chunks)


def steps_per_item(stage: Stage, nodes: Sequence[Node]) -> int:
    """How often a sweep chunk's forward pass of ``stage`` steps from one item to the next
    (:func:`daskdag.sweeps.progress.checkpoint`): once per item-by-item node, or once for a chain of
    them linearized as one (:func:`linearize`); as often again backward."""
    by_item = [n for n in nodes if (c := chunk_of(n)) is not None and not c.node.vmap]
    if len(nodes) > 1 and stage.linearized and by_item and _items_chain(nodes):
        return 1
    return len(by_item)


def _in_axes(stage: Stage, chunks) -> tuple:
    """Per dep of the stage, its item axis as its nodes take it (``Chunked.in_axes``)."""
    in_axes = [None] * len(stage.deps)
    for c, sources in zip(chunks, stage.sources):
        for (kind, i), axis in zip(sources, c.in_axes if c else ()):
            if kind == "dep":
                in_axes[i] = axis
    return tuple(in_axes)


def _avals(values) -> list:
    """Per exposed value, the shape and dtype of each of its differentiable leaves."""
    return [[(a.shape, a.dtype) for a in ct_avals(differentiable_leaves(v))] for v in values]


def _linearize_fused(stage: Stage, nodes, deps):
    chunk = _fused_function(stage, nodes)
    with node_errors(stage.name, "forward"):
        if not stage.linearized:
            return chunk(*deps)
        values, pullback = chunk.linearize(deps, stage.dep_active())
    return values, FusedPullback(stage, pullback, _avals(values))


def gradients(stage: Stage, nodes: Sequence[Node], deps: Sequence[Any], seeded: tuple):
    """A fused stage's forward and backward passes as one program, for a stage whose cotangents
    are all seeds of its own outputs (nothing flows into it from later stages). ``seeded[k]``:
    per exposed node, whether the ``k``-th backward pass starts there. Returns ``(values, cts)``,
    ``cts[k]`` aligned with ``stage.deps`` as :class:`StagePullback` returns them; None where
    the stage cannot run so (see :meth:`~daskdag.sweeps.chunked.Chunked.gradients`)."""
    chunk = _fused_function(stage, nodes)
    with node_errors(stage.name, "forward"):
        return chunk.gradients(deps, stage.dep_active(), seeded)


class FusedPullback:
    """The backward half of a fused stage (one program), or of a chain linearized as one
    (:func:`_linearize_chain`): one pullback. Called as :class:`StagePullback`; exposed nodes
    no cotangent flows to get zeros (``avals``: their differentiable leaves)."""

    __slots__ = ("stage", "pullback", "avals")

    def __init__(self, stage: Stage, pullback, avals):
        self.stage, self.pullback, self.avals = stage, pullback, avals

    def __call__(self, cts: tuple, deps: Sequence[Any], dropped=None) -> tuple:
        flat = [leaf for ct, avals in zip(cts, self.avals)
                for leaf in (ct if ct is not None else [jnp.zeros(*a) for a in avals])]
        with node_errors(self.stage.name, "backward"):
            return self.pullback(tuple(flat), deps)

    @property
    def batching(self):
        return self.pullback.batching

    def residual_nbytes(self) -> int:
        return self.pullback.residual_nbytes()

    def __reduce__(self):
        return FusedPullback, (self.stage, self.pullback, self.avals)


def abbreviate(names: Sequence[str]) -> str:
    """Names in a task key: ``B+C+D``, or ``n0+998more+n999`` for many."""
    return "+".join(names) if len(names) <= 4 else f"{names[0]}+{len(names) - 2}more+{names[-1]}"


def add(a: tuple, b: tuple) -> tuple:
    """Two cotangents (flat tuples) summed leaf by leaf."""
    return tuple(x + y for x, y in zip(a, b))
