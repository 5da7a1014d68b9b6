"""Which leaves of a value are differentiated: as ``equinox.filter_vjp`` does, its
floating-point and complex arrays and Python floats; other leaves are held constant. A value's
cotangent (or tangent) is a flat tuple, one array per differentiable leaf in ``jax.tree.leaves``
order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

ARRAYS = (jax.Array, np.ndarray)
PyTree: TypeAlias = Any  # (the public API's annotations name pytrees so)


def is_differentiable(leaf) -> bool:
    """A floating-point or complex array (NumPy, JAX or dask) or scalar: differentiated."""
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


def as_numpy(tree):
    """``tree`` with its JAX array leaves as NumPy arrays (zero-copy on the CPU)."""
    return jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, tree)


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
