"""A node over a chunk of sweep items: its function, and its forward pass under ``jax.vjp``.

``Node(vmap=True)`` nodes run once per chunk as ``jax.jit(jax.vmap(fn))``: forward and
pullback are each one compiled program, cached per node function, so chunks of the same shapes
(and later sweeps of the same function) compile nothing. The others run item by item, each
item under its own ``jax.vjp`` (one vjp around the whole loop is slower per item, see the
sweep benchmarks), leaving an :class:`ItemPullbacks`. Between items they pass a
:func:`~daskdag.sweeps.progress.checkpoint`: progress, and where a cancelled chunk stops.

The compiled programs are :class:`~daskdag.graph.compiled.Compiled`'s, as for a fused stage
outside a sweep. A chunk's node kind is registered with :mod:`daskdag.rules.registry`, so the
core runs it as it runs any node, and fuses a sweep's stages over the items (``batch``).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.graph.compiled import Compiled
from daskdag.model.custom import is_custom
from daskdag.model.leaves import differentiable_leaves, is_array
from daskdag.model.spec import Node
from daskdag.rules.pullback import Pullback
from daskdag.rules.registry import linearizer, register
from daskdag.rules.seeds import as_gradient, seed
from daskdag.sweeps.progress import checkpoint
from daskdag.transport.packing import unwrap


class Chunked:
    """A node's function over a chunk of items: args whose ``in_axes`` is 0 carry them (stacked
    arrays, or :class:`Items` as item-by-item nodes made them), the others are shared."""

    def __init__(self, node: Node, in_axes: tuple[int | None, ...]):
        self.node, self.in_axes = node, in_axes

    @cached_property
    def compiled(self) -> Compiled:
        """The ``vmap`` node's programs (kept with this object, as its function's)."""
        return Compiled(self.node.fn, self.in_axes)

    def __call__(self, *args):
        if self.node.vmap:
            args = tuple(map(stacked, args))
            if is_custom(self.node.fn):  # the user's own code takes the chunk
                return self.node.callable()(*args)
            return self.compiled(*args)
        fn = self.node.callable()
        return Items(_then_checkpoint(fn(*item)) for item in item_args(args, self.in_axes))

    def linearize(self, args: Sequence[Any], active: tuple[bool, ...]):
        """``(primal, pullback)``: with ``vmap`` the primal stacked, else one ``jax.vjp`` per
        item and the primal as :class:`Items`."""
        if self.node.vmap:
            sizes = _sizes(args)
            args = tuple(map(stacked, args))
            if is_custom(self.node.fn):
                primal, pullback = linearizer(self.node)(args, active)
            else:
                primal, pullback = self.compiled.linearize(args, active)
            return primal, (pullback if not any(sizes) else _ForItems(pullback, sizes))
        run = linearizer(self.node)
        primals, pullbacks = zip(*(_then_checkpoint(run(item, active))
                                   for item in item_args(args, self.in_axes)))
        return Items(primals), ItemPullbacks(list(pullbacks), self.in_axes)

    def linearize_values(self, args: Sequence[Any], active: tuple[bool, ...], count: int):
        """:meth:`linearize` of an item-by-item function that returns a tuple of ``count``
        values (a chain of nodes as one function): ``(values, pullback)``, ``values`` a tuple of
        :class:`Items`, one per value; the pullback takes the cotangent of those (each value's
        in turn, each item's leaves in turn within it) and gives the args' as
        :class:`ItemPullbacks` does."""
        primals, pullback = self.linearize(args, active)
        values = tuple(Items(p[e] for p in primals) for e in range(count))
        leaves = [len(differentiable_leaves(v)) // max(len(primals), 1) for v in values]
        return values, _ByValue(pullback, leaves, len(primals))

    def gradients(self, args: Sequence[Any], active: tuple[bool, ...], seeded: tuple):
        """:meth:`~daskdag.graph.compiled.Compiled.gradients` over the chunk: the cotangents of
        args that came as :class:`Items` per item; None where it cannot be compiled."""
        sizes = _sizes(args)
        out = self.compiled.gradients(tuple(map(stacked, args)), active, seeded)
        if out is None:
            return None
        primal, cts = out
        return primal, [per_item(c, sizes) for c in cts]


register(Chunked, linearize=lambda chunked, node, args, active: chunked.linearize(args, active),
         element=lambda chunked: (chunked.node, chunked.in_axes),
         batch=lambda fn, in_axes, vectorized: Chunked(Node(fn, (), vmap=vectorized), in_axes))


def chunk_of(node: Node) -> Chunked | None:
    """The :class:`Chunked` function of a sweep's node (its function may travel packed), else None."""
    fn = unwrap(node.fn)
    return fn if isinstance(fn, Chunked) else None


class Items(list):
    """A node's values over a chunk, one per item, as the item-by-item nodes made them: they
    pass them on unstacked (stacking every node's values and splitting them again in the next
    node would cost every eager sweep a pass over its values). A pytree whose children are the items,
    so a cotangent of ``Items`` (a flat tuple, see :mod:`daskdag.rules.pullback`) is each item's
    cotangent in turn. :func:`stacked` makes one array per leaf, where one is needed."""


jax.tree_util.register_pytree_node(Items, lambda items: (list(items), None),
                                   lambda _, children: Items(children))


@seed.register(Items)
def _seed_items(primal: Items, output: str, ct, batched: bool = False) -> tuple:
    """Each item's seed in turn (``ct`` is one item's)."""
    return tuple(leaf for one in primal for leaf in seed(one, output, ct))


@as_gradient.register(Items)
def _gradient_items(value: Items, grad):
    return stacked(grad)


def stacked(value):
    """``value`` with a leading item axis on its array leaves: :class:`Items` stacked."""
    return stack(list(value)) if isinstance(value, Items) else value


def _sizes(args) -> tuple:
    """Per arg: its number of items if it is :class:`Items`, else None."""
    return tuple(len(a) if isinstance(a, Items) else None for a in args)


def per_item(cts: tuple, sizes: tuple) -> tuple:
    """Cotangents aligned with args (as a pullback returns them) for stacked args, made the
    cotangents of the args that came as :class:`Items` of ``sizes[i]`` items: each item's leaves
    in turn."""
    return tuple(c if n is None or c is None else tuple(leaf[i] for i in range(n) for leaf in c)
                 for c, n in zip(cts, sizes))


class _ForItems(Pullback):
    """A vmap pullback whose args came as :class:`Items` (stacked for its program): it takes
    them as they came and gives their cotangents per item (:func:`per_item`)."""

    def __init__(self, pullback, sizes: tuple):
        self.pullback, self.sizes = pullback, sizes

    @property
    def batching(self):  # type: ignore[override]  # (a plain attribute in Pullback)
        return self.pullback.batching

    def __call__(self, ct, inputs, dropped=None):
        return per_item(self.pullback(ct, tuple(map(stacked, inputs))), self.sizes)

    def residual_nbytes(self) -> int:
        return self.pullback.residual_nbytes()

    def __reduce__(self):
        return _ForItems, (self.pullback, self.sizes)


class ItemPullbacks(Pullback):
    """The pullbacks of a chunk's items. Call: ``(ct, inputs)`` as for a
    :class:`~daskdag.rules.pullback.Pullback`: ``ct`` the cotangent of the node's :class:`Items`
    (each item's leaves in turn); it returns, for each dep that came as ``Items``, its
    cotangent likewise, for the others (stacked) one stacked array per leaf."""

    def __init__(self, pullbacks: list, in_axes: tuple[int | None, ...]):
        self.pullbacks, self.in_axes = pullbacks, in_axes

    def __call__(self, ct, inputs, dropped=None):
        items = item_args(inputs, self.in_axes)
        per = len(ct) // len(self.pullbacks)  # leaves per item
        cts = [_then_checkpoint(pb(tuple(ct[i * per:(i + 1) * per]), item))
               for i, (pb, item) in enumerate(zip(self.pullbacks, items))]
        # Differentiated deps all carry items (shared ones are broadcast).
        return tuple(None if c is None else
                     tuple(leaf for one in column for leaf in one) if isinstance(arg, Items) else
                     stack(list(column))
                     for c, column, arg in zip(cts[0], zip(*cts), inputs))

    @property
    def batching(self):  # type: ignore[override]  # (a plain attribute in Pullback)
        """As its items' pullbacks (see :attr:`~daskdag.rules.pullback.Pullback.batching`)."""
        return self.pullbacks[0].batching if self.pullbacks else None

    def residual_nbytes(self) -> int:
        return sum(pb.residual_nbytes() for pb in self.pullbacks)

    def __reduce__(self):
        return ItemPullbacks, (self.pullbacks, self.in_axes)


class _ByValue(Pullback):
    """An :class:`ItemPullbacks` of items that are each a tuple of values, taking its cotangent
    value by value (``ct``: value 0's leaves for every item, then value 1's...; ``leaves``: per
    value, its differentiable leaves per item) and passing it on item by item."""

    def __init__(self, pullback: ItemPullbacks, leaves: list[int], items: int):
        self.pullback, self.leaves, self.items = pullback, leaves, items

    @property
    def batching(self):  # type: ignore[override]  # (a plain attribute in Pullback)
        return self.pullback.batching

    def __call__(self, ct, inputs, dropped=None):
        starts = np.cumsum([0] + [n * self.items for n in self.leaves])
        per_item = [leaf for i in range(self.items) for start, n in zip(starts, self.leaves)
                    for leaf in ct[start + i * n:start + (i + 1) * n]]
        return self.pullback(tuple(per_item), inputs)

    def residual_nbytes(self) -> int:
        return self.pullback.residual_nbytes()

    def __reduce__(self):
        return _ByValue, (self.pullback, self.leaves, self.items)


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
    other leaves (functions, static fields) are shared by every item. :class:`Items` as they
    are."""
    if isinstance(tree, Items):
        return list(tree)
    leaves, treedef = jax.tree.flatten(tree)
    size = next(len(leaf) for leaf in leaves if is_array(leaf))
    columns = [list(leaf) if is_array(leaf) else [leaf] * size for leaf in leaves]
    return [jax.tree.unflatten(treedef, row) for row in zip(*columns)]


def stack(trees: Sequence) -> Any:
    """The inverse of :func:`unstack`."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves) if is_array(leaves[0]) else leaves[0],
                        *trees)
