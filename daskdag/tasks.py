"""The functions Dask runs: one forward task per node, one backward task per (output, node).

Each wraps a failure in :class:`~daskdag.errors.NodeError` naming the node.
"""

from __future__ import annotations

import multiprocessing
import threading
from functools import reduce

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import treedef_is_leaf

from .chunked import chunk_of
from .errors import NodeError
from .pullback import is_differentiable, is_numeric, linearize
from .spec import Node


def forward(name: str, node: Node, active: tuple[bool, ...], *args):
    """Primal of ``node`` alone when no dep is ``active``; else ``(primal, Pullback)``."""
    try:
        if not any(active):
            out = primal = node.callable()(*args)
        else:
            chunk = chunk_of(node)  # (a sweep's chunk: one vjp per item)
            out = chunk.linearize(args, active) if chunk else linearize(node, args, active)
            primal = out[0]
    except _RAISED as e:
        if _may_be_ctrl_c(e):  # it must interrupt as one
            raise
        raise NodeError(name, "forward", e) from e
    if primal is None:  # None is an empty pytree to JAX: it would fail later, far from here
        raise NodeError(name, "forward", TypeError(
            "its function returned None; a node must return its value, a JAX array or a pytree "
            "of arrays (is a `return` missing?)"))
    return out


def backward(name: str, positions: tuple, n_deps: int, pullback, *args):
    """Pull the cotangent of node ``name`` back to its deps.

    ``args`` are the node's ``n_deps`` dep values (a pullback that moved takes its input
    residuals from them), then the sources of its cotangent, the sum of its shares
    ``sources[k][positions[k]]``: ``sources[k]`` is what a consumer on the path to the output
    pulled back, ``positions[k]`` this node's place among that consumer's deps. For the output
    itself the one source is the seed, at position ``None``.
    """
    inputs, sources = args[:n_deps], args[n_deps:]
    ct = total(s if i is None else s[i] for s, i in zip(sources, positions))
    try:
        return pullback(ct, inputs)
    except _RAISED as e:
        if _may_be_ctrl_c(e):  # it must interrupt as one
            raise
        raise NodeError(name, "backward", e) from e


# A node raising KeyboardInterrupt or SystemExit is a failing node, not a reason to stop the
# process that runs it: a distributed worker dies of it, and Dask retries on the next worker.
_RAISED = (Exception, KeyboardInterrupt, SystemExit)


def _may_be_ctrl_c(e: BaseException) -> bool:
    """Python raises Ctrl-C's KeyboardInterrupt in the main thread of the user's process, where
    nodes run only on Dask's synchronous scheduler; elsewhere a KeyboardInterrupt is the node's."""
    return (isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread()
            and multiprocessing.parent_process() is None)


def gradient(positions: tuple, x, *sources):
    """An input's gradient, shaped like ``x``: the sum of its shares on its differentiable leaves
    (zeros when the output does not use it), ``None`` on the leaves held constant."""
    leaves, treedef = jax.tree.flatten(x)
    flat = iter(total(s[i] for s, i in zip(sources, positions)) if sources else
                [jnp.zeros_like(leaf) for leaf in leaves if is_differentiable(leaf)])
    return treedef.unflatten([next(flat) if is_differentiable(leaf) else None for leaf in leaves])


def seed(output: str, primal, ct, batched: bool = False) -> tuple:
    """The cotangent an output starts from: 1 for a real scalar, else the user's ``ct``, as a
    flat tuple over the output's differentiable leaves (see :mod:`daskdag.pullback`).

    ``ct`` has the output's structure (``None`` allowed where a leaf is held constant).
    ``batched``: the output carries a leading item axis (a sweep's chunk); ``ct`` and the checks
    are for one item, and the seed is broadcast over the items.
    """
    leaves, treedef = jax.tree.flatten(primal)
    item = [jax.ShapeDtypeStruct(jnp.shape(p)[1:] if batched else jnp.shape(p), jnp.result_type(p))
            if is_differentiable(p) else None for p in leaves]
    if ct is None:
        if not (treedef.num_leaves == 1 and treedef_is_leaf(treedef) and item[0] is not None
                and item[0].shape == () and jnp.issubdtype(item[0].dtype, jnp.floating)):
            raise ValueError(f"output {output!r} is not a real scalar: it is "
                             f"{_describe(primal, batched)}; pass cotangents={{{output!r}: ct}} "
                             f"with ct shaped like it")
        return (jnp.ones_like(leaves[0]),)
    ct_leaves, ct_def = jax.tree.flatten(ct, is_leaf=lambda c: c is None)
    if ct_def != jax.tree.structure(primal, is_leaf=lambda c: c is None) or any(
            i is not None and jnp.shape(c) != i.shape for c, i in zip(ct_leaves, item)):
        raise ValueError(f"cotangent for output {output!r} is {_describe(ct)}, "
                         f"but the output is {_describe(primal, batched)}")
    seeds = []
    for c, i, p in zip(ct_leaves, item, leaves):
        if i is None:  # a leaf held constant carries no cotangent
            continue
        if jnp.iscomplexobj(c) and not jnp.issubdtype(i.dtype, jnp.complexfloating):
            raise ValueError(f"cotangent for output {output!r} is complex, but the output is real "
                             f"({i.dtype}): its imaginary part would be dropped")
        c = jnp.asarray(c, i.dtype)
        seeds.append(np.broadcast_to(c, jnp.shape(p)) if batched else c)
    return tuple(seeds)


def total(cts):
    """Sum cotangents (flat tuples, one array per differentiable leaf)."""
    return reduce(lambda a, b: tuple(x + y for x, y in zip(a, b)), cts)


def _describe(tree, batched: bool = False) -> str:
    def shape(leaf):
        return tuple(jnp.shape(leaf)[1:] if batched else jnp.shape(leaf))

    def one(leaf):
        return f"{jnp.result_type(leaf)}{list(shape(leaf))}" if is_numeric(leaf) else type(leaf).__name__

    if is_numeric(tree):
        return f"an array of shape {shape(tree)} and dtype {jnp.result_type(tree)}"
    return str(jax.tree.map(one, tree))
