"""The functions Dask runs: per stage a forward and a backward task, and one gradient task per
(output, input). How cotangents are pulled back is a task's ``pull``: a :class:`PerOutput` for
gradients, or a Jacobian's :class:`Rows`, each cotangent a stack of rows.

A stage runs in its forward task by :func:`linearize`: a fused stage as one compiled function, a
chain of JAX nodes under one ``jax.vjp`` (each node still called once, in order), any other node
by node under its rule; on the stage's device, if it has one (:func:`placed`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, ContextManager, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from dask.sizeof import sizeof

from daskdag.caches import Cache
from daskdag.cancel import Cancelled, check, dropped
from daskdag.errors import node_errors
from daskdag.graph import dense
from daskdag.graph.compiled import Jitted
from daskdag.graph.stages import Stage
from daskdag.model import devices
from daskdag.model.leaves import (differentiable_leaves, dtype_of, is_differentiable, many_zeros,
                                  zeros_of)
from daskdag.model.spec import Node
from daskdag.rules.vjp import (PerItem, Pullback, add, basis, basis_rows, check_scalar, ct_avals,
                               element_of, forward_rule, has_rules, rules_of, seed, total)
from daskdag.rules.vjp import linearize as vjp_linearize
from daskdag.transport.packing import Function, current
from daskdag.transport.weak import ref


def forward(stage: Stage, stop, *args):
    """Run the stage on ``args`` (its ``Node`` s, then its deps' values); between two nodes it
    stops once no one waits for it (``stop``: a local call's signal, or None)."""
    nodes, deps = args[:len(stage.nodes)], args[len(stage.nodes):]
    out = linearize(stage, nodes, deps, dropped_of(stage, stop))
    return out[0] if stage.value_only else out


def forward_dense(stage: Stage, stop, *args):
    """:func:`forward`, its pullback made the stage's dense Jacobian where that is small."""
    nodes, deps = args[:len(stage.nodes)], args[len(stage.nodes):]
    dropped = dropped_of(stage, stop)
    values, pullback = linearize(stage, nodes, deps, dropped)
    return values, dense.densify(pullback, values, deps, _pull_rows, dropped)


def forward_backward(stage: Stage, stop, flows: tuple, pull, *args):
    """A closed stage's ``(exposed values, per output the deps' cotangents)``; a fused stage
    seeded by ones as one program, others as :func:`forward` then :func:`backward`."""
    nodes, deps = args[:len(stage.nodes)], args[len(stage.nodes):]
    if stage.fused and not pull.stacked and all(f is None or (isinstance(f, Seed) and f.ct is None)
                                            for per_output in flows for f in per_output):
        seeded = tuple(tuple(f is not None for f in per_output) for per_output in flows)
        out = gradients(stage, nodes, deps, seeded)
        if out is not None:
            values, cts = out
            for per_output in flows:  # the check seed() makes: each seeded output a real scalar
                for value, flow in zip(values, per_output):
                    if flow is not None:
                        check_scalar(value, flow.output, flow.items is not None)
            return values, cts
    out = linearize(stage, nodes, deps, dropped_of(stage, stop))
    return out[0], backward(stage, stop, flows, pull, out, *deps)


def cotangents_of(out) -> list:
    """The cotangents from :func:`forward_backward`'s result."""
    return out[1]


def pick(out, has_pullback: bool, k: int):
    """The ``k``-th exposed value from a forward task's result."""
    return (out[0] if has_pullback else out)[k]


def backward(stage: Stage, stop, flows: tuple, pull, forward_out, *args) -> list:
    """Per output through the stage, its cotangents pulled back to the deps (``None`` where
    none flows). ``args``: the deps' values, then the consumer stages' backward results;
    ``flows[k][e]``: where output ``k``'s cotangent at exposed node ``e`` comes from (a
    :class:`Seed`, :class:`Basis`, :class:`Shares`, or ``None``)."""
    values, pullback = forward_out
    with placed(stage, args) as args:
        deps, sources = args[:len(stage.deps)], args[len(stage.deps):]
        pullback = pullback.materialize(deps)  # (a remat node's residuals: here, for this task)
        cts = [tuple(None if flow is None else flow.cotangent(value, sources)
                     for value, flow in zip(values, per_output)) for per_output in flows]
        return pull.pull(pullback, cts, values, deps, dropped_of(stage, stop))


# -- where a cotangent comes from -----------------------------------------------------------------

@dataclass(frozen=True)
class Seed:
    """The cotangent of node ``output`` starts there (1 for a real scalar, else ``ct``)."""

    output: str
    ct: Any = None
    items: PerItem | None = None

    def cotangent(self, value, sources) -> tuple:
        if self.items is not None:
            return self.items.seed(value, self.output, self.ct)
        return seed(value, self.output, self.ct)


@dataclass(frozen=True)
class Basis:
    """A Jacobian's ``output``'s cotangents: the identity's rows (one per colour, if any)."""

    output: str
    colours: tuple[int, ...] | None = None
    items: PerItem | None = None

    def cotangent(self, value, sources) -> tuple:
        if self.items is not None:
            return self.items.basis(value, self.output, self.colours)
        return basis(self.output, value, self.colours)

    def rows(self, value) -> int:
        if self.items is not None:
            return self.items.rows(value, self.colours)
        return basis_rows(value, self.colours)


@dataclass(frozen=True)
class Shares:
    """The sum of ``sources[source][output index][position]`` over ``locations``."""

    locations: tuple[tuple[int, int, int], ...]

    def cotangent(self, value, sources) -> tuple:
        return total(sources[s][k][i] for s, k, i in self.locations)


# -- how cotangents are pulled back ----------------------------------------------------------------

@dataclass(frozen=True)
class PerOutput:
    """One cotangent per output, pulled back together (``batch``: the setting
    ``daskdag.batch-cotangents``, ``"auto"``, ``"always"`` or ``"never"``): through a compiled
    stage by its program that pulls each back apart (:func:`_each`), through any other under
    ``jax.vmap`` where that pays (:func:`_batched`); in calls of as many outputs as
    :func:`rows_per_call` allows."""

    batch: str = "auto"
    stacked: ClassVar[bool] = False

    def pull(self, pullback, cts: list, values, deps, dropped) -> list:
        """Per output, its cotangents (``cts[k]``, per exposed node) pulled back to the deps."""
        if self.batch != "never" and len(cts) > 1:
            if pullback.apart:
                return _each(pullback, cts, deps, dropped)
            batching = pullback.batching
            if batching is not None and batching.worth(
                    cts, any_size=self.batch == "always" or _on_accelerator(cts)):
                return _batched(pullback, cts, values, deps, dropped)
        return [pullback(c, deps, dropped) for c in cts]


def _device_of(cts: list) -> jax.Device | None:
    """A device the cotangents are on: the first JAX array's; None where none is one."""
    leaves = (leaf for per_output in cts for c in per_output if c is not None for leaf in c)
    first = next((leaf for leaf in leaves if isinstance(leaf, jax.Array)), None)
    return None if first is None else next(iter(first.devices()))


def _on_accelerator(cts: list) -> bool:
    """The cotangents are JAX arrays on a device other than a CPU."""
    device = _device_of(cts)
    return device is not None and device.platform != "cpu"


#: The share of a device's free memory that one batched call's stacked cotangents may take: the
#: pullback's intermediates are each as large again, several alive at once.
BATCH_MEMORY = 1 / 16


def rows_per_call(cts: list) -> int | None:
    """How many outputs' cotangents one batched pullback call takes: as many as fit in
    :data:`BATCH_MEMORY` of the free memory of their device (JAX's ``memory_stats``, which an
    accelerator reports); None, all of them (a device that reports none: the host's CPU)."""
    device = _device_of(cts)
    free = None if device is None else devices.free_memory(device)
    if free is None:
        return None
    row = max(sum(a.nbytes for c in per_output if c is not None for a in c)
              for per_output in cts)
    return max(1, int(free * BATCH_MEMORY) // max(row, 1))


#: The most outputs one program of :meth:`~daskdag.rules.vjp.Pullback.each` takes: it holds one
#: copy of the backward pass per output, compiled once per count.
EACH_AT_ONCE = 8


def _each(pullback, cts: list, deps, dropped) -> list:
    """``[pullback(c, deps) for c in cts]`` by the pullback's
    :meth:`~daskdag.rules.vjp.Pullback.each`, in calls of equal counts (differing by one at
    most) of at most :data:`EACH_AT_ONCE` outputs and :func:`rows_per_call`."""
    most = min(EACH_AT_ONCE, rows_per_call(cts) or EACH_AT_ONCE)
    calls = -(-len(cts) // most)
    size, extra = divmod(len(cts), calls)
    out: list = []
    for k in range(calls):
        out.extend(pullback.each(cts[len(out):len(out) + size + (k < extra)], deps, dropped))
    return out


def _batched(pullback, cts: list, values, deps, dropped) -> list:
    """``[pullback(c, deps) for c in cts]`` as calls under ``jax.vmap``, of as many outputs as
    :func:`rows_per_call` allows: each call's cotangents stacked by one program, its results
    split by one (not an op per output and leaf), a loop where the pullback cannot be vmapped."""
    avals = tuple(tuple(leaves) for leaves in _avals(values))
    if not pullback.traceable or not any(avals):
        return [pullback(c, deps, dropped) for c in cts]
    step = rows_per_call(cts) or len(cts)
    out: list = []
    for start in range(0, len(cts), step):
        part = tuple(cts[start:start + step])
        if len(part) > 1:
            try:
                out.extend(_split(pullback.rows(_stack(part, avals), deps, dropped), len(part)))
                continue
            except Cancelled:
                raise
            except Exception:  # not vmappable: one by one (a node's own error raises again)
                pass
        out.extend(pullback(c, deps, dropped) for c in part)
    return out


@partial(jax.jit, static_argnums=1)
def _stack(cts: tuple, avals: tuple) -> tuple:
    """Per exposed value, its cotangents over the outputs stacked leaf by leaf (zeros of
    ``avals`` for an output where none flows; None where none flows for any)."""
    stacked: list = []
    for e, leaves in enumerate(avals):
        column = [c[e] for c in cts]
        if all(c is None for c in column):
            stacked.append(None)
            continue
        stacked.append(tuple(
            jnp.stack([jnp.zeros(shape, dtype) if c is None else c[i] for c in column])
            for i, (shape, dtype) in enumerate(leaves)))
    return tuple(stacked)


@partial(jax.jit, static_argnums=1)
def _split(stacked, count: int) -> list:
    """A pytree of stacks over ``count`` outputs as ``count`` pytrees."""
    return [jax.tree.map(lambda a: a[k], stacked) for k in range(count)]


@dataclass(frozen=True)
class Rows:
    """Cotangents are stacks of rows (a Jacobian's), at most ``chunk`` per ``jax.vmap`` call;
    ``colours``: ``((output, its elements' colours), ...)`` where rows are compressed."""

    chunk: int | None = None
    colours: tuple[tuple[str, tuple[int, ...]], ...] = ()
    stacked: ClassVar[bool] = True

    def colours_of(self, output: str) -> tuple[int, ...] | None:
        return dict(self.colours).get(output)

    def pull(self, pullback, cts: list, values, deps, dropped) -> list:
        """As :meth:`PerOutput.pull`, each cotangent a stack of rows."""
        return _pull_rows(pullback, cts, values, deps, dropped, self.chunk)


def _pull_rows(pullback, cts: list, values, deps, dropped, chunk: int | None = None) -> list:
    """Per output, ``pullback`` of each row of its stacked cotangents: all outputs' rows in one
    stack, ``chunk`` at a time under ``jax.vmap`` (from its batching's ``least`` rows in all),
    or row by row where that fails."""
    counts = [next((len(leaf) for c in per_output if c is not None for leaf in c[:1]), 0)
              for per_output in cts]
    stacked: list = []
    for e, value in enumerate(values):
        column = [c[e] for c in cts]
        if all(c is None for c in column):
            stacked.append(None)
            continue
        # (In NumPy where the rows are: in JAX each op would be dispatched.)
        zeros = [tuple(np.zeros((n, *np.shape(leaf)), jnp.result_type(leaf))
                       for leaf in differentiable_leaves(value)) for n in counts]
        parts = (z if c is None else c for c, z in zip(column, zeros))
        stacked.append(tuple(_concatenate(leaves) for leaves in zip(*parts)))
    total_rows = sum(counts)
    if not total_rows:  # no differentiable leaf flows: nothing to stack
        return [pullback(c, deps, dropped) for c in cts]
    step = chunk or total_rows
    # (User code on NumPy values cannot be vmapped; and below its `least`, vmap of a pullback
    # costs more than a loop: an eager pullback's is traced anew on every call.)
    least = 0 if pullback.batching is None else pullback.batching.least
    traceable = pullback.traceable and total_rows >= least
    pieces = []
    for start in range(0, total_rows, step):
        part = tuple(stacked) if step >= total_rows else jax.tree.map(
            lambda a: a[start:start + step], tuple(stacked))
        if traceable:
            try:
                pieces.append(pullback.rows(part, deps, dropped))
                continue
            except Cancelled:
                raise
            except Exception:  # not vmappable: row by row (a node's own error raises again)
                pass
        one = [pullback(jax.tree.map(lambda a: a[k], part), deps, dropped)
               for k in range(min(step, total_rows - start))]
        pieces.append(jax.tree.map(lambda *r: jnp.stack(r), *one))
    out = pieces[0] if len(pieces) == 1 else jax.tree.map(lambda *p: jnp.concatenate(p), *pieces)
    if len(counts) == 1:
        return [out]
    bounds = np.cumsum([0, *counts])
    return [jax.tree.map(lambda a: a[lo:hi], out) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _concatenate(leaves: tuple):
    """Stacks of rows one after another: NumPy's where they all are, else JAX's."""
    if len(leaves) == 1:
        return leaves[0]
    if all(isinstance(leaf, np.ndarray) for leaf in leaves):
        return np.concatenate(leaves)
    return jnp.concatenate(leaves)


def dropped_of(stage: Stage, stop):
    """Whether no one waits for a stage's task (None for one node or one program)."""
    return dropped(stop) if len(stage.nodes) > 1 and not stage.fused else None


def gradient(locations: tuple, x, output, basis, own, items, *sources):
    """The gradient of a name whose value is ``x``, shaped like it: the sum of its shares
    ``sources[j][k][i]`` for ``(k, i)`` in ``locations`` and ``own`` (the seed, for the output),
    ``None`` on leaves held constant, each a JAX array of its leaf's dtype. For a Jacobian,
    ``output`` is the output's value and each leaf is stacked over ``basis``'s rows."""
    leaves, treedef = jax.tree.flatten(x)
    lead = () if output is None else (basis.rows(output),)
    shares = [s[k][i] for s, (k, i) in zip(sources, locations)]
    shares += [own.cotangent(x, ())] if own else []
    if shares:
        flat = iter(total(shares))
        grad = treedef.unflatten([_typed(next(flat), leaf, rows=output is not None)
                                  if is_differentiable(leaf) else None for leaf in leaves])
    else:
        (grad,) = zero_gradients(x, lead=lead)
    return grad if items is None else items.gradient(x, grad, rows=output is not None)


def zero_gradients(*xs, lead: tuple = ()) -> tuple:
    """Per value in ``xs``, the gradient of an output that does not depend on it: zeros shaped
    like it (``lead`` axes first; ``None`` on leaves held constant), each its own buffer, made
    by one program."""
    flat = [jax.tree.flatten(x) for x in xs]
    made = iter(many_zeros([((*lead, *jnp.shape(leaf)), dtype_of(leaf))
                            for leaves, _ in flat for leaf in leaves if is_differentiable(leaf)]))
    return tuple(treedef.unflatten([next(made) if is_differentiable(leaf) else None
                                    for leaf in leaves]) for leaves, treedef in flat)


def _typed(grad, leaf, rows: bool = False):
    """``grad`` as a JAX array of ``leaf``'s dtype (a Jacobian's NumPy ``rows`` stay NumPy)."""
    dtype = dtype_of(leaf)
    if isinstance(grad, jax.Array) and grad.dtype == dtype:
        return grad
    if rows and isinstance(grad, np.ndarray):
        return grad.astype(dtype, copy=False)
    return jnp.asarray(grad, dtype)


# -- a stage run in its forward task -------------------------------------------------------------

def linearize(stage: Stage, nodes: Sequence[Node], deps: Sequence[Any], dropped=None):
    """The stage's exposed values, with its pullback if it has one; ``dropped()`` stops it."""
    with placed(stage, deps) as deps:
        return _linearize(stage, nodes, deps, dropped)


def placed(stage: Stage, values) -> ContextManager[Any]:
    """A context manager: ``values`` put on the stage's device, where eager ops in its block
    run (if it has one)."""
    if stage.device is None:
        return contextlib.nullcontext(values)
    return _on_device(stage, values)


@contextlib.contextmanager
def _on_device(stage: Stage, values):
    with devices.on(stage.device, stage.name):
        yield devices.put(values, stage.device, stage.name)


def _linearize(stage: Stage, nodes: Sequence[Node], deps: Sequence[Any], dropped=None):
    if stage.fused:
        return _linearize_fused(stage, nodes, deps)
    if len(nodes) > 1 and stage.has_pullback:
        if not any(map(has_rules, nodes)):
            return _linearize_chain(stage, nodes, deps, dropped)
        batch = chain_of_elements(nodes)
        if batch is not None:
            return _linearize_chain_of_elements(stage, nodes, batch, deps, dropped)
    return _linearize_nodes(stage, nodes, deps, dropped)


def _linearize_nodes(stage: Stage, nodes, deps, dropped):
    """Node by node, each under its own rule: a :class:`StagePullback`."""
    values: list = []
    pullbacks: list = []
    for j, (name, node, active) in enumerate(zip(stage.nodes, nodes, stage.active)):
        if values:
            check(dropped, name)
        inputs = stage.inputs(j, deps, values)
        with node_errors(name, "forward"):
            if any(active):
                primal, pullback = forward_rule(node)(inputs, active)
            else:
                primal, pullback = node.callable()(*inputs), None
        _not_none(name, primal)
        values.append(primal)
        pullbacks.append(pullback)
    exposed = tuple(values[j] for j in stage.exposed)
    if not stage.has_pullback:
        return exposed
    # Keep the values that a node's pullback may take as inputs; drop the rest now.
    taken = {i for sources, pb in zip(stage.sources, pullbacks) if pb is not None
             for kind, i in sources if kind == "node"}
    kept = [v if j in taken else None for j, v in enumerate(values)]
    return exposed, StagePullback(stage, pullbacks, kept)


class StagePullback(Pullback):
    """A stage run node by node's pullback: its nodes' pullbacks, and the values later nodes
    took as inputs (a pullback that moved takes its residuals from them)."""

    __slots__ = ("stage", "pullbacks", "values")

    def __init__(self, stage: Stage, pullbacks: Sequence[Any], values: Sequence[Any]):
        self.stage, self.pullbacks, self.values = stage, tuple(pullbacks), tuple(values)

    def __call__(self, cts: tuple, deps: Sequence[Any], dropped=None) -> tuple:
        with placed(self.stage, (cts, deps)) as (cts, deps):
            return self._pull(cts, deps, dropped)

    def _pull(self, cts: tuple, deps: Sequence[Any], dropped=None) -> tuple:
        # autograd's backward pass: outgrads, per node, the sum of what its consumers gave.
        outgrads: list
        stage, outgrads = self.stage, [None] * len(self.stage.nodes)
        for j, ct in zip(stage.exposed, cts):
            outgrads[j] = ct
        out: list = [None] * len(stage.deps)
        ran = False
        for j in reversed(range(len(stage.nodes))):
            if self.pullbacks[j] is None or outgrads[j] is None:  # held constant, or none flows
                continue
            if ran:
                check(dropped, stage.nodes[j])
            inputs = stage.inputs(j, deps, self.values)
            with node_errors(stage.nodes[j], "backward"):
                shares = self.pullbacks[j](outgrads[j], inputs)
            ran = True
            for (kind, i), share in zip(stage.sources[j], shares):
                if share is not None:
                    into = out if kind == "dep" else outgrads
                    into[i] = share if into[i] is None else add(into[i], share)
        return tuple(out)

    def materialize(self, deps: Sequence[Any]) -> StagePullback:
        """With each node's pullback materialized (a ``remat`` node's forward pass redone)."""
        stage, pullbacks = self.stage, list(self.pullbacks)
        with placed(stage, deps) as deps:
            for j, pb in enumerate(pullbacks):
                if pb is not None:
                    with node_errors(stage.nodes[j], "backward"):
                        pullbacks[j] = pb.materialize(stage.inputs(j, deps, self.values))
        return self if all(a is b for a, b in zip(pullbacks, self.pullbacks)) else StagePullback(
            stage, pullbacks, self.values)

    @property
    def batching(self):  # type: ignore[override]  # (a plain attribute in Pullback)
        """Its nodes' common :attr:`~daskdag.rules.vjp.Pullback.batching`, else None."""
        kinds = {pb.batching for pb in self.pullbacks if pb is not None}
        return kinds.pop() if len(kinds) == 1 else None

    @property
    def traceable(self) -> bool:  # type: ignore[override]  # (a plain attribute in Pullback)
        """No node's pullback is the user's own code: JAX can trace it."""
        return all(pb.traceable for pb in self.pullbacks if pb is not None)

    def residual_nbytes(self) -> int:
        """The pullbacks' residuals and the kept values."""
        return (sum(pb.residual_nbytes() for pb in self.pullbacks if pb is not None)
                + sum(sizeof(v) for v in self.values if v is not None))

    def __reduce__(self):
        return StagePullback, (self.stage, self.pullbacks, self.values)


# -- several nodes as one function ----------------------------------------------------------------

class Fused:
    """A stage's nodes as one function of its deps, returning its exposed values. ``fns``: the
    nodes' plain functions, held ``weakly`` where they can be (a cached ``Fused`` keeps none)."""

    def __init__(self, stage: Stage, fns: Sequence, dropped=None, weakly: bool = False):
        self.stage, self.dropped = stage, dropped
        self._fns = tuple(ref(f) if weakly else partial(identity, f) for f in fns)

    @property
    def fns(self) -> tuple:
        return tuple(f() for f in self._fns)

    def __call__(self, *deps):
        values: list = []
        for j, (name, fn) in enumerate(zip(self.stage.nodes, self.fns)):
            if values:
                check(self.dropped, name)
            with node_errors(name, "forward"):
                values.append(fn(*self.stage.inputs(j, deps, values)))
            _not_none(name, values[-1])
        return tuple(values[j] for j in self.stage.exposed)

    def __reduce__(self):
        return Fused, (self.stage, self.fns)


class FusedPullback(Pullback):
    """A stage run as one function's pullback; ``avals``: for zero cotangents."""

    __slots__ = ("stage", "pullback", "avals")

    def __init__(self, stage: Stage, pullback, avals):
        self.stage, self.pullback, self.avals = stage, pullback, avals

    def __call__(self, cts: tuple, deps: Sequence[Any], dropped=None) -> tuple:
        return self._pull(cts, deps, (), self.pullback)

    def rows(self, cts: tuple, deps: Sequence[Any], dropped=None) -> tuple:
        """Each row of ``cts`` pulled back by the inner pullback's rows."""
        n = next(len(leaf) for ct in cts if ct is not None for leaf in ct)
        return self._pull(cts, deps, (n,), lambda c, d: self.pullback.rows(c, d, dropped))

    def each(self, cts: Sequence[Any], deps: Sequence[Any], dropped=None) -> list:
        """Each of ``cts`` pulled back by the inner pullback's :meth:`each`."""
        with placed(self.stage, (cts, deps)) as (cts, deps):
            flat = [self._flat(ct, ()) for ct in cts]
            with node_errors(self.stage.name, "backward"):
                return self.pullback.each(flat, deps, dropped)

    def _pull(self, cts: tuple, deps: Sequence[Any], lead: tuple, pull) -> tuple:
        """``pull`` of the cotangents' leaves, flat, with zeros (``lead`` rows) where none."""
        with placed(self.stage, (cts, deps)) as (cts, deps):
            flat = self._flat(cts, lead)
            with node_errors(self.stage.name, "backward"):
                return pull(flat, deps)

    def _flat(self, cts: tuple, lead: tuple) -> tuple:
        """The leaves of ``cts`` (one per exposed value), with zeros (``lead`` rows) where none
        flows."""
        return tuple(leaf for ct, avals in zip(cts, self.avals) for leaf in (
            ct if ct is not None else [zeros_of((*lead, *shape), dtype)
                                       for shape, dtype in avals]))

    @property
    def batching(self):  # type: ignore[override]  # (a plain attribute in Pullback)
        return self.pullback.batching

    @property
    def apart(self) -> bool:  # type: ignore[override]  # (a plain attribute in Pullback)
        return self.pullback.apart

    def residual_nbytes(self) -> int:
        return self.pullback.residual_nbytes()

    def __reduce__(self):
        return FusedPullback, (self.stage, self.pullback, self.avals)


def _avals(values) -> list:
    """Per exposed value, the shape and dtype of each of its differentiable leaves."""
    return [[(a.shape, a.dtype) for a in ct_avals(differentiable_leaves(v))] for v in values]


def _linearize_chain(stage: Stage, nodes, deps, dropped):
    """A chain of eager JAX nodes under one ``jax.vjp`` (one fixed cost, not one per node)."""
    fused = Fused(stage, [n.callable() for n in nodes], dropped)
    values, pullback = vjp_linearize(Node(fused, stage.deps), deps, stage.dep_active())
    return values, FusedPullback(stage, pullback, _avals(values))


def chain_of_elements(nodes):
    """The batch rule of a chain of nodes that map JAX elements over a batch, else None."""
    found = [(rules_of(n), *element_of(n)) for n in nodes]
    if all(axes is not None and not element.vmap and not has_rules(element)
           for _, element, axes in found):
        return found[0][0].batch  # type: ignore[union-attr]  # (an element's node has rules)
    return None


def _linearize_chain_of_elements(stage: Stage, nodes, batch, deps, dropped):
    """A chain of nodes over a batch, each element under one ``jax.vjp`` of the chain."""
    elements = [element_of(n) for n in nodes]
    fused = Fused(stage, [element.callable() for element, _ in elements], dropped)
    values, pullback = batch(fused, _in_axes(stage, elements), False).linearize_values(
        deps, stage.dep_active(), len(stage.exposed))
    return values, FusedPullback(stage, pullback, _avals(values))


def _in_axes(stage: Stage, elements) -> tuple:
    """Per dep of the stage, its batch axis as its nodes take it."""
    in_axes = [None] * len(stage.deps)
    for (_, axes), sources in zip(elements, stage.sources):
        for (kind, i), axis in zip(sources, axes or ()):
            if kind == "dep":
                in_axes[i] = axis
    return tuple(in_axes)


# (stage, ids of fns, batch axes) -> (its compiled function, Fused), while its functions live
_fused: Cache[tuple] = Cache("fused stages' functions", 1024)
# ids of nodes -> (weak refs to the nodes, stage, its compiled function)
_by_nodes: Cache = Cache("fused stages by their node objects", 256)


def fused_function(stage: Stage, nodes: Sequence[Node]):
    """The fused stage as one compiled function, the same while its node functions live."""
    key = tuple(map(id, nodes))
    hit = _by_nodes.get(key)
    if hit is not None and hit[1] is stage and all(r() is n for r, n in zip(hit[0], nodes)):
        return hit[2]
    function = _fused_function(stage, nodes)
    if all(isinstance(n.fn, Function) for n in nodes):  # (held weakly: no node kept alive)
        _by_nodes.put(key, (tuple(map(weakref.ref, nodes)), stage, function))
    return function


def _fused_function(stage: Stage, nodes: Sequence[Node]):
    elements = [element_of(n) for n in nodes]
    fns = [current(element.fn) for element, _ in elements]
    batch = next((rules_of(n).batch  # type: ignore[union-attr]
                  for n, (_, axes) in zip(nodes, elements) if axes is not None), None)
    in_axes = _in_axes(stage, elements)
    # (the same functions over a batch, or over one call's values: two programs)
    key = (stage, tuple(map(id, fns)), in_axes, batch is not None)
    hit = _fused.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[1].fns, fns)):
        return hit[0]
    fused = Fused(stage, fns, weakly=True)
    function = batch(fused, in_axes, True) if batch is not None else Jitted(fused, in_axes)
    _fused.put(key, (function, fused))
    for f in fns:  # the entry goes with the first of its functions to go
        with contextlib.suppress(TypeError):
            weakref.finalize(f, _fused.pop, key, None)
    return function


def _linearize_fused(stage: Stage, nodes, deps):
    function = fused_function(stage, nodes)
    with node_errors(stage.name, "forward"):
        if not stage.has_pullback:
            return function(*deps)
        values, pullback = function.linearize(deps, stage.dep_active())
    return values, FusedPullback(stage, pullback, _avals(values))


def gradients(stage: Stage, nodes: Sequence[Node], deps: Sequence[Any], seeded: tuple):
    """A closed fused stage's ``(values, cts)`` as one program (None where it cannot run so);
    ``seeded[k]``: per exposed node, whether the ``k``-th backward pass starts there."""
    function = fused_function(stage, nodes)
    with placed(stage, deps) as deps, node_errors(stage.name, "forward"):
        return function.gradients(deps, stage.dep_active(), seeded)


def _not_none(name: str, value) -> None:
    if value is None:  # None is an empty pytree to JAX: it would fail later, far from here
        with node_errors(name, "forward"):
            raise TypeError("its function returned None; a node must return its value, a JAX "
                            "array or a pytree of arrays (is a `return` missing?)")


def identity(x):
    """``x`` (a task keeping a node; with ``partial``, a picklable function returning it)."""
    return x
