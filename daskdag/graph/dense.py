"""A stage's backward pass carried as its dense Jacobian, where that is small: on a cluster, a
stage with few differentiated inputs turns its pullback into its Jacobian (:func:`densify`),
which travels with its values, and the backward pass becomes a contraction inside the task that
takes its cotangents: one task (and round trip) less per stage.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.model.leaves import differentiable_leaves
from daskdag.rules.vjp import Pullback, basis

MOST_ROWS = 256  # the most rows (a pullback each) a dense Jacobian is made from
MOST_BYTES = 64 * 1024  # the largest dense Jacobian kept (assembly.INLINE_BYTES)


def densify(pullback: Pullback, values: Sequence[Any], deps: Sequence[Any], pull_rows: Callable,
            dropped=None) -> Pullback:
    """``pullback`` (of a stage with exposed ``values``, run on ``deps``) as a
    :class:`DensePullback` within :data:`MOST_ROWS` and :data:`MOST_BYTES`, else itself.
    ``pull_rows``: as :func:`daskdag.graph.tasks._pull_rows`."""
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
    """A real dtype of 32 or 64 bits (a contraction may round otherwise by an ulp)."""
    dtype = jnp.result_type(leaf)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 4


class DensePullback(Pullback):
    """A stage's pullback as its Jacobian: ``jacobian[e][i]``, for exposed value ``e`` and dep
    ``i``, the dep's differentiable leaves, each stacked over ``e``'s elements (``None`` for a
    dep held constant, or a value with no differentiable leaf)."""

    __slots__ = ("jacobian",)

    def __init__(self, jacobian: tuple):
        self.jacobian = jacobian

    def __call__(self, cts: tuple, deps: Sequence[Any], dropped=None) -> tuple:
        return self._contract(cts, lead=0)

    def rows(self, cts: tuple, deps: Sequence[Any], dropped=None) -> tuple:
        return self._contract(cts, lead=1)

    def _contract(self, cts: tuple, lead: int) -> tuple:
        """``lead``: 1 when each cotangent leaf is stacked over rows. In NumPy (JAX dispatch
        would cost more)."""
        shapes = next(j for j in self.jacobian if j is not None)  # (of each dep's zeros)
        head = next((np.shape(c[0])[:lead] for c in cts if c is not None), (0,) * lead)
        out: list = [None if leaves is None else [np.zeros((*head, *j.shape[1:]), j.dtype)
                                                  for j in leaves] for leaves in shapes]
        for ct, block in zip(cts, self.jacobian):
            if ct is None or block is None:
                continue
            flat = np.concatenate([np.reshape(np.asarray(c), (*head, -1)) for c in ct], axis=-1)
            for i, leaves in enumerate(block):
                if leaves is not None:
                    out[i] = [a + np.tensordot(flat.astype(j.dtype, copy=False), j, axes=1)
                              for a, j in zip(out[i], leaves)]
        return tuple(None if o is None else tuple(o) for o in out)

    def residual_nbytes(self) -> int:
        return sum(j.nbytes for block in self.jacobian if block is not None
                   for leaves in block if leaves is not None for j in leaves)

    def __reduce__(self):
        return DensePullback, (self.jacobian,)
