"""Which leaves of a value are differentiated: as ``equinox.filter_vjp`` does, a value's
floating-point (and complex) arrays and Python floats; every other leaf (integers, booleans,
functions, static fields) is held constant.

A value's *cotangent* (and *tangent*) is therefore a flat tuple with one array per
differentiable leaf, in ``jax.tree.leaves`` order; no pytree structure travels with it.
"""

from __future__ import annotations

from typing import Any, Callable, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

ARRAYS = (jax.Array, np.ndarray)
# A pytree (nested dicts, lists, tuples, dataclasses... of arrays and scalars), as the public
# API's annotations name it: any object to a type checker.
PyTree: TypeAlias = Any


def is_differentiable(leaf) -> bool:
    """A floating-point or complex array (or Python/NumPy float; or a lazy array, a dask
    array, not computed yet): differentiated, not held."""
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or hasattr(leaf, "chunks"):
        return jnp.issubdtype(leaf.dtype, jnp.inexact)
    return isinstance(leaf, (float, complex))


def is_array(leaf) -> bool:
    """A JAX or NumPy array: a leaf that can carry a sweep's item axis."""
    return isinstance(leaf, (jax.Array, np.ndarray))


def is_numeric(leaf) -> bool:
    """An array or a number: a leaf JAX can trace (others are functions, strings...)."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex))


def partition(tree, kind: Callable[[Any], int], kinds: int = 2) -> tuple[list[list], Callable]:
    """``tree``'s leaves in ``kinds`` groups, by ``kind(leaf)`` (0, 1, ...), and
    ``combine(*groups)``, the tree again from groups like them: equinox's ``partition`` and
    ``combine``, on flat groups. An array is its own one leaf (no pytree walk)."""
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


def as_numpy(tree):
    """``tree`` with its JAX array leaves as NumPy arrays (zero-copy on the CPU)."""
    return jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, tree)


def describe(tree, batched: bool = False) -> str:
    """``tree`` in a few words for an error: its shape and dtype, or those of each leaf
    (``batched``: less the leading item axis)."""
    def shape(leaf):
        return tuple(jnp.shape(leaf)[1:] if batched else jnp.shape(leaf))

    def one(leaf):
        return f"{jnp.result_type(leaf)}{list(shape(leaf))}" if is_numeric(leaf) else type(leaf).__name__

    if is_numeric(tree):
        return f"an array of shape {shape(tree)} and dtype {jnp.result_type(tree)}"
    return str(jax.tree.map(one, tree))
