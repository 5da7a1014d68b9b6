"""A node over a chunk of sweep items: its function, and its forward pass under ``jax.vjp``.

``Node(vmap=True)`` nodes run once per chunk as ``jax.jit(jax.vmap(fn))``: forward and
pullback are each one compiled program, cached per node function, so chunks of the same shapes
(and later sweeps of the same function) compile nothing. The others run item by item, each
item under its own ``jax.vjp`` (one vjp around the whole loop was measured 2.3 to 2.5 times
slower per item), leaving an :class:`ItemPullbacks`. Between items they pass a
:func:`~daskdag.sweeps.progress.checkpoint`: progress, and where a cancelled chunk stops.

A ``Chunked`` whose ``in_axes`` carry no item axis is a fused stage outside a sweep
(:mod:`daskdag.graph.stages`): the same compiled programs, without ``vmap``. A third program,
:meth:`Chunked.gradients`, runs forward and backward as one, as ``jax.jit(jax.value_and_grad)``
does, for a stage whose cotangents are all its own outputs' seeds.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Sequence

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from daskdag.rules.custom import is_custom
from daskdag.sweeps.progress import checkpoint
from daskdag.rules.pullback import (LINEARIZERS, Pullback, by_arg, ct_avals, diff_counts,
                       differentiable_leaves, is_array, is_differentiable, is_numeric, linearize,
                       linearizer, vjp_leaves)
from daskdag.transport.packing import current, unwrap
from daskdag.model.spec import Node


class Chunked:
    """A node's function over a chunk; args whose ``in_axes`` is 0 carry a leading item axis."""

    def __init__(self, node: Node, in_axes: tuple[int | None, ...]):
        self.node, self.in_axes = node, in_axes

    def __call__(self, *args):
        fn = self.node.callable()
        if self.node.vmap:
            args = tuple(map(stacked, args))
            if is_custom(self.node.fn):  # the user's own code takes the chunk
                return fn(*args)
            compiled = self._compiled(args, None)
            return compiled if compiled is not None else _mapped(fn, self.in_axes)(*args)
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
                compiled = self._compiled(args, active)
                primal, pullback = (compiled if compiled is not None else
                                    linearize(Node(self, ()), args, active))
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
        """Forward and backward as one program: ``(primal, cts)``, or None where it cannot be
        compiled (see :meth:`_compiled`). The function returns a tuple of values;
        ``seeded[k][e]``: the ``k``-th backward pass starts from ones at value ``e`` (its
        differentiable leaves), from zeros elsewhere. ``cts[k]``: that pass's cotangents, a tuple
        aligned with ``args`` as a :class:`~daskdag.rules.pullback.Pullback` returns them."""
        sizes = _sizes(args)
        args = tuple(map(stacked, args))
        split = _split(args, active)
        if split is None:
            return None
        static, traced = split
        primal, flat = _programs(self)[3]((*static, self.in_axes, active, seeded), traced)
        counts = diff_counts(args, active)
        return primal, [per_item(by_arg(f, active, counts), sizes) for f in flat]

    def _compiled(self, args, active):
        """``jit(vmap(fn))(*args)``, or with ``active`` its ``(primal, Pullback)``; None where an
        arg holds a leaf that jit can take neither as an array nor as a hashable constant."""
        split = _split(args, active)
        if split is None:
            return None
        forward, backward, kept, _ = _programs(self)
        static, traced = (*split[0], self.in_axes, active), split[1]
        out = forward(static, traced)
        if active is None:
            return out
        primal, computed = out
        # The residuals that are inputs come back as the inputs themselves (jit would return
        # copies), so a pullback that moves does not ship them (see Pullback.portable).
        where, vjp_def = kept[static, tuple(map(jax.typeof, traced))]
        computed = iter(computed)
        vjp_fn = vjp_def.unflatten([next(computed) if i is None else traced[i] for i in where])
        pullback = Pullback(Node(self, ()), active, diff_counts(args, active),
                            jax.tree_util.Partial(backward, vjp_fn), tuple(args),
                            ct_avals(differentiable_leaves(primal)), batching="compiled")
        return primal, pullback


def _split(args, active):
    """``((treedef, consts), traced)``: the args' leaves that the programs trace, and the rest
    as hashable constants; None where a constant is not hashable."""
    leaves, treedef = jax.tree.flatten(tuple(args))
    on = [a for a, arg in zip(active or [False] * len(args), args) for _ in jax.tree.leaves(arg)]
    # Arrays, and floats that are differentiated, are traced; other leaves (Python ints,
    # functions) stay constants, concrete in fn as under plain vmap.
    dynamic = [is_array(x) or (a and is_differentiable(x)) for x, a in zip(leaves, on)]
    consts = tuple(_TRACED if d else (type(x), x) for x, d in zip(leaves, dynamic))
    try:
        hash(consts)
    except TypeError:
        return None
    return (treedef, consts), [x for x, d in zip(leaves, dynamic) if d]


def _mapped(fn, in_axes):
    """``fn`` vectorized over the args whose axis is 0; ``fn`` itself where none is."""
    return jax.vmap(fn, in_axes=in_axes) if any(a is not None for a in in_axes) else fn


_TRACED = object()  # in a program's constants: the place of a traced leaf
_lock = threading.RLock()  # (re-entrant: a weakref callback may run while it is held)
_cache: dict[int, tuple] = {}  # id(owner) -> (weakref to owner, its programs)


def _programs(chunked: Chunked) -> tuple:
    """The jitted ``(forward, backward, kept, gradients)`` of a vmap node. jax.jit caches
    compilations by function identity, so they are kept per node function (the one object a
    process uses for its content, :func:`~daskdag.transport.packing.current`), for as long as it lives:
    across chunks and sweeps, not past an in-place change to what it closes over. A
    function that cannot be weakly referenced gets them per :class:`Chunked`, i.e. per sweep."""
    fn = current(chunked.node.fn)
    with _lock:
        for owner in (fn, chunked):
            hit = _cache.get(id(owner))
            if hit is not None and hit[0]() is owner:
                return hit[1]
        key = id(fn)
        try:
            ref = weakref.ref(fn, lambda r: _forget(key, r))
            programs = _make_programs(ref)
        except TypeError:  # not weakly referenceable
            key = id(chunked)
            ref = weakref.ref(chunked, lambda r: _forget(key, r))
            programs = _make_programs(lambda: current(ref().node.fn))
        _cache[key] = (ref, programs)
        return programs


def _forget(key, ref):
    with _lock:
        if _cache.get(key, (None,))[0] is ref:
            del _cache[key]


def _make_programs(fn_of) -> tuple:
    kept = {}  # (static, input avals) -> (per residual: the input it is, else None; vjp treedef)

    def forward(static, dynamic):
        treedef, consts, in_axes, active = static
        args = _rebuild(treedef, consts, dynamic)
        vmapped = _mapped(fn_of(), in_axes)
        if active is None:
            return vmapped(*args)
        primal, _, vjp_fn = vjp_leaves(vmapped, args, active)
        # vjp_fn is a pytree whose leaves are the residuals: they leave jit, those that are not
        # inputs. Its function is part of the treedef, the same object for every call of this
        # program, so the backward compiles once too.
        residuals, vjp_def = jax.tree.flatten(vjp_fn)
        inputs = {id(x): i for i, x in enumerate(dynamic)}
        where = tuple(inputs.get(id(r)) for r in residuals)
        kept[static, tuple(map(jax.typeof, dynamic))] = where, vjp_def
        return primal, [r for r, i in zip(residuals, where) if i is None]

    def gradients(static, dynamic):
        treedef, consts, in_axes, active, seeded = static
        args = _rebuild(treedef, consts, dynamic)
        fn = _replay(_mapped(fn_of(), in_axes), treedef, consts, dynamic)
        # One vjp per backward pass, of its seeded values alone: XLA shares the forward work
        # between them, as in jit(value_and_grad) of each. (One vjp of all the values, its
        # passes vmapped with zeros where they do not start, took 1.2x as long: XLA cannot
        # drop the products with those zeros.)
        out = []
        for ones in seeded:
            picked = [e for e, on in enumerate(ones) if on]
            _, diff, vjp_fn = vjp_leaves(lambda *a: tuple(fn(*a)[e] for e in picked), args, active)
            out.append(vjp_fn([jnp.ones_like(leaf) for leaf in diff]))
        return fn(*args), out

    return (jax.jit(forward, static_argnums=0), jax.jit(lambda vjp_fn, ct: vjp_fn(ct)), kept,
            jax.jit(gradients, static_argnums=0))


def _rebuild(treedef, consts, dynamic):
    """The args of a program: its constants with the ``dynamic`` (traced) leaves in place."""
    it = iter(dynamic)
    return treedef.unflatten([next(it) if c is _TRACED else c[1] for c in consts])


def _replay(fn, treedef, consts, dynamic):
    """``fn`` of the args ``_rebuild(treedef, consts, dynamic)``, traced once and replayed from
    its jaxpr: calling it again does not run the user's Python code again."""
    out: dict = {}

    def numeric(*leaves):
        leaves, out["tree"] = jax.tree.flatten(fn(*_rebuild(treedef, consts, leaves)))
        out["static"] = [None if is_numeric(x) else x for x in leaves]
        return [x for x in leaves if is_numeric(x)]

    traced = jax.extend.core.jaxpr_as_fun(jax.make_jaxpr(numeric)(*dynamic))

    def replayed(*args):
        leaves = [x for x, c in zip(jax.tree.leaves(tuple(args)), consts) if c is _TRACED]
        it = iter(traced(*leaves))
        return out["tree"].unflatten([next(it) if s is None else s for s in out["static"]])

    return replayed


# A chunk's node runs under vjp as a Chunked does: one vjp per item, or once, vmapped.
LINEARIZERS[Chunked] = lambda chunked, node, args, active: chunked.linearize(args, active)


def chunk_of(node: Node) -> Chunked | None:
    """The :class:`Chunked` function of a sweep's node (its function may travel packed), else None."""
    fn = unwrap(node.fn)
    return fn if isinstance(fn, Chunked) else None


class Items(list):
    """A node's values over a chunk, one per item, as the item-by-item nodes made them: they
    pass them on unstacked (stacking every node's values and splitting them again in the next
    node cost about a tenth of an eager sweep's time). A pytree whose children are the items,
    so a cotangent of ``Items`` (a flat tuple, see :mod:`daskdag.rules.pullback`) is each item's
    cotangent in turn. :func:`stacked` makes one array per leaf, where one is needed."""


jax.tree_util.register_pytree_node(Items, lambda items: (list(items), None),
                                   lambda _, children: Items(children))


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


class _ForItems:
    """A vmap pullback whose args came as :class:`Items` (stacked for its program): it takes
    them as they came and gives their cotangents per item (:func:`per_item`)."""

    def __init__(self, pullback, sizes: tuple):
        self.pullback, self.sizes = pullback, sizes

    @property
    def batching(self):
        return self.pullback.batching

    def __call__(self, ct, inputs):
        return per_item(self.pullback(ct, tuple(map(stacked, inputs))), self.sizes)

    def residual_nbytes(self) -> int:
        return self.pullback.residual_nbytes()

    def __reduce__(self):
        return _ForItems, (self.pullback, self.sizes)


class ItemPullbacks:
    """The pullbacks of a chunk's items. Call: ``(ct, inputs)`` as for a
    :class:`~daskdag.rules.pullback.Pullback`: ``ct`` the cotangent of the node's :class:`Items`
    (each item's leaves in turn); it returns, for each dep that came as ``Items``, its
    cotangent likewise, for the others (stacked) one stacked array per leaf."""

    def __init__(self, pullbacks: list, in_axes: tuple[int | None, ...]):
        self.pullbacks, self.in_axes = pullbacks, in_axes

    def __call__(self, ct, inputs):
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
    def batching(self):
        """As its items' pullbacks (see :attr:`~daskdag.rules.pullback.Pullback.batching`)."""
        return self.pullbacks[0].batching if self.pullbacks else None

    def residual_nbytes(self) -> int:
        return sum(pb.residual_nbytes() for pb in self.pullbacks)

    def __reduce__(self):
        return ItemPullbacks, (self.pullbacks, self.in_axes)


class _ByValue:
    """An :class:`ItemPullbacks` of items that are each a tuple of values, taking its cotangent
    value by value (``ct``: value 0's leaves for every item, then value 1's...; ``leaves``: per
    value, its differentiable leaves per item) and passing it on item by item."""

    def __init__(self, pullback: ItemPullbacks, leaves: list[int], items: int):
        self.pullback, self.leaves, self.items = pullback, leaves, items

    @property
    def batching(self):
        return self.pullback.batching

    def __call__(self, ct, inputs):
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
