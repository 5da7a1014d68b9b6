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

from .chunked import Chunked
from .errors import NodeError
from .pullback import cotangent_aval, linearize
from .spec import Node


def forward(name: str, node: Node, active: tuple[bool, ...], *args):
    """Primal of ``node`` alone when no dep is ``active``; else ``(primal, Pullback)``."""
    try:
        if not any(active):
            out = primal = node.callable()(*args)
        else:  # (a sweep's chunk: one vjp per item)
            out = node.fn.linearize(args, active) if isinstance(node.fn, Chunked) else linearize(node, args, active)
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
    """An input's gradient: the sum of its shares, or zeros when the output does not use it."""
    return total(s[i] for s, i in zip(sources, positions)) if sources else jax.tree.map(jnp.zeros_like, x)


def seed(output: str, primal, ct, batched: bool = False):
    """The cotangent an output starts from: 1 for a real scalar, else the user's ``ct``.

    ``batched``: the output carries a leading item axis (a sweep's chunk); ``ct`` and the checks
    are for one item, and the seed is broadcast over the items.
    """
    item = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p)[1:] if batched else jnp.shape(p),
                                                       jnp.result_type(p)), primal)
    if ct is None:
        if not (jax.tree_util.treedef_is_leaf(jax.tree.structure(item)) and item.shape == ()
                and jnp.issubdtype(item.dtype, jnp.floating)):
            raise ValueError(f"output {output!r} is not a real scalar: it is {_describe(item)}; "
                             f"pass cotangents={{{output!r}: ct}} with ct shaped like it")
        return jnp.ones_like(primal)
    if jax.tree.structure(ct) != jax.tree.structure(item) or any(
            jnp.shape(c) != i.shape for c, i in zip(jax.tree.leaves(ct), jax.tree.leaves(item))):
        ct_avals = jax.tree.map(lambda c: jax.ShapeDtypeStruct(jnp.shape(c), jnp.result_type(c)), ct)
        raise ValueError(f"cotangent for output {output!r} is {_describe(ct_avals)}, "
                         f"but the output is {_describe(item)}")
    for c, i in zip(jax.tree.leaves(ct), jax.tree.leaves(item)):
        if jnp.iscomplexobj(c) and not jnp.issubdtype(i.dtype, jnp.complexfloating):
            raise ValueError(f"cotangent for output {output!r} is complex ({jnp.result_type(c)}), "
                             f"but the output is real ({_describe(item)}): its imaginary part "
                             f"would be dropped; pass a real cotangent")
    ct = jax.tree.map(_cotangent_like, ct, item)
    return jax.tree.map(lambda c, p: np.broadcast_to(c, jnp.shape(p)), ct, primal) if batched else ct


def total(cts):
    """Sum cotangent pytrees. ``float0`` leaves (of integer primals) are zeros: keep one."""
    return reduce(lambda a, b: jax.tree.map(_add, a, b), cts)


def _add(a, b):
    return a if getattr(a, "dtype", None) == jax.dtypes.float0 else a + b


def _cotangent_like(ct, item: jax.ShapeDtypeStruct):
    aval = cotangent_aval(item)
    if aval.dtype == jax.dtypes.float0:  # integer leaves carry no cotangent
        return np.zeros(aval.shape, aval.dtype)
    return jnp.asarray(ct, aval.dtype)


def _describe(avals) -> str:
    if jax.tree_util.treedef_is_leaf(jax.tree.structure(avals)):
        return f"an array of shape {avals.shape} and dtype {avals.dtype}"
    return str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", avals))
