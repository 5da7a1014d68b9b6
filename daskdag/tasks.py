"""The functions Dask runs: one forward task per node, one backward task per (output, node).

Each wraps a failure in :class:`~daskdag.errors.NodeError` naming the node.
"""

from __future__ import annotations

from functools import reduce

import jax
import jax.numpy as jnp
import numpy as np

from .errors import NodeError
from .pullback import cotangent_aval, linearize
from .spec import Node


def forward(name: str, node: Node, active: tuple[bool, ...], *args):
    """Primal of ``node`` alone when no dep is ``active``; else ``(primal, Pullback)``."""
    try:
        if any(active):
            return linearize(node, args, active)
        return node.callable()(*args)
    except Exception as e:
        raise NodeError(name, "forward", e) from e


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
    except Exception as e:
        raise NodeError(name, "backward", e) from e


def gradient(positions: tuple, x, *sources):
    """An input's gradient: the sum of its shares, or zeros when the output does not use it."""
    return total(s[i] for s, i in zip(sources, positions)) if sources else jax.tree.map(jnp.zeros_like, x)


def seed(output: str, primal, ct):
    """The cotangent an output starts from: 1 for a real scalar, else the user's ``ct``."""
    if ct is None:
        if not (jax.tree_util.treedef_is_leaf(jax.tree.structure(primal)) and jnp.ndim(primal) == 0
                and jnp.issubdtype(jnp.result_type(primal), jnp.floating)):
            raise ValueError(f"output {output!r} is not a real scalar: it is {_describe(primal)}; "
                             f"pass cotangents={{{output!r}: ct}} with ct shaped like it")
        return jnp.ones_like(primal)
    if jax.tree.structure(ct) != jax.tree.structure(primal) or any(
            jnp.shape(c) != jnp.shape(p) for c, p in zip(jax.tree.leaves(ct), jax.tree.leaves(primal))):
        raise ValueError(f"cotangent for output {output!r} is {_describe(ct)}, "
                         f"but the output is {_describe(primal)}")
    return jax.tree.map(_cotangent_like, ct, primal)


def total(cts):
    """Sum cotangent pytrees. ``float0`` leaves (of integer primals) are zeros: keep one."""
    return reduce(lambda a, b: jax.tree.map(_add, a, b), cts)


def _add(a, b):
    return a if getattr(a, "dtype", None) == jax.dtypes.float0 else a + b


def _cotangent_like(ct, primal):
    aval = cotangent_aval(primal)
    if aval.dtype == jax.dtypes.float0:  # integer leaves carry no cotangent
        return np.zeros(aval.shape, aval.dtype)
    return jnp.asarray(ct, aval.dtype)


def _describe(tree) -> str:
    shapes = jax.tree.map(lambda l: f"{jnp.result_type(l)}{list(jnp.shape(l))}", tree)
    return str(shapes) if not jax.tree_util.treedef_is_leaf(jax.tree.structure(tree)) else \
        f"an array of shape {jnp.shape(tree)} and dtype {jnp.result_type(tree)}"
