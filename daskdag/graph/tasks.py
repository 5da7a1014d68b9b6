"""The functions Dask runs: per stage (:mod:`daskdag.graph.stages`) one forward task and one
backward task (for every output whose gradient passes through it), and one gradient task per
(output, input). A failure is a :class:`~daskdag.errors.NodeError` naming the node.

How cotangents are pulled back is a task's ``pull``: :data:`PER_OUTPUT` for gradients (one
cotangent per output), or, for a Jacobian (:func:`daskdag.jacobian`), a :class:`Rows`: every
cotangent is a stack of rows (an output starts from the rows of the identity over its
elements, :class:`Basis`), and each pullback maps a stack to a stack, some rows at a time under
``jax.vmap``.
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
    """Run the stage (:func:`daskdag.graph.run.linearize`). ``args``: the stage's ``Node`` s, then
    the values of its ``deps``. Returns ``(exposed values, pullback)`` when some node ran under
    ``jax.vjp``, else the exposed values, or the value itself when it is one. Between two nodes
    it stops (:class:`~daskdag.cancel.Cancelled`) once no one waits for it
    (:func:`~daskdag.cancel.dropped`; ``stop``: the local call's signal, or None), so Ctrl-C
    stops a call at its next node."""
    nodes, deps = args[:len(stage.nodes)], args[len(stage.nodes):]
    out = run.linearize(stage, nodes, deps, dropped_of(stage, stop))
    return out[0] if stage.value_only else out


def forward_dense(stage: Stage, stop, *args):
    """:func:`forward`, its pullback made the stage's dense Jacobian where that is small
    (:func:`daskdag.graph.dense.densify`): ``(exposed values, pullback)``."""
    nodes, deps = args[:len(stage.nodes)], args[len(stage.nodes):]
    dropped = dropped_of(stage, stop)
    values, pullback = run.linearize(stage, nodes, deps, dropped)
    return values, dense.densify(pullback, values, deps, _pull_rows, dropped)


def forward_backward(stage: Stage, stop, flows: tuple, pull, *args):
    """Forward and backward of a stage whose cotangents are all seeds of its own outputs
    (``flows`` and ``pull`` as for :func:`backward`, without sources): ``(exposed values, per
    output the deps' cotangents)``. A fused stage runs as one program, as
    ``jax.jit(jax.value_and_grad)`` does, its residuals never leaving XLA; others, seeds given
    by the user and Jacobians' rows, run as :func:`forward` then :func:`backward`."""
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
    """Pull the cotangents of the stage's exposed nodes back to the stage's deps, for each
    output whose gradient passes through the stage. Returns, per output, a tuple aligned with
    the stage's deps: each dep's cotangent, ``None`` where none flows.

    ``forward_out`` is the forward task's ``(values, pullback)``. ``args`` are the values of the
    stage's deps (a pullback that moved takes its input residuals from them), then the sources of
    the cotangents: the results of consumer stages' backward tasks. ``flows[k][e]`` says where
    output ``k``'s cotangent at exposed node ``e`` comes from: ``None``, nowhere; else a
    :class:`Seed`, :class:`Basis` or :class:`Shares`. ``stop``: as for :func:`forward`;
    ``pull``: how the cotangents are pulled back, :data:`PER_OUTPUT` or a Jacobian's
    :class:`Rows`.
    """
    values, pullback = forward_out
    # (On the stage's device: the shares of its consumers, from theirs, are summed there.)
    with run.placed(stage, args) as args:
        deps, sources = args[:len(stage.deps)], args[len(stage.deps):]
        pullback = pullback.materialize(deps)  # (a remat node's residuals: here, for this task)
        cts = [tuple(None if flow is None else flow.cotangent(value, sources)
                     for value, flow in zip(values, per_output)) for per_output in flows]
        return pull.pull(pullback, cts, values, deps, dropped_of(stage, stop))


# -- where a cotangent comes from -----------------------------------------------------------------

@dataclass(frozen=True)
class Seed:
    """The node is ``output``: its cotangent starts there (:func:`~daskdag.rules.seeds.seed`:
    1 for a real scalar, else the user's ``ct``); ``items``: over a sweep's chunk, as its
    :class:`~daskdag.rules.seeds.PerItem` seeds each item."""

    output: str
    ct: Any = None
    items: PerItem | None = None

    def cotangent(self, value, sources) -> tuple:
        if self.items is not None:
            return self.items.seed(value, self.output, self.ct)
        return seed(value, self.output, self.ct)


@dataclass(frozen=True)
class Basis:
    """The node is ``output`` of a Jacobian: its cotangents are the rows of the identity over
    its elements (:func:`~daskdag.rules.seeds.basis`), or with ``colours`` (a colour per
    element, a sparse Jacobian's) one row per colour; ``items``: each item's, over a sweep's
    chunk (:class:`~daskdag.rules.seeds.PerItem`)."""

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
    """The sum of the shares that consumer stages pulled back: ``sources[source][output
    index][position]`` for each ``(source, output index, position)`` in ``locations``."""

    locations: tuple[tuple[int, int, int], ...]

    def cotangent(self, value, sources) -> tuple:
        return total(sources[s][k][i] for s, k, i in self.locations)


# -- how cotangents are pulled back ----------------------------------------------------------------

@dataclass(frozen=True)
class PerOutput:
    """One cotangent per output (gradients). Several outputs' are pulled back at once, stacked,
    under ``jax.vmap`` (one pass through the stage's pullbacks instead of one per output) where
    that pays (by the pullback's ``batching``); else, and where the pullback cannot be vmapped
    (a host callback), one by one."""

    stacked: ClassVar[bool] = False

    def pull(self, pullback, cts: list, values, deps, dropped) -> list:
        """Per output, its cotangents (``cts[k]``, per exposed node) pulled back to the deps."""
        if pullback.batching is not None and pullback.batching.worth(cts):
            return _batched(pullback, cts, values, deps, dropped)
        return [pullback(c, deps, dropped) for c in cts]


PER_OUTPUT = PerOutput()


def _batched(pullback, cts: list, values, deps, dropped) -> list:
    """``[pullback(c, deps) for c in cts]`` as one call under ``jax.vmap``: each output's
    cotangents a stack of one row (:func:`_pull_rows`)."""
    rows = [tuple(None if c is None else tuple(leaf[None] for leaf in c) for c in per_output)
            for per_output in cts]
    return [tuple(None if d is None else tuple(leaf[0] for leaf in d) for d in out)
            for out in _pull_rows(pullback, rows, values, deps, dropped)]


@dataclass(frozen=True)
class Rows:
    """Cotangents are stacks of rows (a Jacobian's), and so is each result: pulled back at most
    ``chunk`` rows per ``jax.vmap`` call (``None``: all at once), to bound the memory a pass
    takes. ``colours``: ``((output, its elements' colours), ...)`` for the outputs whose rows
    are compressed (a sparse Jacobian's, :class:`Basis`)."""

    chunk: int | None = None
    colours: tuple[tuple[str, tuple[int, ...]], ...] = ()
    stacked: ClassVar[bool] = True

    def colours_of(self, output: str) -> tuple[int, ...] | None:
        return dict(self.colours).get(output)

    def pull(self, pullback, cts: list, values, deps, dropped) -> list:
        """As :meth:`PerOutput.pull`, each cotangent a stack of rows."""
        return _pull_rows(pullback, cts, values, deps, dropped, self.chunk)


def _pull_rows(pullback, cts: list, values, deps, dropped, chunk: int | None = None) -> list:
    """Per output, ``pullback`` of each row of its stacked cotangents (``cts``: per output, per
    exposed node, a tuple of stacked leaves or ``None``): every output's rows in one stack
    (zeros where an exposed node gets none from an output), ``chunk`` rows at a time (default
    all) under ``jax.vmap``, or row by row where the pullback cannot be vmapped (a host
    callback)."""
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
    """What a stage's task asks between two nodes: whether no one waits for it any more
    (:func:`~daskdag.cancel.dropped`); None for a stage of one node, or one program."""
    return dropped(stop) if len(stage.nodes) > 1 and not stage.fused else None


def gradient(locations: tuple, x, output, basis, own, items, *sources):
    """The gradient of an input, or of a node, whose value is ``x``, shaped like it: the sum of
    its shares ``sources[j][k][i]`` for ``(k, i)`` in ``locations`` (see :func:`backward`) and of
    ``own``, the output's seed flow when ``x`` is the output itself (else None), on its
    differentiable leaves (zeros when the output does not use it), ``None`` on the leaves held
    constant. For a Jacobian, ``output`` is the output's value and each leaf is stacked over its
    rows (``basis``, its :class:`Basis`); else both are None. Each leaf is a JAX array of its
    input leaf's JAX dtype, whoever computed it (a node's own NumPy rule too: a Python float's
    gradient is float32, as ``jax.grad`` gives it). ``items``: over a sweep's chunk, the
    :class:`~daskdag.rules.seeds.PerItem` that gathers the gradient; None: a call's."""
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
    """``grad`` as a JAX array of ``leaf``'s JAX dtype (itself when it is one already); a
    Jacobian's ``rows`` of NumPy stay NumPy (its layout is made from NumPy, in one go)."""
    dtype = jnp.result_type(leaf)
    if isinstance(grad, jax.Array) and grad.dtype == dtype:
        return grad
    if rows and isinstance(grad, np.ndarray):
        return grad.astype(dtype, copy=False)
    return jnp.asarray(grad, dtype)
