"""A stage's backward pass carried as its dense Jacobian, where that is small.

On a cluster, a stage's backward pass is normally a task of its own, beside the residuals its
forward task left; for a stage with few differentiated inputs (branches that each take a small
parameter vector) that round trip costs more than the arithmetic. Such a stage's forward task
turns its pullback into the Jacobian of its exposed values with respect to its deps
(:func:`densify`: its own residuals pulled back under ``jax.vmap``, one row per element, no
second forward pass). The small Jacobian travels with the values, and the backward pass becomes
a contraction inside whichever task takes its cotangents: one task less per stage.

Beyond :data:`MOST_ROWS` rows or :data:`MOST_BYTES`, :func:`densify` keeps the pullback, which
then travels with the values.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.model.leaves import differentiable_leaves
from daskdag.rules.pullback import Pullback
from daskdag.rules.seeds import basis

#: The most rows (elements of a stage's exposed values) a dense Jacobian is made from: each row
#: is a pullback of the stage's residuals, so this bounds what making it costs.
MOST_ROWS = 256
#: The largest dense Jacobian kept, in bytes: no more than a small value carried in a task
#: (:data:`daskdag.graph.assembly.INLINE_BYTES`).
MOST_BYTES = 64 * 1024


def densify(pullback: Pullback, values: Sequence[Any], deps: Sequence[Any], pull_rows: Callable,
            dropped=None) -> Pullback:
    """``pullback`` (of a stage whose exposed values are ``values``, run on ``deps``) as a
    :class:`DensePullback`, when its Jacobian has at most :data:`MOST_ROWS` rows and
    :data:`MOST_BYTES` bytes; else ``pullback`` itself. ``pull_rows(pullback, cts, values,
    deps, dropped)``: per output, the pullback of each row of its stacked cotangents
    (a backward task's, :func:`daskdag.graph.tasks.backward` for a Jacobian)."""
    sizes = [sum(int(np.size(leaf)) for leaf in differentiable_leaves(v)) for v in values]
    rows = sum(sizes)
    if not rows or rows > MOST_ROWS or not all(_single_or_double(leaf) for v in (*values, *deps)
                                               for leaf in differentiable_leaves(v)):
        return pullback
    in_bytes = sum(int(np.size(leaf)) * jnp.result_type(leaf).itemsize
                   for d in deps for leaf in differentiable_leaves(d))
    if rows * in_bytes > MOST_BYTES:
        return pullback
    cts = [tuple(basis(f"#{e}", v) if k == e else None for k in range(len(values)))
           for e, v in enumerate(values) if sizes[e]]
    blocks = iter(pull_rows(pullback, cts, values, deps, dropped))
    jacobian = tuple(next(blocks) if size else None for size in sizes)
    return DensePullback(tuple(jax.tree.map(np.asarray, block) for block in jacobian))


def _single_or_double(leaf) -> bool:
    """A real dtype of 32 or 64 bits: a contraction's sums may round otherwise than the
    pullback's by an ulp, which half precision would show."""
    dtype = jnp.result_type(leaf)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 4


class DensePullback(Pullback):
    """A stage's pullback as its Jacobian: ``jacobian[e][i]``, for exposed value ``e`` and dep
    ``i``, a tuple of the dep's differentiable leaves, each stacked over the rows of ``e``'s
    elements (``None`` for a dep held constant; ``jacobian[e]`` is None for a value with no
    differentiable leaf). Called as any :class:`~daskdag.rules.pullback.Pullback`: a
    cotangent's leaves, flattened in order, contract with the rows."""

    __slots__ = ("jacobian",)

    def __init__(self, jacobian: tuple):
        self.jacobian = jacobian

    def __call__(self, cts: tuple, deps: Sequence[Any], dropped=None) -> tuple:
        return self._contract(cts, lead=0)

    def rows(self, cts: tuple, deps: Sequence[Any], dropped=None) -> tuple:
        return self._contract(cts, lead=1)

    def _contract(self, cts: tuple, lead: int) -> tuple:
        """``lead``: 1 when each cotangent leaf is stacked over rows. In NumPy: a few small
        products, where each JAX op would cost its dispatch."""
        shapes = next(j for j in self.jacobian if j is not None)  # (of each dep's zeros)
        head = next((np.shape(c[0])[:lead] for c in cts if c is not None), (0,) * lead)
        out: list = [None] * len(shapes)
        for ct, block in zip(cts, self.jacobian):
            if ct is None or block is None:
                continue
            flat = np.concatenate([np.reshape(np.asarray(c), (*head, -1)) for c in ct], axis=-1)
            for i, leaves in enumerate(block):
                if leaves is None:
                    continue
                share = [np.tensordot(flat.astype(j.dtype, copy=False), j, axes=1) for j in leaves]
                out[i] = share if out[i] is None else [a + b for a, b in zip(out[i], share)]
        return tuple(None if leaves is None else tuple(
            np.zeros((*head, *j.shape[1:]), j.dtype) for j in leaves) if o is None else tuple(o)
                     for o, leaves in zip(out, shapes))

    def residual_nbytes(self) -> int:
        return sum(j.nbytes for block in self.jacobian if block is not None
                   for leaves in block if leaves is not None for j in leaves)

    def __reduce__(self):
        return DensePullback, (self.jacobian,)
