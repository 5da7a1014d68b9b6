"""JAX's own rule: a node's forward pass under ``jax.vjp``, leaf by leaf
(:mod:`daskdag.model.leaves`), and the :class:`JaxPullback` it leaves behind, which can travel
to another process as an exported program plus its residual arrays."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.model.leaves import ARRAYS, differentiable_leaves, is_differentiable, is_numeric
from daskdag.model.spec import Node
from daskdag.rules.pullback import EAGER, Batching, Pullback
from daskdag.transport import programs


class JaxPullback(Pullback):
    """The backward half of one node's ``jax.vjp`` at one point; holds the residuals.

    Called as a :class:`~daskdag.rules.pullback.Pullback`: the cotangent of the node's output
    (a flat tuple) and the node's dep values in; each differentiated dep's cotangent out,
    ``None`` for the deps held constant.

    In the process that ran the forward pass it calls JAX's own vjp function. When Dask moves it
    elsewhere it travels as :meth:`portable`: an exported program plus its residual arrays, less
    those that are the node's own inputs, which the backward task holds anyway. A program that
    cannot be exported (a host callback inside) travels as the node's function instead, and its
    forward pass is redone there. Its ``batching`` is :data:`~daskdag.rules.pullback.EAGER` for
    JAX's vjp of plain code, as given for a compiled program, else None.
    """

    __slots__ = ("active", "counts", "batching", "_node", "_vjp", "_args", "_ct_avals", "_form",
                 "_program")

    def __init__(self, node: Node, active: tuple[bool, ...], counts: tuple[int, ...], vjp_fn=None,
                 args=None, ct_avals=None, batching: Batching | None = None):
        self._node, self.active, self.counts = node, active, counts
        self._vjp, self._args, self._ct_avals = vjp_fn, args, ct_avals
        if batching is None and vjp_fn is not None and not node.jit:
            batching = EAGER
        self.batching = batching
        self._form = self._program = None  # set in a process that received this pullback

    def __call__(self, ct: tuple, inputs: Sequence[Any], dropped=None) -> tuple:
        if self._vjp is not None:
            flat = self._vjp(list(ct))
        elif self._program is not None:
            consts = list(self._form["consts"])
            for c, (d, k) in self._form["slots"]:
                consts[c] = jax.tree.leaves(inputs[d])[k]
            flat = self._program(*ct, *consts)
        else:  # shipped as its function: redo this node's forward pass here
            return linearize(self._node, inputs, self.active)[1](ct, inputs)
        return by_arg(flat, self.active, self.counts)

    def residual_nbytes(self) -> int:
        """Bytes of the residuals that are not the node's own inputs: what moving it ships."""
        if self._vjp is None:
            return sum(a.nbytes for a in self._form.get("consts", ()) if a is not None)
        inputs = {id(leaf) for leaf in jax.tree.leaves(self._args)}
        return sum(a.nbytes for a in jax.tree.leaves(self._vjp) if id(a) not in inputs)

    # -- travelling ------------------------------------------------------------------------------

    def portable(self) -> dict:
        """What crosses a process boundary: small metadata plus the residual arrays (NumPy)."""
        if self._form is not None:  # received from elsewhere: passes on as it came
            return dict(self._form)
        base = {"active": self.active, "counts": self.counts, "versions": programs.versions()}
        try:
            closed = jax.make_jaxpr(self._vjp)(self._ct_avals)
            key, program = programs.export(closed, self._ct_avals)
        except Exception:  # e.g. "serialization of host_callbacks is not yet implemented"
            return {**base, "node": self._node}
        where = {id(leaf): (d, k) for d, arg in enumerate(self._args)
                 for k, leaf in enumerate(jax.tree.leaves(arg))}
        slots = [(c, where[id(a)]) for c, a in enumerate(closed.consts) if id(a) in where]
        taken = {c for c, _ in slots}
        return {**base, "key": key, "program": program, "slots": slots,
                "consts": [None if c in taken else np.asarray(a) for c, a in enumerate(closed.consts)]}

    @classmethod
    def from_portable(cls, form: dict) -> "JaxPullback":
        """The inverse of :meth:`portable`, in the receiving process."""
        programs.check_versions(form["versions"])
        pb = cls(form.get("node"), form["active"], form["counts"])  # node: only when redone
        pb._form = form
        if "program" in form:
            pb._program = programs.load(form["key"], form["program"])
        return pb

    def __reduce__(self):  # (its residual arrays pickle out of band: Dask's zero-copy frames)
        return JaxPullback.from_portable, (self.portable(),)


def linearize(node: Node, args: Sequence[Any], active: tuple[bool, ...]):
    """Run the node's function once under ``jax.vjp``, differentiating the differentiable leaves
    of the ``active`` args; everything else (inactive args, other leaves) is held constant, so
    it gets no cotangent and costs no backward work.

    Returns ``(primal, Pullback)``; the primal is the function's output as it returned it.
    """
    primal, primal_diff, vjp_fn = vjp_leaves(node.callable(), args, active)
    return primal, JaxPullback(node, active, diff_counts(args, active), vjp_fn, tuple(args),
                            ct_avals(primal_diff))


def vjp_leaves(fn, args: Sequence[Any], active: tuple[bool, ...]):
    """``(primal, its differentiable leaves, vjp_fn)``: ``jax.vjp`` of ``fn`` at ``args``, leaf
    by leaf as :func:`linearize` does. ``vjp_fn`` takes and returns lists of leaves. It runs
    under ``jax.jit`` too, where ``fn``'s output must then be arrays only."""
    diff, fn_of_diff, rebuild = of_leaves(fn, args, active)
    primal_diff, vjp_fn, held = jax.vjp(fn_of_diff, *diff, has_aux=True)
    return rebuild(primal_diff, held), primal_diff, vjp_fn


def of_leaves(fn, args: Sequence[Any], active: tuple[bool, ...]):
    """``fn`` as a function of the differentiable leaves of its ``active`` args, for ``jax.vjp``
    and ``jax.jvp`` (:func:`daskdag.graph.forward.jvp_leaves`): returns ``(diff, fn_of_diff, rebuild)``:
    those leaves; ``fn_of_diff(*diff)``, which gives the differentiable leaves of ``fn``'s
    output and, as aux, its other numeric leaves; ``rebuild(out_diff, held)``, once it ran, the
    output as ``fn`` returned it."""
    # (An arg that is an array is its own one leaf: no pytree walk for the common case, a cost
    # paid per node per call.)
    flat_args = [([a], None) if isinstance(a, ARRAYS) else jax.tree.flatten(a) for a in args]
    masks = [tuple(map(is_differentiable, leaves)) if on else () for on, (leaves, _) in
             zip(active, flat_args)]
    diff = [leaf for (leaves, _), mask in zip(flat_args, masks) for leaf, m in zip(leaves, mask) if m]
    out: dict = {}

    def arg(a, on, flat, mask, it):
        if not on:
            return a
        leaves, treedef = flat
        if treedef is None:
            return next(it) if mask[0] else a
        return treedef.unflatten([next(it) if m else leaf for leaf, m in zip(leaves, mask)])

    def fn_of_diff(*diff_leaves):
        it = iter(diff_leaves)
        result = fn(*[arg(a, on, flat, mask, it)
                      for a, on, flat, mask in zip(args, active, flat_args, masks)])
        leaves, out["treedef"] = jax.tree.flatten(result)
        out["mask"] = mask = tuple(map(is_differentiable, leaves))
        # Arrays held constant go through the aux (they may depend on traced inputs); other
        # leaves (functions, strings) cannot be traced and are kept as they are.
        out["static"] = [None if is_numeric(leaf) else leaf for leaf in leaves]
        return ([leaf for leaf, m in zip(leaves, mask) if m],
                [leaf for leaf, m in zip(leaves, mask) if not m and is_numeric(leaf)])

    def rebuild(out_diff, held):
        d, h = iter(out_diff), iter(held)
        return out["treedef"].unflatten([next(d) if m else (next(h) if s is None else s)
                                         for m, s in zip(out["mask"], out["static"])])

    return diff, fn_of_diff, rebuild




def by_arg(flat: Sequence[Any], active: tuple[bool, ...], counts: tuple[int, ...]) -> tuple:
    """Cotangent leaves in :func:`vjp_leaves` order as a tuple aligned with the args: each
    active arg's leaves (``counts`` of them), ``None`` for the others."""
    out, at = [], 0
    for on, n in zip(active, counts):
        out.append(tuple(flat[at:at + n]) if on else None)
        at += n
    return tuple(out)


def diff_counts(args: Sequence[Any], active: tuple[bool, ...]) -> tuple[int, ...]:
    """Per arg, how many leaves :func:`vjp_leaves` differentiates."""
    return tuple(len(differentiable_leaves(a)) if on else 0 for a, on in zip(args, active))


def ct_avals(primal_diff) -> list:
    return [jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)) for p in primal_diff]
