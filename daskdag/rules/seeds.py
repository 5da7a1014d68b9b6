"""Where cotangents start and how they add up: an output's seed (1 for a real scalar, else the
user's cotangent), a Jacobian's rows (the identity over an output's elements), and sums of
cotangents (flat tuples). Values over a sweep's chunk are seeded as :class:`PerItem` says."""

from __future__ import annotations

import math
from functools import reduce, singledispatch

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.errors import DAGError
from daskdag.model.colouring import count
from daskdag.model.devices import beside
from daskdag.model.leaves import describe, differentiable_leaves, is_differentiable


@singledispatch
def seed(primal, output: str, ct, batched: bool = False) -> tuple:
    """The cotangent an output starts from, flat: 1 for a real scalar, else the user's ``ct``
    (the output's structure, ``None`` at leaves held constant). ``batched``: the output has a
    leading item axis; ``ct`` is one item's, broadcast over the items."""
    if ct is None:
        check_scalar(primal, output, batched)
        return (jnp.ones_like(jax.tree.leaves(primal)[0]),)
    leaves = jax.tree.leaves(primal)
    item = [jax.ShapeDtypeStruct(jnp.shape(p)[1:] if batched else jnp.shape(p),
                                 jnp.result_type(p)) if is_differentiable(p) else None
            for p in leaves]
    ct_leaves, ct_def = jax.tree.flatten(ct, is_leaf=lambda c: c is None)
    if ct_def != jax.tree.structure(primal, is_leaf=lambda c: c is None) or any(
            i is not None and jnp.shape(c) != i.shape for c, i in zip(ct_leaves, item)):
        raise DAGError(f"cotangent for output {output!r} is {describe(ct)}, "
                       f"but the output is {describe(primal, batched)}", argument="cotangents")
    seeds = []
    for c, i, p in zip(ct_leaves, item, leaves):
        if i is None:  # a leaf held constant carries no cotangent
            continue
        if jnp.iscomplexobj(c) and not jnp.issubdtype(i.dtype, jnp.complexfloating):
            raise DAGError(f"cotangent for output {output!r} is complex, but the output is real "
                           f"({i.dtype}): its imaginary part would be dropped",
                           argument="cotangents")
        c = jnp.asarray(c, i.dtype)
        seeds.append(np.broadcast_to(c, jnp.shape(p)) if batched else c)
    return tuple(seeds)


def check_scalar(primal, output: str, batched: bool = False) -> None:
    """Refuse an ``output`` without a cotangent unless it is a real scalar (per item,
    ``batched``), which starts from 1."""
    leaves = jax.tree.leaves(primal)
    leaf = leaves[0] if len(leaves) == 1 else None
    shape = () if leaf is None else tuple(np.shape(leaf))
    if not (leaf is not None and leaf is primal and (shape[1:] if batched else shape) == ()
            and jnp.issubdtype(jnp.result_type(leaf), jnp.floating)):
        raise DAGError(f"output {output!r} is not a real scalar: it is "
                       f"{describe(primal, batched)}; pass cotangents={{{output!r}: ct}} "
                       f"with ct shaped like it", argument="cotangents")


def basis(output: str, primal, colours=None) -> tuple:
    """The rows of the identity over the elements of ``primal``'s differentiable leaves as a
    cotangent, one ``[rows, *leaf.shape]`` array per leaf: pulled back, row ``r`` is row ``r``
    of the Jacobian. With ``colours`` (one per element), row ``k`` is 1 on every element of
    colour ``k``, pulled back the sum of their gradients."""
    leaves = differentiable_leaves(primal)
    for leaf in leaves:
        if jnp.iscomplexobj(leaf):
            raise DAGError(f"output {output!r} is complex ({jnp.result_type(leaf)}): a "
                           f"Jacobian needs real outputs, as jax.jacrev does")
    size_all = basis_size(primal)
    if colours is not None and len(colours) != size_all:
        raise DAGError(f"the sparsity pattern of output {output!r} has {len(colours)} rows, "
                       f"but the output has {size_all} elements", argument="sparsity")
    n = size_all if colours is None else basis_rows(primal, colours)
    rows = np.arange(size_all) if colours is None else np.asarray(colours)
    start, seeds = 0, []
    for leaf in leaves:
        size = math.prod(jnp.shape(leaf))
        eye = np.zeros((n, size), jnp.result_type(leaf))
        eye[rows[start:start + size], np.arange(size)] = 1
        seeds.append(eye.reshape(n, *jnp.shape(leaf)))  # (NumPy: a program takes it as it is)
        start += size
    return tuple(seeds)


class PerItem:
    """How a call over a sweep's chunk seeds its outputs and gathers its gradients: values with
    a leading item axis. A sweep that passes values item by item extends it."""

    def __dask_tokenize__(self):
        return type(self).__qualname__

    def seed(self, value, output: str, ct) -> tuple:
        """:func:`seed` of each item, ``ct`` one item's."""
        return seed(value, output, ct, batched=True)

    def basis(self, value, output: str, colours=None) -> tuple:
        """:func:`basis` of each item, each leaf ``(rows, items, *item shape)`` (row ``r`` the
        same for every item)."""
        rows = basis(output, jax.tree.map(lambda a: a[0], value), colours)
        n = len(jax.tree.leaves(value)[0])
        return tuple(np.broadcast_to(r[:, None], (r.shape[0], n, *r.shape[1:])) for r in rows)

    def rows(self, value, colours=None) -> int:
        """:func:`basis_rows` of one item."""
        return basis_rows(jax.tree.map(lambda a: a[0], value), colours)

    def gradient(self, value, grad, rows: bool):
        """The gradient of ``value`` over the chunk, as a sweep stacks it: its items first (a
        Jacobian's rows after them: ``(items, rows, ...)``)."""
        return jax.tree.map(lambda g: jnp.moveaxis(g, 0, 1), grad) if rows else grad


def basis_rows(primal, colours=None) -> int:
    """How many rows :func:`basis` has."""
    return basis_size(primal) if colours is None else count(np.asarray(colours))


def basis_size(primal) -> int:
    """The elements of ``primal``'s differentiable leaves."""
    return sum(math.prod(jnp.shape(leaf)) for leaf in differentiable_leaves(primal))


def total(cts):
    """Sum cotangents (flat tuples, one array per differentiable leaf)."""
    return reduce(add, cts)


def add(a: tuple, b: tuple) -> tuple:
    """Two cotangents summed leaf by leaf, each sum on its first leaf's device."""
    return tuple(x + beside(x, y) for x, y in zip(a, b))
