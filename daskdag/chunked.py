"""A node over a chunk of sweep items: its function, and its forward pass under ``jax.vjp``.

``Node(vmap=True)`` nodes run once per chunk under ``jax.vmap`` and are differentiated as one
function. The others run item by item, each item under its own ``jax.vjp`` (one vjp around the
whole loop was measured 2.3 to 2.5 times slower per item), leaving an :class:`ItemPullbacks`.
Between items they pass a :func:`~daskdag.progress.checkpoint`: progress, and where a cancelled
chunk stops.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .progress import checkpoint
from .pullback import linearize
from .shipping import unwrap
from .spec import Node


class Chunked:
    """A node's function over a chunk; args whose ``in_axes`` is 0 carry a leading item axis."""

    def __init__(self, node: Node, in_axes: tuple[int | None, ...]):
        self.node, self.in_axes = node, in_axes

    def __call__(self, *args):
        fn = self.node.callable()
        if self.node.vmap:
            return jax.vmap(fn, in_axes=self.in_axes)(*args)
        return stack([_then_checkpoint(fn(*item)) for item in item_args(args, self.in_axes)])

    def linearize(self, args: Sequence[Any], active: tuple[bool, ...]):
        """``(stacked primal, pullback)``: one ``jax.vjp`` per item unless ``vmap``."""
        if self.node.vmap:
            return linearize(Node(self, ()), args, active)
        primals, pullbacks = zip(*(_then_checkpoint(linearize(self.node, item, active))
                                   for item in item_args(args, self.in_axes)))
        return stack(primals), ItemPullbacks(list(pullbacks), self.in_axes)


def chunk_of(node: Node) -> Chunked | None:
    """The :class:`Chunked` function of a sweep's node (its function may travel packed), else None."""
    fn = unwrap(node.fn)
    return fn if isinstance(fn, Chunked) else None


class ItemPullbacks:
    """The pullbacks of a chunk's items. Call: ``(ct, inputs)`` as for a
    :class:`~daskdag.pullback.Pullback`, with ``ct`` and the batched inputs stacked over items."""

    def __init__(self, pullbacks: list, in_axes: tuple[int | None, ...]):
        self.pullbacks, self.in_axes = pullbacks, in_axes

    def __call__(self, ct, inputs):
        items = item_args(inputs, self.in_axes)
        cts = [_then_checkpoint(pb(c, item)) for pb, c, item in zip(self.pullbacks, unstack(ct), items)]
        # Differentiated deps all carry items (shared ones are broadcast), so their cts stack.
        return tuple(None if c is None else stack(list(column))
                     for c, column in zip(cts[0], zip(*cts)))

    def residual_nbytes(self) -> int:
        return sum(pb.residual_nbytes() for pb in self.pullbacks)

    def __reduce__(self):
        return ItemPullbacks, (self.pullbacks, self.in_axes)


def _then_checkpoint(result):
    checkpoint()
    return result


def item_args(args, in_axes) -> list[tuple]:
    """Each item's args: those with ``in_axes`` 0 unstacked, the shared ones as they are."""
    columns = [unstack(a) if ax == 0 else None for a, ax in zip(args, in_axes)]
    size = len(next(c for c in columns if c is not None))
    return [tuple(a if c is None else c[i] for a, c in zip(args, columns)) for i in range(size)]


def unstack(tree) -> list:
    """A pytree whose array leaves carry a leading item axis, as a list of per-item pytrees;
    other leaves (functions, static fields) are shared by every item."""
    leaves, treedef = jax.tree.flatten(tree)
    size = next(len(leaf) for leaf in leaves if _is_array(leaf))
    columns = [list(leaf) if _is_array(leaf) else [leaf] * size for leaf in leaves]
    return [jax.tree.unflatten(treedef, row) for row in zip(*columns)]


def stack(trees: Sequence) -> Any:
    """The inverse of :func:`unstack`."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves) if _is_array(leaves[0]) else leaves[0],
                        *trees)


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray))
