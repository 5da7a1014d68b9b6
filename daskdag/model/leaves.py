"""A value's leaves: which are differentiated (as ``equinox.filter_vjp`` does, its
floating-point and complex arrays and Python floats; other leaves are held constant), and the
shapes of a DAG's values, found without running a node on data: each node traced on its deps'
shapes (its Python code run once on abstract values); :data:`UNKNOWN` where it cannot be. A
value's cotangent (or tangent) is a flat tuple, one array per differentiable leaf in
``jax.tree.leaves`` order."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.model.spec import Node, Spec

ARRAYS = (jax.Array, np.ndarray)
PyTree: TypeAlias = Any  # (the public API's annotations name pytrees so)


def is_differentiable(leaf) -> bool:
    """A floating-point or complex array (NumPy, JAX or dask) or scalar: differentiated."""
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or hasattr(leaf, "chunks"):
        return dtype_is(leaf.dtype, jnp.inexact)
    return isinstance(leaf, (float, complex))


@functools.lru_cache(maxsize=None)
def dtype_is(dtype, kind) -> bool:
    """``jnp.issubdtype(dtype, kind)`` (``kind``: ``jnp.inexact``, ``jnp.floating``...),
    remembered: it is asked of every leaf a call takes apart."""
    return bool(jnp.issubdtype(dtype, kind))


def is_array(leaf) -> bool:
    """A JAX or NumPy array: a leaf that can carry a sweep's item axis."""
    return isinstance(leaf, (jax.Array, np.ndarray))


def is_numeric(leaf) -> bool:
    """An array or a number: a leaf JAX can trace (others are functions, strings...)."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex))


def partition(tree, kind: Callable[[Any], int], kinds: int = 2) -> tuple[list[list], Callable]:
    """``tree``'s leaves in ``kinds`` groups by ``kind(leaf)`` (0, 1, ...), and
    ``combine(*groups)``, the tree again from such groups: equinox's ``partition`` and
    ``combine`` on flat groups. An array is its own one leaf (no pytree walk)."""
    leaves, treedef = ([tree], None) if isinstance(tree, ARRAYS) else jax.tree.flatten(tree)
    which = [kind(leaf) for leaf in leaves]
    groups: list[list] = [[] for _ in range(kinds)]
    for leaf, k in zip(leaves, which):
        groups[k].append(leaf)

    def combine(*parts):
        its = [iter(p) for p in parts]
        new = [next(its[k]) for k in which]
        return new[0] if treedef is None else treedef.unflatten(new)

    return groups, combine


def differentiable_leaves(tree) -> list:
    return [leaf for leaf in jax.tree.leaves(tree) if is_differentiable(leaf)]


def on_differentiable(like: PyTree, flat) -> PyTree:
    """``flat`` (one array per differentiable leaf of ``like``, in ``jax.tree.leaves`` order) in
    ``like``'s structure, ``None`` at the leaves held constant."""
    leaves, treedef = jax.tree.flatten(like)
    it = iter(flat)
    return treedef.unflatten([next(it) if is_differentiable(leaf) else None for leaf in leaves])


def describe(tree, batched: bool = False) -> str:
    """``tree`` in a few words for an error: its shape and dtype, or those of each leaf
    (``batched``: less the leading item axis)."""
    def shape(leaf):
        return tuple(jnp.shape(leaf)[1:] if batched else jnp.shape(leaf))

    def one(leaf):
        if is_numeric(leaf):
            return f"{jnp.result_type(leaf)}{list(shape(leaf))}"
        return type(leaf).__name__

    if is_numeric(tree):
        return f"an array of shape {shape(tree)} and dtype {jnp.result_type(tree)}"
    return str(jax.tree.map(one, tree))


UNKNOWN = object()  # a node that could not be traced abstractly, or one downstream of it


@dataclass(frozen=True)
class Traced:
    """A node traced on its deps' shapes: its ``jaxpr`` (a ``ClosedJaxpr``), whose inputs are the
    array leaves of its deps in order, and per input the position of its dep (``deps``)."""

    jaxpr: Any
    deps: tuple[int, ...]


def abstract_values(spec: Spec, names, avals: dict, call: Callable[[Node], Callable],
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
    return jax.tree.map(lambda a: aval(a, batched) if is_numeric(a) else a, value)


def aval(leaf, batched: bool = False) -> jax.ShapeDtypeStruct:
    """A numeric leaf's shape and JAX dtype (``batched``: less its leading item axis)."""
    shape = leaf.shape if isinstance(leaf, jax.Array) else np.shape(leaf)
    return jax.ShapeDtypeStruct(shape[1:] if batched else shape, dtype_of(leaf))


def dtype_of(leaf) -> np.dtype:
    """A numeric leaf's JAX dtype (``jnp.result_type``; a JAX array's own, at once)."""
    return leaf.dtype if isinstance(leaf, jax.Array) else jnp.result_type(leaf)


def zeros(value, k: int | None = None) -> tuple:
    """A zero tangent of ``value``, flat over its differentiable leaves (with ``k`` directions:
    each leaf's leading axis)."""
    lead = () if k is None else (k,)
    return tuple(zeros_of((*lead, *jnp.shape(leaf)), jnp.result_type(leaf))
                 for leaf in differentiable_leaves(value))


def zeros_of(shape: tuple, dtype) -> jax.Array:
    """``jnp.zeros(shape, dtype)``, as :func:`many_zeros` makes it."""
    return many_zeros([(shape, dtype)])[0]


def many_zeros(avals) -> tuple:
    """Zero arrays of these ``(shape, dtype)`` s, each its own buffer, on the default device, as
    one compiled program per list of shapes: one dispatch, and no value sent from the host
    (``jnp.zeros`` dispatches two ops and sends its fill value)."""
    return _zeros(tuple((tuple(shape), np.dtype(dtype)) for shape, dtype in avals))


_zeros = jax.jit(lambda avals: tuple(jnp.zeros(s, d) for s, d in avals), static_argnums=0)
#: ``jnp.ones_like`` and ``jnp.zeros_like`` as compiled programs: one dispatch, on the leaf's
#: device, and no value sent from the host.
ones_like = jax.jit(jnp.ones_like)
zeros_like = jax.jit(jnp.zeros_like)


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


def result_pytree(*children: str) -> Callable[[type], type]:
    """A class decorator: its instances (frozen dataclasses) are JAX pytrees whose children are
    the fields ``children`` (the arrays: ``jax.block_until_ready``, ``jax.tree.map`` and
    ``jax.device_get`` reach them) and whose auxiliary data is every other field (how the call
    was computed), kept as it is and compared by value."""

    def register(cls: type) -> type:
        rest = tuple(f.name for f in dataclasses.fields(cls) if f.name not in children)
        keys = tuple(jax.tree_util.GetAttrKey(name) for name in children)

        def flatten(obj):
            return ([getattr(obj, name) for name in children],
                    _Aux(tuple(getattr(obj, name) for name in rest)))

        def flatten_with_keys(obj):
            values, aux = flatten(obj)
            return list(zip(keys, values)), aux

        def unflatten(aux, values):
            return cls(**dict(zip(children, values)), **dict(zip(rest, aux.values)))

        jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
        return cls

    return register


@dataclass(frozen=True, eq=False)
class _Aux:
    """A result's fields that are not arrays, as a pytree's auxiliary data: equal when they are
    equal, hashed by what can be hashed (a dict of failed items cannot)."""

    values: tuple

    def __eq__(self, other) -> bool:
        return isinstance(other, _Aux) and self.values == other.values

    def __hash__(self) -> int:
        return hash(tuple(v for v in self.values if getattr(v, "__hash__", None) is not None))
