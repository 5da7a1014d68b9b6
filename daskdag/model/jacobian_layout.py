"""A Jacobian's results laid out: from one matrix over every differentiated name's elements
(NumPy, ``scipy.sparse``, or tracers inside a program) to ``jax.jacrev``'s layout (the output's
structure of the inputs' structures), or to ``scipy.sparse`` blocks per name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.model.leaves import PyTree, differentiable_leaves, is_differentiable
from daskdag.model.plan import Plan
from daskdag.model.request import one_input

if TYPE_CHECKING:
    import scipy.sparse as sp


def flat_rows(rows: PyTree) -> np.ndarray:
    """``(rows, elements)``: one name's stacked rows, its differentiable leaves side by side."""
    leaves = [np.asarray(r) for r in jax.tree.leaves(rows)]
    return np.hstack([r.reshape(len(r), -1) for r in leaves]) if leaves else np.zeros((0, 0))


def float_type(value: PyTree):
    """The dtype of ``value``'s Jacobians: its differentiable leaves' (float32 where none)."""
    leaves = differentiable_leaves(value)
    return jnp.result_type(*leaves) if leaves else jnp.float32


def row_template(rows: PyTree) -> PyTree:
    """A name's structure from its stacked rows: each differentiable leaf's shape and dtype."""
    return jax.tree.map(lambda r: jax.ShapeDtypeStruct(r.shape[1:], r.dtype), rows)


def split_columns(matrix: Any, names: Sequence[str], widths: dict[str, int]
                  ) -> dict[str, sp.csr_array]:
    """``matrix``'s columns, ``widths[i]`` for each of ``names`` in turn, one matrix per name."""
    import scipy.sparse as sp
    return {i: sp.csr_array(matrix[:, s]) for i, s in zip(names, _spans(widths[i] for i in names))}


def _spans(widths) -> list[slice]:
    """Consecutive slices, one of each width."""
    ends = np.cumsum([0, *widths]).tolist()
    return [slice(a, b) for a, b in zip(ends, ends[1:])]


def _width(template: PyTree) -> int:
    """The elements of a name's leaves (its :func:`row_template`'s, ``None`` aside)."""
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(template))


def laid_out(plan: Plan, value: PyTree, full: Any, templates: dict, sparse: bool,
             items: bool = False) -> PyTree:
    """One output's Jacobian ``full`` (over every wrt name's elements; ``templates``: each
    name's leaves' shapes and dtypes) as its result's ``grad``: ``scipy.sparse`` per name, or
    ``jax.jacrev``'s layout. ``items``: a sweep's, dense, with a leading axis of items (NumPy
    or dask arrays)."""
    import scipy.sparse as sp
    widths = {i: _width(templates[i]) for i in plan.wrt}
    if sparse:
        parts = split_columns(sp.csr_array(full), plan.wrt, widths)
        return parts[plan.wrt[0]] if one_input(plan.spec, parts) else parts
    dense = full if items else full.toarray() if sp.issparse(full) else np.asarray(full)
    jacs = {i: jacrev_layout(value, stacked_rows(dense[..., s], templates[i]), items)
            for i, s in zip(plan.wrt, _spans(widths.values()))}
    return joined(value, jacs, one_input(plan.spec, jacs))


def stacked_rows(block: np.ndarray | jax.Array, template: PyTree) -> PyTree:
    """``block`` ``(..., output elements, name elements)`` as stacked rows in the name's
    structure."""
    leaves, treedef = jax.tree.flatten(template, is_leaf=lambda leaf: leaf is None)
    spans = _spans(0 if leaf is None else int(np.prod(leaf.shape)) for leaf in leaves)
    lead = block.shape[:-1]
    return treedef.unflatten([
        None if leaf is None
        else block[..., s].reshape(*lead, *leaf.shape).astype(leaf.dtype, copy=False)
        for leaf, s in zip(leaves, spans)])


def joined(value: PyTree, jacs: dict, single: bool) -> PyTree:
    """Each name's Jacobian (``jacs``) as a result's: the one name's alone where ``single``
    (:func:`~daskdag.model.request.one_input`), else the output's structure of
    ``{name: ...}``."""
    if single:
        return next(iter(jacs.values()))
    out_def = jax.tree.structure(value)
    parts = {i: out_def.flatten_up_to(j) for i, j in jacs.items()}
    return out_def.unflatten([None if all(p[k] is None for p in parts.values())
                              else {i: p[k] for i, p in parts.items()}
                              for k in range(out_def.num_leaves)])


def dense_jacobian_of_columns(names: tuple[str, ...], single: bool, templates: tuple,
                              value: PyTree, columns: tuple) -> PyTree:
    """:func:`joined` Jacobians of a forward pass's ``columns`` (its tangent's leaves, each
    ``(inputs' elements, *leaf shape)``), traced by JAX; ``templates``: each name's
    :func:`row_template`, flattened (``(treedef, leaves)``)."""
    widths = [_width(leaves) for _, leaves in templates]
    if columns:
        full = jnp.concatenate([c.reshape(c.shape[0], -1) for c in columns], axis=-1).T
    else:  # (no tangent reached the output: it reads none of the inputs, or has no float leaf)
        leaves = differentiable_leaves(value)
        full = jnp.zeros((sum(int(np.prod(np.shape(leaf))) for leaf in leaves), sum(widths)),
                         float_type(value))
    jacs = {i: jacrev_layout(value, stacked_rows(full[:, s], treedef.unflatten(leaves)))
            for i, (treedef, leaves), s in zip(names, templates, _spans(widths))}
    return joined(value, jacs, single)


def to_jax(a: np.ndarray) -> jax.Array:
    """A JAX array of ``a`` (never changed after): a large one's buffer taken where JAX can,
    a small one copied by the cheaper ``jnp.asarray``."""
    return jax.device_put(a, may_alias=True) if a.nbytes > 2 ** 16 else jnp.asarray(a)


def jacrev_layout(value: PyTree, rows: PyTree, items: bool = False) -> PyTree:
    """One output's Jacobian for one input, laid out as ``jax.jacrev`` does, from its rows (the
    input's structure, each differentiable leaf stacked over the output's elements, ``None``
    elsewhere): JAX arrays, each made once from NumPy slices (each slice in JAX would be an op
    dispatched). ``items``: a sweep's, with a leading axis of items, kept as they come; so are
    tracers."""
    lead = 1 if items else 0
    in_leaves, in_def = jax.tree.flatten(rows, is_leaf=lambda leaf: leaf is None)
    made = not items and not any(isinstance(leaf, jax.core.Tracer) for leaf in in_leaves)
    if made:
        in_leaves = [None if r is None else np.asarray(r) for r in in_leaves]
    out_leaves, out_def = jax.tree.flatten(value)
    per_leaf: list = []
    start = 0
    for leaf in out_leaves:
        if not is_differentiable(leaf):
            per_leaf.append(None)
            continue
        shape = tuple(np.shape(leaf))
        n = int(np.prod(shape[lead:]))
        blocks = [None if r is None else r[(slice(None),) * lead + (slice(start, start + n),)]
                  .reshape((*shape, *r.shape[lead + 1:])) for r in in_leaves]
        per_leaf.append(in_def.unflatten([to_jax(b) if made and b is not None else b
                                          for b in blocks]))
        start += n
    return out_def.unflatten(per_leaf)
