"""A sweep's values and gradients stacked over its items (in NumPy, :class:`Stacked`; left on the
devices, :class:`OnDevice`), and their shapes when no item gave any."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.model.leaves import UNKNOWN, abstract, abstract_values
from daskdag.sweeps.chunked import Items, own_function, stacked


class Stacked:
    """One output's values, or one gradient, stacked over all items in NumPy as chunks arrive.
    ``None`` leaves (not differentiated) stay ``None``; rows of items that never arrived
    (failed) are NaN, or 0 where the dtype has none."""

    xp = np  # the arrays a value the same for every item is broadcast as

    def __init__(self, size: int):
        self.size, self.tree, self.arrived = size, None, np.zeros(size, bool)

    def put(self, start: int, stop: int, tree, carries_items: bool):
        """Items ``start:stop``'s ``tree`` (as :func:`rows` lays it out)."""
        self._put(start, stop, rows(tree, stop - start, carries_items, self.xp))
        self.arrived[start:stop] = True

    def _put(self, start: int, stop: int, tree):
        if self.tree is None:  # uninitialised: result() fills the rows that never arrive
            self.tree = jax.tree.map(
                lambda a: np.empty((self.size, *np.shape(a)[1:]), np.asarray(a).dtype), tree)

        def copy(dst, src):
            dst[start:stop] = np.asarray(src)

        jax.tree.map(copy, self.tree, tree)

    def forget(self, rows) -> None:
        """Rows (items) that failed: as if never arrived, whatever was put there."""
        self.arrived[list(rows)] = False

    def result(self, item):
        """The stacked tree; if no item arrived, NaN rows shaped by ``item`` (one item's
        ``ShapeDtypeStruct`` tree), or ``None`` when that is unknown too."""
        if self.tree is None and item is not None:
            self.tree = jax.tree.map(lambda a: np.empty((self.size, *a.shape), a.dtype), item)
        if self.tree is not None and not self.arrived.all():
            for a in jax.tree.leaves(self.tree):
                a[~self.arrived] = missing_value(a.dtype)
            self.arrived[:] = True
        return self.tree


class OnDevice(Stacked):
    """:class:`Stacked`'s twin for results left on the devices that computed them: each chunk's
    ``jax.Array`` trees kept as they come (``tree``: the first, or None before any arrived),
    joined once, in :meth:`result`."""

    xp = jnp

    def __init__(self, size: int):
        super().__init__(size)
        self.pieces: list[tuple[int, int, object]] = []  # (start, stop, tree), as they came

    def _put(self, start: int, stop: int, tree):
        self.tree = tree if self.tree is None else self.tree
        self.pieces.append((start, stop, tree))

    def result(self, item):
        like = self.tree
        if like is None:
            if item is None:
                return None
            like = jax.tree.map(lambda a: np.empty((1, *a.shape), a.dtype), item)
        parts, at = [], 0
        for start, stop, tree in sorted(self.pieces, key=lambda p: p[0]):
            if start > at:  # items that never arrived
                parts.append(_blank(like, start - at))
            parts.append(tree)
            at = stop
        if at < self.size or not parts:
            parts.append(_blank(like, self.size - at))
        joined = jax.tree.map(jnp.asarray, parts[0]) if len(parts) == 1 else jax.tree.map(
            lambda *leaves: jnp.concatenate(leaves), *parts)
        if not self.arrived.all():
            missing = np.flatnonzero(~self.arrived)
            joined = jax.tree.map(lambda a: a.at[missing].set(missing_value(a.dtype)), joined)
        return joined


def rows(tree, count: int, carries_items: bool, xp=np):
    """``tree``, a chunk's value or gradient, with a row per item of the chunk's ``count``:
    :class:`~daskdag.sweeps.chunked.Items` stacked in NumPy (a failed item's row another's), a
    value the same for every item (not ``carries_items``) broadcast as ``xp`` arrays."""
    if isinstance(tree, Items):
        return stacked(tree, numpy=True)
    if carries_items:
        return tree
    return jax.tree.map(lambda a: xp.broadcast_to(a, (count, *np.shape(a))), tree)


def _blank(like, rows: int):
    """``rows`` rows shaped as ``like``'s, never arrived."""
    return jax.tree.map(lambda a: np.full((rows, *np.shape(a)[1:]), missing_value(a.dtype),
                                          a.dtype), like)


def missing_value(dtype):
    """The value of a row that never arrived: NaN, or 0 where the dtype has none."""
    return np.nan if np.issubdtype(dtype, np.inexact) else 0


def item_avals(sweep) -> dict:
    """One item's shape of each input and needed node of ``sweep``
    (:func:`~daskdag.model.leaves.abstract_values`), traced abstractly."""
    return abstract_values(sweep.plan.spec, sweep.plan.needed,
                           {i: abstract(v, i in sweep.batched) for i, v in sweep.values.items()},
                           own_function)


def item_shapes(sweep, avals: dict | None = None) -> tuple[dict, dict]:
    """One item of ``sweep``'s ``({output: value shape}, {output: {input: gradient shape}})`` as
    ``ShapeDtypeStruct`` trees, from ``avals`` (by default :func:`item_avals`'). A gradient is
    shaped like its input's item (a Jacobian's after the output's rows), ``None`` on leaves that
    are not floating arrays; a value is ``None`` where a node on its way cannot be traced."""
    plan = sweep.plan
    avals = item_avals(sweep) if avals is None else avals
    values = {o: None if avals[o] is UNKNOWN else avals[o] for o in plan.outputs}
    rows = getattr(sweep.lowered, "rows", None)
    grads = {o: {i: jax.tree.map(partial(_cotangent_shape, lead=() if rows is None else (
        _rows(values[o], rows.colours_of(o)),)), avals[i]) for i in plan.wrt}
        for o in plan.outputs}
    return values, grads


def _rows(aval, colours) -> int:
    """A Jacobian's rows for an output of one item shaped as ``aval``: its elements, or its
    colours."""
    if colours is not None:
        return int(max(colours)) + 1 if len(colours) else 0
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(aval)
               if jnp.issubdtype(a.dtype, jnp.inexact))


def _cotangent_shape(a, lead: tuple = ()):
    if isinstance(a, jax.ShapeDtypeStruct) and jnp.issubdtype(a.dtype, jnp.inexact):
        return jax.ShapeDtypeStruct((*lead, *a.shape), a.dtype)
    return None
