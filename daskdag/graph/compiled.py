"""A function compiled once (forward, backward, both together) for every call of the same
shapes, as a fused stage runs: ``jax.jit``, or ``jax.jit(jax.vmap(...))``; cached per function.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import jax
import jax.extend
import jax.numpy as jnp

from daskdag.caches import ByObject
from daskdag.model.leaves import differentiable_leaves, is_array, is_differentiable, is_numeric
from daskdag.model.spec import Node
from daskdag.rules.vjp import COMPILED, JaxPullback, by_arg, ct_avals, diff_counts, vjp_leaves
from daskdag.rules.vjp import linearize as vjp_linearize
from daskdag.transport.packing import current


class Jitted:
    """``fn`` as compiled programs, mapped over the args whose ``in_axes`` is 0 (run as it is
    where an arg holds a leaf that is neither an array nor hashable)."""

    def __init__(self, fn, in_axes: tuple[int | None, ...]):
        self.fn, self.in_axes = fn, in_axes

    def __call__(self, *args):
        out = self._run(args, None)
        return out if out is not None else self._eager()(*args)

    def linearize(self, args: Sequence[Any], active: tuple[bool, ...]):
        """``(primal, pullback)`` of ``fn`` at ``args``, differentiating the ``active`` ones."""
        out = self._run(args, active)
        return out if out is not None else vjp_linearize(Node(self._eager(), ()), args, active)

    def _eager(self):
        return mapped(current(self.fn), self.in_axes)

    def gradients(self, args: Sequence[Any], active: tuple[bool, ...], seeded: tuple):
        """``(primal, cts)`` as one program, or None; the ``k``-th backward pass starts from
        ones at each value ``e`` where ``seeded[k][e]``, else zeros."""
        parts = split(args, active)
        if parts is None:
            return None
        static, traced = parts
        primal, flat = _programs(self)[3]((*static, self.in_axes, active, seeded), traced)
        counts = diff_counts(args, active)
        return primal, [by_arg(f, active, counts) for f in flat]

    def _run(self, args, active):
        parts = split(args, active)
        if parts is None:
            return None
        forward, backward, kept, _, rows, each = _programs(self)
        static, traced = (*parts[0], self.in_axes, active), parts[1]
        out = forward(static, traced)
        if active is None:
            return out
        primal, computed = out
        # Residuals that are inputs are the inputs themselves (jit returns copies), so a
        # pullback that moves does not ship them.
        where, vjp_def = kept[static, tuple(map(jax.typeof, traced))]
        computed = iter(computed)
        vjp_fn = vjp_def.unflatten([next(computed) if i is None else traced[i] for i in where])
        pullback = JaxPullback(Node(self.fn, ()), active, diff_counts(args, active),
                               jax.tree_util.Partial(backward, vjp_fn), tuple(args),
                               ct_avals(differentiable_leaves(primal)), batching=COMPILED,
                               rows=rows, each=each)
        return primal, pullback


def mapped(fn, in_axes):
    return jax.vmap(fn, in_axes=in_axes) if any(a is not None for a in in_axes) else fn


def split(args, active):
    """``((treedef, consts), traced)``: the args' leaves to trace, and hashable constants."""
    leaves, treedef = jax.tree.flatten(tuple(args))
    if all(map(is_array, leaves)):  # (every leaf traced: the common call, at once)
        return (treedef, (TRACED,) * len(leaves)), tuple(leaves)
    on = [a for a, arg in zip(active or [False] * len(args), args) for _ in jax.tree.leaves(arg)]
    # Arrays, and floats that are differentiated, are traced; other leaves (Python ints,
    # functions) stay constants, concrete in fn as under plain vmap.
    dynamic = [is_array(x) or (a and is_differentiable(x)) for x, a in zip(leaves, on)]
    consts = tuple(TRACED if d else (type(x), x) for x, d in zip(leaves, dynamic))
    try:
        hash(consts)
    except TypeError:
        return None
    return (treedef, consts), tuple(x for x, d in zip(leaves, dynamic) if d)


TRACED = object()  # in a program's constants: the place of a traced leaf
_cache: ByObject[tuple] = ByObject("compiled programs of fused stages and jit nodes", 4096)


def _programs(compiled: Jitted) -> tuple:
    """The jitted ``(forward, backward, kept, gradients, rows, each)`` of a function, while it
    lives."""
    fn = current(compiled.fn)
    for owner in (fn, compiled):
        hit = _cache.get(owner)
        if hit is not None:
            return hit
    try:
        programs = _make_programs(weakref.ref(fn))
        return _cache.put(fn, programs)
    except TypeError:  # not weakly referenceable
        ref = weakref.ref(compiled)
        programs = _make_programs(lambda: current(ref().fn))  # type: ignore[union-attr]
        return _cache.put(compiled, programs)


def _make_programs(fn_of) -> tuple:
    kept = {}  # (static, input avals) -> (per residual: the input it is, else None; vjp treedef)

    def forward(static, dynamic):
        treedef, consts, in_axes, active = static
        args = rebuild(treedef, consts, dynamic)
        vmapped = mapped(fn_of(), in_axes)
        if active is None:
            return vmapped(*args)
        primal, _, vjp_fn = vjp_leaves(vmapped, args, active)
        # vjp_fn's leaves are the residuals; its treedef is the same for every call, so the
        # backward compiles once.
        residuals, vjp_def = jax.tree.flatten(vjp_fn)
        inputs = {id(x): i for i, x in enumerate(dynamic)}
        where = tuple(inputs.get(id(r)) for r in residuals)
        kept[static, tuple(map(jax.typeof, dynamic))] = where, vjp_def
        return primal, [r for r, i in zip(residuals, where) if i is None]

    def gradients(static, dynamic):
        treedef, consts, in_axes, active, seeded = static
        args = rebuild(treedef, consts, dynamic)
        fn = replay(mapped(fn_of(), in_axes), treedef, consts, dynamic)
        # One vjp per backward pass, of its seeded values alone; XLA shares the forward work.
        out = []
        for ones in seeded:
            picked = [e for e, on in enumerate(ones) if on]
            _, diff, vjp_fn = vjp_leaves(lambda *a: tuple(fn(*a)[e] for e in picked), args, active)
            out.append(vjp_fn([jnp.ones_like(leaf) for leaf in diff]))
        return fn(*args), out

    # rows: a Jacobian's stacked cotangents, each pulled back, as one program compiled once;
    # each: several outputs' cotangents, each pulled back apart, one program per count (XLA
    # runs each pass's ops on that pass's arrays: no stacked copies in or out)
    return (jax.jit(forward, static_argnums=0), jax.jit(lambda vjp_fn, ct: vjp_fn(ct)), kept,
            jax.jit(gradients, static_argnums=0),
            jax.jit(jax.vmap(lambda vjp_fn, ct: vjp_fn(ct), in_axes=(None, 0))),
            jax.jit(lambda vjp_fn, cts: [vjp_fn(ct) for ct in cts]))


def rebuild(treedef, consts, dynamic):
    """The args of a program: its constants with the ``dynamic`` (traced) leaves in place."""
    it = iter(dynamic)
    return treedef.unflatten([next(it) if c is TRACED else c[1] for c in consts])


def replay(fn, treedef, consts, dynamic):
    """``fn`` of ``rebuild(treedef, consts, dynamic)``, traced once and replayed from its jaxpr."""
    out: dict = {}

    def numeric(*leaves):
        leaves, out["tree"] = jax.tree.flatten(fn(*rebuild(treedef, consts, leaves)))
        out["static"] = [None if is_numeric(x) else x for x in leaves]
        return [x for x in leaves if is_numeric(x)]

    traced = jax.extend.core.jaxpr_as_fun(jax.make_jaxpr(numeric)(*dynamic))

    def replayed(*args):
        leaves = [x for x, c in zip(jax.tree.leaves(tuple(args)), consts) if c is TRACED]
        it = iter(traced(*leaves))
        return out["tree"].unflatten([next(it) if s is None else s for s in out["static"]])

    return replayed

