"""The shapes of a DAG's values, found without running a node on data.

In:  a spec, the names wanted, the inputs' values (or one item's shapes), and how to call a node.
Out: ``{name: ShapeDtypeStruct tree}``; :data:`UNKNOWN` where a node cannot be traced abstractly.

Each node is traced with ``jax.eval_shape`` on its deps' shapes: its Python code runs once on
abstract values (no arithmetic; a ``jit=True`` node's trace is the one its call reuses).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.model.leaves import is_numeric
from daskdag.model.spec import Node, Spec

UNKNOWN = object()  # a node that could not be traced abstractly, or one downstream of it


def abstract_values(spec: Spec, names, avals: dict, call: Callable[[Node], Callable] = Node.callable
                    ) -> dict[str, Any]:
    """``avals`` (the inputs' shapes, :func:`abstract`) with the shapes of the nodes ``names``
    (each after its deps) added: ``jax.eval_shape`` of ``call(node)`` on its deps' shapes, or
    :data:`UNKNOWN`."""
    avals = dict(avals)
    for n in names:
        node = spec.nodes[n]
        deps = [avals[d] for d in node.deps]
        avals[n] = UNKNOWN if any(d is UNKNOWN for d in deps) else eval_shape(call(node), deps)
    return avals


def abstract(value, batched: bool = False):
    """The shapes of ``value`` (of one item of it, ``batched``: without the leading item axis);
    leaves that are not arrays stay as they are."""
    def leaf(a):
        if not is_numeric(a):
            return a
        shape = np.shape(a)
        return jax.ShapeDtypeStruct(shape[1:] if batched else shape, jnp.result_type(a))

    return jax.tree.map(leaf, value)


def eval_shape(fn, args) -> Any:
    """``jax.eval_shape(fn, *args)`` over the array leaves of ``args``, the others held as they
    are; :data:`UNKNOWN` when ``fn`` cannot run on abstract values."""
    leaves, tree = jax.tree.flatten(args)
    at = [k for k, a in enumerate(leaves) if isinstance(a, jax.ShapeDtypeStruct)]

    def on_arrays(*arrays):
        full = list(leaves)
        for k, a in zip(at, arrays):
            full[k] = a
        return fn(*jax.tree.unflatten(tree, full))

    try:
        return jax.eval_shape(on_arrays, *(leaves[k] for k in at))
    except Exception:  # e.g. a TracerBoolConversionError from `if` on a value
        return UNKNOWN


def signature(value) -> tuple:
    """What a call's preparation may depend on in an input, as a hashable key: its pytree
    structure and, per leaf, the shape and JAX dtype of an array, NumPy's or JAX's (a JAX
    array's weak type too), the value of an integer, boolean or string (held constant, it may set a shape), the
    type of a float (differentiated: its value changes nothing prepared), and any other object
    itself (a function held constant: by its equality, which for a function is identity)."""
    leaves, treedef = jax.tree.flatten(value)
    return treedef, tuple(map(_leaf_signature, leaves))


def _leaf_signature(leaf) -> tuple:
    # (A NumPy array and a JAX array of one shape and JAX dtype are alike to every node.)
    if isinstance(leaf, jax.Array):
        return jax.Array, leaf.shape, leaf.dtype, leaf.weak_type
    if isinstance(leaf, np.ndarray) and not leaf.dtype.hasobject:
        return jax.Array, leaf.shape, jax.dtypes.canonicalize_dtype(leaf.dtype), False
    kind = type(leaf)
    if kind in (float, complex) or (isinstance(leaf, np.generic) and
                                    np.issubdtype(leaf.dtype, np.inexact)):
        return (kind,)
    try:  # (the object itself, not its id: the key keeps it, so no other object can match)
        hash(leaf)
    except TypeError:
        return kind, id(leaf)
    return kind, leaf
