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


def laid_out(plan: Plan, value: PyTree, full: Any, templates: dict, widths: dict[str, int],
             sparse: bool, items: bool = False) -> PyTree:
    """One output's Jacobian ``full`` (over every wrt name's elements; ``widths``: each name's
    elements, ``templates``: its leaves' shapes and dtypes) as its result's ``grad``:
    ``scipy.sparse`` per name, or ``jax.jacrev``'s layout. ``items``: a sweep's, dense, with a
    leading axis of items (NumPy or dask arrays)."""
    import scipy.sparse as sp
    if sparse:
        parts = split_columns(sp.csr_array(full), plan.wrt, widths)
        return parts[plan.wrt[0]] if one_input(plan.spec, parts) else parts
    dense = full if items else full.toarray() if sp.issparse(full) else np.asarray(full)
    spans = _spans(widths[i] for i in plan.wrt)
    jacs = {i: jacrev_layout(value, stacked_rows(dense[..., s], templates[i]), items)
            for i, s in zip(plan.wrt, spans)}
    return joined(plan, value, jacs)


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


def joined(plan: Plan, value: PyTree, jacs: dict) -> PyTree:
    """One name's Jacobian alone when the DAG has one free input and it is all that was
    differentiated, else the output's structure of ``{name: ...}``."""
    return jacs[plan.wrt[0]] if one_input(plan.spec, jacs) else by_output(value, jacs)


def by_output(value: PyTree, jacs: dict) -> PyTree:
    """``{input: output structure of jac}`` as the output's structure of ``{input: jac}``."""
    out_def = jax.tree.structure(value)
    parts = {i: out_def.flatten_up_to(j) for i, j in jacs.items()}
    return out_def.unflatten([None if all(p[k] is None for p in parts.values())
                              else {i: p[k] for i, p in parts.items()}
                              for k in range(out_def.num_leaves)])


def dense_jacobian(names: tuple[str, ...], single: bool, value: PyTree, rows: dict) -> PyTree:
    """:func:`joined` of :func:`jacrev_layout` of each name's ``rows``, traced by JAX
    (``single``: :func:`~daskdag.model.request.one_input`)."""
    jacs = {i: jacrev_layout(value, rows[i]) for i in names}
    return jacs[names[0]] if single else by_output(value, jacs)


def dense_jacobian_of_columns(names: tuple[str, ...], single: bool, templates: tuple,
                              value: PyTree, columns: tuple) -> PyTree:
    """:func:`dense_jacobian` of a forward pass's ``columns`` (its tangent's leaves, each
    ``(inputs' elements, *leaf shape)``); ``templates``: each name's :func:`row_template`,
    flattened (``(treedef, leaves)``)."""
    widths = [sum(int(np.prod(leaf.shape)) for leaf in leaves if leaf is not None)
              for _, leaves in templates]
    if columns:
        full = jnp.concatenate([c.reshape(c.shape[0], -1) for c in columns], axis=-1).T
    else:  # (no tangent reached the output: it reads none of the inputs, or has no float leaf)
        leaves = differentiable_leaves(value)
        full = jnp.zeros((sum(int(np.prod(np.shape(leaf))) for leaf in leaves), sum(widths)),
                         float_type(value))
    rows = {i: stacked_rows(full[:, s], treedef.unflatten(leaves))
            for i, (treedef, leaves), s in zip(names, templates, _spans(widths))}
    return dense_jacobian(names, single, value, rows)


def to_jax(a: np.ndarray) -> jax.Array:
    """A JAX array of ``a`` (never changed after): a large one's buffer taken where JAX can,
    a small one copied by the cheaper ``jnp.asarray``."""
    return jax.device_put(a, may_alias=True) if a.nbytes > 2 ** 16 else jnp.asarray(a)


def jacrev_layout(value: PyTree, rows: PyTree, items: bool = False) -> PyTree:
    """One output's Jacobian for one input, laid out as ``jax.jacrev`` does, from its rows (the
    input's structure, each differentiable leaf stacked over the output's elements, ``None``
    elsewhere): JAX arrays, each made once from NumPy slices (each slice in JAX would be an op
    dispatched). ``items``: a sweep's, with a leading axis of items, kept as they come."""
    lead = 1 if items else 0
    in_leaves, in_def = jax.tree.flatten(rows, is_leaf=lambda leaf: leaf is None)
    if not items and not any(isinstance(leaf, jax.core.Tracer) for leaf in in_leaves):
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
        per_leaf.append(in_def.unflatten([  # (a shape as one tuple: a scalar's is empty)
            None if r is None else _made(r[(slice(None),) * lead + (slice(start, start + n),)]
                                         .reshape((*shape, *r.shape[lead + 1:])), items)
            for r in in_leaves]))
        start += n
    return out_def.unflatten(per_leaf)


def _made(a, items: bool):
    return a if items or isinstance(a, jax.core.Tracer) else to_jax(a)
