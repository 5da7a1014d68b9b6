"""The functions Dask runs: one forward task per stage, one backward task per stage (for every
output whose gradient passes through it), one gradient task per (output, input). See
:mod:`daskdag.graph.stages` for what a stage is.

For a Jacobian (:func:`daskdag.jacobian`) every cotangent is a stack of rows: an output starts
from the rows of the identity over its elements (:func:`basis`), and each pullback maps a
stack to a stack, ``rows`` (a :class:`Rows`) at a time under ``jax.vmap``.

A failure is a :class:`~daskdag.errors.NodeError` naming the node.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import treedef_is_leaf

from daskdag.cancel import Cancelled, dropped
from daskdag.transport import protocol  # noqa: F401  (see pulled)
from daskdag.graph import stages
from daskdag.rules.pullback import differentiable_leaves, is_differentiable, is_numeric
from daskdag.sweeps.chunked import Items, stacked
from daskdag.graph.stages import Stage, add


def forward(stage: Stage, stop, *args):
    """Run the stage (:func:`daskdag.graph.stages.linearize`). ``args``: the stage's ``Node`` s, then
    the values of its ``deps``. Returns ``(exposed values, pullback)`` when some node ran under
    ``jax.vjp``, else the exposed values, or the value itself when it is one.

    Between two nodes it stops (:class:`~daskdag.cancel.Cancelled`) once no one waits for it
    (:func:`~daskdag.cancel.dropped`; ``stop``: the local call's signal, or None), so Ctrl-C
    stops a call at its next node, as it did when every node was a task of its own.
    """
    nodes, deps = args[:len(stage.nodes)], args[len(stage.nodes):]
    out = stages.linearize(stage, nodes, deps, _dropped(stage, stop))
    return out[0] if stage.bare else out


def forward_backward(stage: Stage, stop, flows: tuple, rows, *args):
    """Forward and backward of a stage whose cotangents are all seeds of its own outputs
    (``flows`` and ``rows`` as for :func:`backward`, without sources): ``(exposed values, per
    output the deps' cotangents)``. A fused stage runs as one program, as
    ``jax.jit(jax.value_and_grad)`` does, its residuals never leaving XLA; others, seeds given
    by the user and Jacobians' rows, run as :func:`forward` then :func:`backward`."""
    nodes, deps = args[:len(stage.nodes)], args[len(stage.nodes):]
    if stage.fused and rows is None and all(f is None or f[2] is None
                                            for per_output in flows for f in per_output):
        seeded = tuple(tuple(f is not None for f in per_output) for per_output in flows)
        out = stages.gradients(stage, nodes, deps, seeded)
        if out is not None:
            values, cts = out
            for per_output in flows:  # the checks seed() makes: a scalar output, ...
                for value, flow in zip(values, per_output):
                    _cotangent(value, flow, ())
            return values, cts
    linearized = stages.linearize(stage, nodes, deps, _dropped(stage, stop))
    return linearized[0], backward(stage, stop, flows, rows, linearized, *deps)


def pulled(out) -> list:
    """The cotangents from :func:`forward_backward`'s result. (A task of daskdag's own: a worker
    that unpickles it imports daskdag, so Dask knows how to receive JAX arrays
    (:mod:`daskdag.transport.protocol`) before the result arrives from another worker.)"""
    return out[1]


def pick(out, linearized: bool, k: int):
    """The ``k``-th exposed value from a forward task's result."""
    return (out[0] if linearized else out)[k]


def backward(stage: Stage, stop, flows: tuple, rows, linearized, *args) -> list:
    """Pull the cotangents of the stage's exposed nodes back to the stage's deps, for each
    output whose gradient passes through the stage. Returns, per output, a tuple aligned with
    the stage's deps: each dep's cotangent, ``None`` where none flows.

    ``linearized`` is the forward task's ``(values, pullback)``. ``args`` are the values of the
    stage's deps (a pullback that moved takes its input residuals from them), then the sources of
    the cotangents: the results of consumer stages' backward tasks. ``flows[k][e]`` says where
    output ``k``'s cotangent at exposed node ``e`` comes from: ``None``, nowhere;
    ``("seed", output, ct, batched)``, the node is that output (:func:`seed`); else
    ``((source, output index, position), ...)``, the sum of its shares
    ``sources[source][output index][position]``. ``stop``: as for :func:`forward`.

    Several outputs are pulled back at once, their cotangents stacked, under ``jax.vmap``
    (one pass through the stage's pullbacks instead of one per output), where that pays
    (:data:`BATCH_FROM`, by the pullback's ``batching``); else, and where the pullback cannot
    be vmapped (a host callback), one by one.

    ``rows``: for a Jacobian, a :class:`Rows`: each cotangent is a stack of rows (a seed is
    ``("basis", output)``, see :func:`basis`), and so is each result (:func:`_pull_rows`).
    """
    values, pullback = linearized
    deps, sources = args[:len(stage.deps)], args[len(stage.deps):]
    cts = [tuple(_cotangent(value, flow, sources) for value, flow in zip(values, per_output))
           for per_output in flows]
    dropped = _dropped(stage, stop)
    if rows is not None:
        return _pull_rows(pullback, cts, values, deps, dropped, rows.chunk)
    if _worth_batching(getattr(pullback, "batching", None), cts):
        return _batched(pullback, cts, values, deps, dropped)
    return [pullback(c, deps, dropped) for c in cts]


# The fewest cotangents worth batching, per kind of pullback (see pullback.Pullback.batching):
# a compiled program's batched trace is cached, so it gains from 2. vmap of an eager pullback
# traces it anew each call, 5 to 20 ms; it pays where dispatching op by op costs more than the
# ops, that is for many small cotangents. Measured (2 cores, a stage of 4 tanh-of-matmul nodes,
# vmap against a loop over the cotangents): 32x256 cotangents, 0.54x at 8 and 0.28x at 16;
# 128x256, 0.83x at 8; 400x256, 1.3x at 8; 512x512, 1.36x at 8 and 1.23x at 16.
BATCH_FROM = {"compiled": 2, "eager": 8}
BATCH_ELEMENTS = 2 ** 15  # eager pullbacks: batched only for cotangents of at most this many


def _worth_batching(batching, cts: list) -> bool:
    if len(cts) < BATCH_FROM.get(batching, len(cts) + 1):
        return False
    return batching != "eager" or max(
        sum(int(np.size(leaf)) for c in per_output if c is not None for leaf in c)
        for per_output in cts) <= BATCH_ELEMENTS


def _cotangent(value, flow, sources):
    if flow is None:
        return None
    if flow[0] == "seed":
        return seed(flow[1], value, *flow[2:])
    if flow[0] == "basis":
        return basis(flow[1], value)
    return total(sources[s][k][i] for s, k, i in flow)


def _batched(pullback, cts: list, values, deps, dropped) -> list:
    """``[pullback(c, deps) for c in cts]`` as one call under ``jax.vmap``: each output's
    cotangents a stack of one row (:func:`_pull_rows`)."""
    rows = [tuple(None if c is None else tuple(leaf[None] for leaf in c) for c in per_output)
            for per_output in cts]
    return [tuple(None if d is None else tuple(leaf[0] for leaf in d) for d in out)
            for out in _pull_rows(pullback, rows, values, deps, dropped)]


@dataclass(frozen=True)
class Rows:
    """Cotangents are stacks of rows (a Jacobian's), pulled back at most ``chunk`` rows per
    ``jax.vmap`` call (``None``: all at once), to bound the memory a pass takes."""

    chunk: int | None = None


def _pull_rows(pullback, cts: list, values, deps, dropped, chunk: int | None = None) -> list:
    """Per output, ``pullback`` of each row of its stacked cotangents (``cts``: per output, per
    exposed node, a tuple of stacked leaves or ``None``): every output's rows in one stack
    (zeros where an exposed node gets none from an output), ``chunk`` rows at a time (default
    all) under ``jax.vmap``, or row by row where the pullback cannot be vmapped (a host
    callback)."""
    counts = [next((len(leaf) for c in per_output if c is not None for leaf in c[:1]), 0)
              for per_output in cts]
    stacked = []
    for e, value in enumerate(values):
        column = [c[e] for c in cts]
        if all(c is None for c in column):
            stacked.append(None)
            continue
        zeros = [tuple(jnp.zeros((n, *jnp.shape(leaf)), jnp.result_type(leaf))
                       for leaf in differentiable_leaves(value)) for n in counts]
        parts = (z if c is None else c for c, z in zip(column, zeros))
        stacked.append(tuple(jnp.concatenate(leaves) if len(leaves) > 1 else leaves[0]
                             for leaves in zip(*parts)))
    total_rows = sum(counts)
    if not total_rows:  # no differentiable leaf flows: nothing to stack
        return [pullback(c, deps, dropped) for c in cts]
    step = chunk or total_rows
    traceable = getattr(pullback, "traceable", True)  # (user code on NumPy values is not)
    pieces = []
    for start in range(0, total_rows, step):
        part = jax.tree.map(lambda a: a[start:start + step], tuple(stacked))
        if traceable:
            try:
                pieces.append(jax.vmap(lambda ct: pullback(ct, deps, dropped))(part))
                continue
            except Cancelled:
                raise
            except Exception:  # not vmappable: row by row (a node's own error raises again)
                pass
        one = [pullback(jax.tree.map(lambda a: a[k], part), deps, dropped)
               for k in range(min(step, total_rows - start))]
        pieces.append(jax.tree.map(lambda *r: jnp.stack(r), *one))
    out = pieces[0] if len(pieces) == 1 else jax.tree.map(lambda *p: jnp.concatenate(p), *pieces)
    bounds = np.cumsum([0, *counts])
    return [jax.tree.map(lambda a: a[lo:hi], out) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _dropped(stage: Stage, stop):
    return dropped(stop) if len(stage.nodes) > 1 and not stage.fused else None


def gradient(picks: tuple, x, output, own, *sources):
    """The gradient of an input, or of a node, whose value is ``x``, shaped like it: the sum of
    its shares ``sources[j][k][i]`` for ``(k, i)`` in ``picks`` (see :func:`backward`) and of
    ``own``, the output's seed flow (:func:`backward`'s ``flows``) when ``x`` is the output
    itself, else None, on its differentiable leaves (zeros when the output does not use it),
    ``None`` on the leaves held constant. For a Jacobian, ``output`` is the output's value, and
    each leaf is stacked over its rows (:func:`basis`); else it is ``None``. A sweep's chunk of
    item-by-item values (:class:`~daskdag.sweeps.chunked.Items`) gives its gradient stacked."""
    leaves, treedef = jax.tree.flatten(x)
    lead = () if output is None else (basis_size(output),)
    shares = [s[k][i] for s, (k, i) in zip(sources, picks)] + ([_cotangent(x, own, ())] if own else [])
    flat = iter(total(shares) if shares else
                [jnp.zeros((*lead, *jnp.shape(leaf)), jnp.result_type(leaf))
                 for leaf in leaves if is_differentiable(leaf)])
    grad = treedef.unflatten([next(flat) if is_differentiable(leaf) else None for leaf in leaves])
    return stacked(grad) if isinstance(x, Items) else grad


def seed(output: str, primal, ct, batched: bool = False) -> tuple:
    """The cotangent an output starts from: 1 for a real scalar, else the user's ``ct``, as a
    flat tuple over the output's differentiable leaves (see :mod:`daskdag.rules.pullback`).

    ``ct`` has the output's structure (``None`` allowed where a leaf is held constant).
    ``batched``: the output carries a leading item axis (a sweep's chunk); ``ct`` and the checks
    are for one item, and the seed is broadcast over the items.
    """
    if isinstance(primal, Items):  # (a chunk's item-by-item values: each item's seed in turn)
        return tuple(leaf for one in primal for leaf in seed(output, one, ct))
    leaves, treedef = jax.tree.flatten(primal)
    item = [jax.ShapeDtypeStruct(jnp.shape(p)[1:] if batched else jnp.shape(p), jnp.result_type(p))
            if is_differentiable(p) else None for p in leaves]
    if ct is None:
        if not (treedef.num_leaves == 1 and treedef_is_leaf(treedef) and item[0] is not None
                and item[0].shape == () and jnp.issubdtype(item[0].dtype, jnp.floating)):
            raise ValueError(f"output {output!r} is not a real scalar: it is "
                             f"{_describe(primal, batched)}; pass cotangents={{{output!r}: ct}} "
                             f"with ct shaped like it")
        return (jnp.ones_like(leaves[0]),)
    ct_leaves, ct_def = jax.tree.flatten(ct, is_leaf=lambda c: c is None)
    if ct_def != jax.tree.structure(primal, is_leaf=lambda c: c is None) or any(
            i is not None and jnp.shape(c) != i.shape for c, i in zip(ct_leaves, item)):
        raise ValueError(f"cotangent for output {output!r} is {_describe(ct)}, "
                         f"but the output is {_describe(primal, batched)}")
    seeds = []
    for c, i, p in zip(ct_leaves, item, leaves):
        if i is None:  # a leaf held constant carries no cotangent
            continue
        if jnp.iscomplexobj(c) and not jnp.issubdtype(i.dtype, jnp.complexfloating):
            raise ValueError(f"cotangent for output {output!r} is complex, but the output is real "
                             f"({i.dtype}): its imaginary part would be dropped")
        c = jnp.asarray(c, i.dtype)
        seeds.append(np.broadcast_to(c, jnp.shape(p)) if batched else c)
    return tuple(seeds)


def basis(output: str, primal) -> tuple:
    """The rows of the identity over the elements of ``primal``'s differentiable leaves, in
    ``jax.tree.leaves`` order, as a cotangent: a tuple with one ``[rows, *leaf.shape]`` array per
    leaf. Pulled back, row ``r`` gives the gradient of element ``r``: a row of the Jacobian."""
    leaves = differentiable_leaves(primal)
    for leaf in leaves:
        if jnp.iscomplexobj(leaf):
            raise ValueError(f"output {output!r} is complex ({jnp.result_type(leaf)}): a "
                             f"Jacobian needs real outputs, as jax.jacrev does")
    n, start, seeds = basis_size(primal), 0, []
    for leaf in leaves:
        size = int(np.size(leaf))
        eye = np.zeros((n, size), jnp.result_type(leaf))
        eye[np.arange(start, start + size), np.arange(size)] = 1
        seeds.append(jnp.asarray(eye.reshape(n, *jnp.shape(leaf))))
        start += size
    return tuple(seeds)


def basis_size(primal) -> int:
    """How many rows :func:`basis` has: the elements of ``primal``'s differentiable leaves."""
    return sum(int(np.size(leaf)) for leaf in differentiable_leaves(primal))


def total(cts):
    """Sum cotangents (flat tuples, one array per differentiable leaf)."""
    return reduce(add, cts)


def _describe(tree, batched: bool = False) -> str:
    def shape(leaf):
        return tuple(jnp.shape(leaf)[1:] if batched else jnp.shape(leaf))

    def one(leaf):
        return f"{jnp.result_type(leaf)}{list(shape(leaf))}" if is_numeric(leaf) else type(leaf).__name__

    if is_numeric(tree):
        return f"an array of shape {shape(tree)} and dtype {jnp.result_type(tree)}"
    return str(jax.tree.map(one, tree))
