"""The functions Dask runs: per stage a forward and a backward task, and one gradient task per
(output, input). How cotangents are pulled back is a task's ``pull``: :data:`PER_OUTPUT` for
gradients, or a Jacobian's :class:`Rows`, each cotangent a stack of rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.cancel import Cancelled, dropped
from daskdag.graph import dense, run
from daskdag.graph.stages import Stage
from daskdag.model.leaves import differentiable_leaves, is_differentiable
from daskdag.rules.seeds import PerItem, basis, basis_rows, check_scalar, seed, total


def forward(stage: Stage, stop, *args):
    """Run the stage on ``args`` (its ``Node`` s, then its deps' values); between two nodes it
    stops once no one waits for it (``stop``: a local call's signal, or None)."""
    nodes, deps = args[:len(stage.nodes)], args[len(stage.nodes):]
    out = run.linearize(stage, nodes, deps, dropped_of(stage, stop))
    return out[0] if stage.value_only else out


def forward_dense(stage: Stage, stop, *args):
    """:func:`forward`, its pullback made the stage's dense Jacobian where that is small."""
    nodes, deps = args[:len(stage.nodes)], args[len(stage.nodes):]
    dropped = dropped_of(stage, stop)
    values, pullback = run.linearize(stage, nodes, deps, dropped)
    return values, dense.densify(pullback, values, deps, _pull_rows, dropped)


def forward_backward(stage: Stage, stop, flows: tuple, pull, *args):
    """A closed stage's ``(exposed values, per output the deps' cotangents)``; a fused stage
    seeded by ones as one program, others as :func:`forward` then :func:`backward`."""
    nodes, deps = args[:len(stage.nodes)], args[len(stage.nodes):]
    if stage.fused and not pull.stacked and all(f is None or (isinstance(f, Seed) and f.ct is None)
                                            for per_output in flows for f in per_output):
        seeded = tuple(tuple(f is not None for f in per_output) for per_output in flows)
        out = run.gradients(stage, nodes, deps, seeded)
        if out is not None:
            values, cts = out
            for per_output in flows:  # the check seed() makes: each seeded output a real scalar
                for value, flow in zip(values, per_output):
                    if flow is not None:
                        check_scalar(value, flow.output, flow.items is not None)
            return values, cts
    out = run.linearize(stage, nodes, deps, dropped_of(stage, stop))
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
    with run.placed(stage, args) as args:
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
    """One cotangent per output, pulled back together under ``jax.vmap`` where that pays."""

    stacked: ClassVar[bool] = False

    def pull(self, pullback, cts: list, values, deps, dropped) -> list:
        """Per output, its cotangents (``cts[k]``, per exposed node) pulled back to the deps."""
        if pullback.batching is not None and pullback.batching.worth(cts):
            return _batched(pullback, cts, values, deps, dropped)
        return [pullback(c, deps, dropped) for c in cts]


PER_OUTPUT = PerOutput()


def _batched(pullback, cts: list, values, deps, dropped) -> list:
    """``[pullback(c, deps) for c in cts]`` as one call under ``jax.vmap``."""
    rows = [tuple(None if c is None else tuple(leaf[None] for leaf in c) for c in per_output)
            for per_output in cts]
    return [tuple(None if d is None else tuple(leaf[0] for leaf in d) for d in out)
            for out in _pull_rows(pullback, rows, values, deps, dropped)]


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
    stack, ``chunk`` at a time under ``jax.vmap``, or row by row where that fails."""
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
    traceable = pullback.traceable and (pullback.batching is None
                                        or total_rows >= pullback.batching.least)
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
    flat = iter(total(shares) if shares else
                [jnp.zeros((*lead, *jnp.shape(leaf)), jnp.result_type(leaf))
                 for leaf in leaves if is_differentiable(leaf)])
    grad = treedef.unflatten([_typed(next(flat), leaf, rows=output is not None)
                              if is_differentiable(leaf) else None for leaf in leaves])
    return grad if items is None else items.gradient(x, grad, rows=output is not None)


def _typed(grad, leaf, rows: bool = False):
    """``grad`` as a JAX array of ``leaf``'s dtype (a Jacobian's NumPy ``rows`` stay NumPy)."""
    dtype = jnp.result_type(leaf)
    if isinstance(grad, jax.Array) and grad.dtype == dtype:
        return grad
    if rows and isinstance(grad, np.ndarray):
        return grad.astype(dtype, copy=False)
    return jnp.asarray(grad, dtype)
