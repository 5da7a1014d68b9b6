"""The shapes of a DAG's values, found without running a node on data: each node traced on its
deps' shapes (its Python code run once on abstract values); :data:`UNKNOWN` where it cannot be.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.model.leaves import is_numeric
from daskdag.model.spec import Node, Spec

UNKNOWN = object()  # a node that could not be traced abstractly, or one downstream of it


@dataclass(frozen=True)
class Traced:
    """A node traced on its deps' shapes: its ``jaxpr`` (a ``ClosedJaxpr``), whose inputs are the
    array leaves of its deps in order, and per input the position of its dep (``deps``)."""

    jaxpr: Any
    deps: tuple[int, ...]


def abstract_values(spec: Spec, names, avals: dict,
                    call: Callable[[Node], Callable] = Node.callable,
                    traces: dict[str, Traced] | None = None) -> dict[str, Any]:
    """``avals`` (the inputs' shapes, :func:`abstract`) with the shapes of the nodes ``names``
    (each after its deps) added: ``jax.eval_shape`` of ``call(node)`` on its deps' shapes, or
    :data:`UNKNOWN`. ``traces``, when given, gets each traced node's :class:`Traced` (from the
    same trace)."""
    avals = dict(avals)
    for n in names:
        node = spec.nodes[n]
        deps = [avals[d] for d in node.deps]
        if any(d is UNKNOWN for d in deps):
            avals[n] = UNKNOWN
            continue
        avals[n], traced = trace(call(node), deps, jaxpr=traces is not None)
        if traces is not None and traced is not None:
            traces[n] = traced
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


def trace(fn, args, jaxpr: bool = False) -> tuple[Any, Traced | None]:
    """``(jax.eval_shape(fn, *args), None)`` over the array leaves of ``args``, the others held
    as they are; with ``jaxpr``, the same trace as a :class:`Traced` instead of None.
    ``(UNKNOWN, None)`` when ``fn`` cannot run on abstract values."""
    leaves, tree = jax.tree.flatten(args)
    at = [k for k, a in enumerate(leaves) if isinstance(a, jax.ShapeDtypeStruct)]

    def on_arrays(*arrays):
        full = list(leaves)
        for k, a in zip(at, arrays):
            full[k] = a
        return fn(*jax.tree.unflatten(tree, full))

    arrays = [leaves[k] for k in at]
    try:
        if not jaxpr:
            return jax.eval_shape(on_arrays, *arrays), None
        closed, out = jax.make_jaxpr(on_arrays, return_shape=True)(*arrays)
    except Exception:  # e.g. a TracerBoolConversionError from `if` on a value
        return UNKNOWN, None
    owner = [d for d, arg in enumerate(args) for _ in jax.tree.leaves(arg)]
    return out, Traced(closed, tuple(owner[k] for k in at))


def signature(value) -> tuple:
    """What a call's preparation may depend on in an input, as a hashable key: its pytree
    structure and per leaf: an array's shape and JAX dtype (and weak type); an integer's,
    boolean's or string's value (it may set a shape); a float's type (its value changes nothing
    prepared); any other object itself (by equality)."""
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
