"""A sweep's values and gradients stacked over its items (in NumPy, :class:`Stacked`; left on the
devices, :class:`OnDevice`), and their shapes when no item gave any."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.model.leaves import UNKNOWN, abstract, abstract_values
from daskdag.sweeps.chunked import SKIPPED, Items, own_function


class Stacked:
    """One output's values, or one gradient, stacked over all items as chunks arrive. ``None``
    leaves (not differentiated) stay ``None``; rows of items that never arrived (failed) are
    NaN, or 0 where the dtype has none."""

    def __init__(self, size: int):
        self.size, self.tree, self.arrived = size, None, np.zeros(size, bool)

    def put(self, start: int, stop: int, tree, carries_items: bool):
        if isinstance(tree, Items):  # one item at a time, straight into its row
            for i, item in enumerate(tree):
                if item is not SKIPPED:  # a failed item's row stays as never arrived
                    row = jax.tree.map(lambda a: np.asarray(a)[None], item)
                    self.put(start + i, start + i + 1, row, True)
            return
        if not carries_items:  # the same for every item
            tree = jax.tree.map(lambda a: np.broadcast_to(a, (stop - start, *np.shape(a))), tree)
        if self.tree is None:  # uninitialised: result() fills the rows that never arrive
            self.tree = jax.tree.map(
                lambda a: np.empty((self.size, *np.shape(a)[1:]), np.asarray(a).dtype), tree)

        def copy(dst, src):
            dst[start:stop] = np.asarray(src)

        jax.tree.map(copy, self.tree, tree)
        self.arrived[start:stop] = True

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


class OnDevice:
    """:class:`Stacked`'s twin for results left on the devices that computed them: each chunk's
    ``jax.Array`` trees kept as they come, joined once, in :meth:`result`."""

    def __init__(self, size: int):
        self.size, self.arrived = size, np.zeros(size, bool)
        self.pieces: list[tuple[int, int, object]] = []  # (start, stop, tree), as they came

    @property
    def tree(self):
        """A piece's tree, or None before any arrived."""
        return self.pieces[0][2] if self.pieces else None

    def put(self, start: int, stop: int, tree, carries_items: bool):
        if not carries_items:  # the same for every item
            tree = jax.tree.map(lambda a: jnp.broadcast_to(a, (stop - start, *jnp.shape(a))),
                                tree)
        self.pieces.append((start, stop, tree))
        self.arrived[start:stop] = True

    forget = Stacked.forget

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


def _blank(like, rows: int):
    """``rows`` rows shaped as ``like``'s, never arrived."""
    return jax.tree.map(lambda a: np.full((rows, *np.shape(a)[1:]), missing_value(a.dtype),
                                          a.dtype), like)


def missing_value(dtype):
    """The value of a row that never arrived: NaN, or 0 where the dtype has none."""
    return np.nan if np.issubdtype(dtype, np.inexact) else 0


def item_shapes(sweep) -> tuple[dict, dict]:
    """One item of ``sweep``'s ``({output: value shape}, {output: {input: gradient shape}})`` as
    ``ShapeDtypeStruct`` trees, traced abstractly. A gradient is shaped like its input's item
    (a Jacobian's after the output's rows), ``None`` on leaves that are not floating arrays; a
    value is ``None`` where a node on its way cannot be traced."""
    plan = sweep.plan
    avals = abstract_values(plan.spec, plan.needed,
                            {i: abstract(v, i in sweep.batched) for i, v in sweep.values.items()},
                            own_function)
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
