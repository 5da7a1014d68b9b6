"""A node over a chunk of sweep items (:class:`Chunked`), registered with
:func:`daskdag.rules.vjp.register` so the core runs it as any node.

``Node(vmap=True)`` nodes run once per chunk as ``jax.jit(jax.vmap(fn))``; the others item by
item, each under its own ``jax.vjp``, with a :func:`~daskdag.sweeps.progress.checkpoint` between
items. An item that fails there is kept with its chunk: its value is :data:`SKIPPED`, which
later nodes pass on, its cotangents are zeros. A ``vmap`` node fills the failed items' rows with
another item's values.
"""

from __future__ import annotations

import contextlib
from functools import cached_property
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.cancel import Cancelled
from daskdag.errors import NodeError, node_errors
from daskdag.graph.compiled import Jitted
from daskdag.model.leaves import differentiable_leaves, is_array
from daskdag.model.spec import Node, is_custom
from daskdag.rules.vjp import PerItem, Pullback, basis, basis_rows, linearizer, register, seed
from daskdag.sweeps.progress import NothingLeft, checkpoint, fail, failed_already
from daskdag.transport.packing import unwrap
from daskdag.transport.protocol import travels, tree_size


class Skipped:
    """The value of an item that failed in this chunk (:data:`SKIPPED`, the one instance)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SKIPPED"

    def __reduce__(self):
        return "SKIPPED"  # pickled as a reference to the one instance


SKIPPED = Skipped()


class Chunked:
    """A node's function over a chunk of items: args whose ``in_axes`` is 0 carry them (stacked,
    or as :class:`Items`), the others are shared. ``name`` (the node's or the fused stage's)
    names an item's failure."""

    def __init__(self, node: Node, in_axes: tuple[int | None, ...], name: str | None = None):
        self.node, self.in_axes, self.name = node, in_axes, name

    @cached_property
    def compiled(self) -> Jitted:
        return Jitted(self.node.fn, self.in_axes)

    def __call__(self, *args):
        if self.node.vmap:
            args, _ = self._stacked(args)
            if is_custom(self.node.fn):  # the user's own code takes the stacked chunk
                return self.node.callable()(*args)
            return self.compiled(*args)
        fn = self.node.callable()
        return Items(self._per_item(args, lambda item: fn(*item)))

    def _stacked(self, args: Sequence[Any]) -> tuple[tuple, tuple]:
        """The args stacked (:func:`_left` first), and their :func:`_layout`."""
        _left(args, self.in_axes)
        return tuple(map(stacked, args)), _layout(args)

    def _per_item(self, args: Sequence[Any], call) -> list:
        """``call(item's args)`` for each item, or :data:`SKIPPED` (:func:`_attempt`), with a
        :func:`~daskdag.sweeps.progress.checkpoint` after each."""
        return [_then_checkpoint(_attempt(self.name, i, item, "forward",
                                          lambda: call(item)))  # noqa: B023 (called here)
                for i, item in enumerate(item_args(args, self.in_axes))]

    def linearize(self, args: Sequence[Any], active: tuple[bool, ...]):
        """``(primal, pullback)``: with ``vmap`` the primal stacked, else one ``jax.vjp`` per
        item and the primal as :class:`Items`."""
        if self.node.vmap:
            args, layout = self._stacked(args)
            run = linearizer(self.node) if is_custom(self.node.fn) else self.compiled.linearize
            primal, pullback = run(args, active)
            return primal, (pullback if not any(layout) else _ForItems(pullback, layout))
        run = linearizer(self.node)
        done = self._per_item(args, lambda item: run(item, active))
        primals = [SKIPPED if d is SKIPPED else d[0] for d in done]
        pullbacks = [None if d is SKIPPED else d[1] for d in done]
        return Items(primals), ItemPullbacks(pullbacks, self.in_axes, active, self.name,
                                             [len(differentiable_leaves(p)) for p in primals])

    def linearize_values(self, args: Sequence[Any], active: tuple[bool, ...], count: int):
        """:meth:`linearize` of an item-by-item function returning ``count`` values (a chain of
        nodes as one): ``(values, pullback)``, an :class:`Items` per value, the pullback taking
        their cotangents value by value (:class:`_ByValue`)."""
        primals, pullback = self.linearize(args, active)
        values = tuple(Items(SKIPPED if p is SKIPPED else p[e] for p in primals)
                       for e in range(count))
        one = next((p for p in primals if p is not SKIPPED), None)
        leaves = [0 if one is None else len(differentiable_leaves(one[e])) for e in range(count)]
        return values, _ByValue(pullback, leaves, [p is not SKIPPED for p in primals])

    def gradients(self, args: Sequence[Any], active: tuple[bool, ...], seeded: tuple):
        """:meth:`~daskdag.graph.compiled.Jitted.gradients` over the chunk, the cotangents of
        :class:`Items` args per item; None where it cannot be compiled."""
        args, layout = self._stacked(args)
        out = self.compiled.gradients(args, active, seeded)
        if out is None:
            return None
        primal, cts = out
        return primal, [per_item(c, layout) for c in cts]


def _batch(fn, in_axes, vectorized: bool) -> Chunked:
    """A fused stage's function (:class:`daskdag.graph.tasks.Fused`) over a chunk."""
    stage = getattr(fn, "stage", None)
    return Chunked(Node(fn, (), vmap=vectorized), in_axes, getattr(stage, "name", None))


register(Chunked, linearize=lambda chunked, node, args, active: chunked.linearize(args, active),
         element=lambda chunked: (chunked.node, chunked.in_axes), batch=_batch)


def chunk_of(node: Node) -> Chunked | None:
    """The :class:`Chunked` function of a sweep's node (maybe packed), else None."""
    fn = unwrap(node.fn)
    return fn if isinstance(fn, Chunked) else None


def own_function(node: Node):
    """A sweep node's function for one item (not over a chunk)."""
    chunk = chunk_of(node)
    return (chunk.node if chunk else node).callable()


def _attempt(name: str | None, index: int, args: tuple, phase: str, call):
    """``call()``, item ``index``'s pass of a node, or :data:`SKIPPED` where the item failed
    already, an arg is :data:`SKIPPED`, or it fails now and its chunk keeps it (with no chunk,
    it raises)."""
    if failed_already(index) or any(a is SKIPPED for a in args):
        return SKIPPED
    try:
        with node_errors(name, phase) if name is not None else contextlib.nullcontext():
            return call()
    except NodeError as e:
        if isinstance(e.original, Cancelled) or not fail(index, e):
            raise
        return SKIPPED


def _left(args, in_axes) -> None:
    """Raise :class:`~daskdag.sweeps.progress.NothingLeft` where every item of the chunk failed
    before this node."""
    size = next((_count(a) for a, ax in zip(args, in_axes) if ax == 0), 0)
    if size and all(failed_already(k) for k in range(size)):
        raise NothingLeft("every item of the chunk failed before this node")


def _count(arg) -> int:
    if isinstance(arg, Items):
        return len(arg)
    return next((len(leaf) for leaf in jax.tree.leaves(arg) if is_array(leaf)), 0)


@travels(tree_size)
class Items(list):
    """A node's values over a chunk, one per item, as item-by-item nodes pass them on (stacking
    them at every node would cost a pass over the values). A pytree of the items, so its
    cotangent (a flat tuple) is each item's leaves in turn; :func:`stacked` stacks them."""


jax.tree_util.register_pytree_node(Items, lambda items: (list(items), None),
                                   lambda _, children: Items(children))


class Chunk(PerItem):
    """How a chunk seeds its outputs and gathers its gradients, :class:`Items` too: each item's
    seed (or a Jacobian's rows) in turn, none for the failed items; gradients stacked."""

    def seed(self, value, output: str, ct) -> tuple:
        if not isinstance(value, Items):
            return super().seed(value, output, ct)
        return tuple(leaf for one in value if one is not SKIPPED
                     for leaf in seed(one, output, ct))

    def basis(self, value, output: str, colours=None) -> tuple:
        if not isinstance(value, Items):
            return super().basis(value, output, colours)
        return tuple(leaf for one in value if one is not SKIPPED
                     for leaf in basis(output, one, colours))

    def rows(self, value, colours=None) -> int:
        if not isinstance(value, Items):
            return super().rows(value, colours)
        return next((basis_rows(one, colours) for one in value if one is not SKIPPED), 0)

    def gradient(self, value, grad, rows: bool):
        if not isinstance(value, Items):
            return super().gradient(value, grad, rows)
        return stacked(grad)


CHUNK = Chunk()


def stacked(value, numpy: bool = False):
    """``value`` with a leading item axis: :class:`Items` stacked, another item standing in
    for each failed one (:data:`SKIPPED`; its rows are dropped). ``numpy``: every leaf stacked
    as a NumPy array, numbers too (else JAX arrays, and the first item's other leaves)."""
    if not isinstance(value, Items):
        return value
    items = list(value)
    if any(v is SKIPPED for v in items):
        other = next((v for v in items if v is not SKIPPED), None)
        if other is None:
            raise NothingLeft("every item of the chunk failed")
        items = [other if v is SKIPPED else v for v in items]
    if numpy:
        return jax.tree.map(lambda *leaves: np.stack([np.asarray(a) for a in leaves]), *items)
    return stack(items)


def _layout(args) -> tuple:
    """Per arg: None where stacked; for :class:`Items`, per item whether it is not
    :data:`SKIPPED`."""
    return tuple(tuple(v is not SKIPPED for v in a) if isinstance(a, Items) else None
                 for a in args)


def per_item(cts: tuple, layout: tuple) -> tuple:
    """A pullback's cotangents of stacked args, as those of the args that came as
    :class:`Items` (``layout``: :func:`_layout`): each held item's leaves in turn."""
    return tuple(c if held is None or c is None else
                 tuple(leaf[i] for i, here in enumerate(held) if here for leaf in c)
                 for c, held in zip(cts, layout))


def _zeros(args: Sequence[Any], active: Sequence[bool]) -> tuple:
    """Zero cotangents of ``args``, as a pullback returns them (None for inactive args)."""
    return tuple(tuple(jnp.zeros_like(leaf) for leaf in differentiable_leaves(a)) if on else None
                 for a, on in zip(args, active))


class _Wrapper(Pullback):
    """A pullback around another (``self.pullback``), batched and sized as it is."""

    pullback: Pullback

    def residual_nbytes(self) -> int:
        return self.pullback.residual_nbytes()

    @property
    def batching(self):  # type: ignore[override]  # (a plain attribute in Pullback)
        return self.pullback.batching


class _ForItems(_Wrapper):
    """A vmap pullback whose args came as :class:`Items`: it gives their cotangents per item."""

    def __init__(self, pullback, layout: tuple):
        self.pullback, self.layout = pullback, layout

    def __call__(self, ct, inputs, dropped=None):
        return per_item(self.pullback(ct, tuple(map(stacked, inputs))), self.layout)

    def __reduce__(self):
        return _ForItems, (self.pullback, self.layout)


class ItemPullbacks(Pullback):
    """The pullbacks of a chunk's items (None for a failed item). ``ct``: each item's leaves in
    turn, ``counts[i]`` of them for item ``i``; it returns each dep's cotangent likewise where
    the dep came as :class:`Items`, else stacked. An item that failed (or fails here) gets
    zeros."""

    def __init__(self, pullbacks: list, in_axes: tuple[int | None, ...], active: tuple,
                 name: str | None, counts: list[int]):
        self.pullbacks, self.in_axes, self.active = pullbacks, in_axes, active
        self.name, self.counts = name, counts

    def __call__(self, ct, inputs, dropped=None):
        items = item_args(inputs, self.in_axes)
        at = np.cumsum([0, *self.counts])
        cts: list[tuple] = []
        ran: tuple | None = None  # an item whose pullback ran: which args get cotangents
        for i, (pb, item) in enumerate(zip(self.pullbacks, items)):
            out = SKIPPED if pb is None else _attempt(
                self.name, i, item, "backward",
                lambda: pb(tuple(ct[at[i]:at[i + 1]]), item))  # noqa: B023 (called here)
            one: tuple = _zeros(item, self.active) if isinstance(out, Skipped) else out
            if not isinstance(out, Skipped) and ran is None:
                ran = one
            cts.append(_then_checkpoint(one))
        # Differentiated deps all carry items (shared ones are broadcast).
        return tuple(None if c is None else
                     tuple(leaf for one in column for leaf in one) if isinstance(arg, Items) else
                     stack(list(column))
                     for c, column, arg in zip(cts[0] if ran is None else ran, zip(*cts), inputs))

    @property
    def batching(self):  # type: ignore[override]  # (a plain attribute in Pullback)
        return next((pb.batching for pb in self.pullbacks if pb is not None), None)

    def residual_nbytes(self) -> int:
        return sum(pb.residual_nbytes() for pb in self.pullbacks if pb is not None)

    def __reduce__(self):
        return ItemPullbacks, (self.pullbacks, self.in_axes, self.active, self.name, self.counts)


class _ByValue(_Wrapper):
    """An :class:`ItemPullbacks` of items that are each a tuple of values, taking its cotangent
    value by value (value 0's leaves for every item, then value 1's...; ``leaves``: per value,
    its differentiable leaves per item; ``held``: per item, whether it is not :data:`SKIPPED`)."""

    def __init__(self, pullback: ItemPullbacks, leaves: list[int], held: list[bool]):
        self.pullback, self.leaves, self.held = pullback, leaves, held

    def __call__(self, ct, inputs, dropped=None):
        n = sum(self.held)
        starts = np.cumsum([0] + [m * n for m in self.leaves])
        per_item = [leaf for k in range(n) for start, m in zip(starts, self.leaves)
                    for leaf in ct[start + k * m:start + (k + 1) * m]]
        return self.pullback(tuple(per_item), inputs)

    def __reduce__(self):
        return _ByValue, (self.pullback, self.leaves, self.held)


def _then_checkpoint(result):
    checkpoint()
    return result


def item_args(args, in_axes) -> list[tuple]:
    """Each item's args: those with ``in_axes`` 0 unstacked, the shared ones as they are."""
    columns = [unstack(a) if ax == 0 else None for a, ax in zip(args, in_axes)]
    size = len(next(c for c in columns if c is not None))
    return [tuple(a if c is None else c[i] for a, c in zip(args, columns)) for i in range(size)]


def unstack(tree) -> list:
    """A pytree whose array leaves carry a leading item axis as a list of per-item pytrees, its
    other leaves in every item."""
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
