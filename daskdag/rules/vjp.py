"""JAX's own rule: a node's forward pass under ``jax.vjp``, leaf by leaf, and the
:class:`JaxPullback` it leaves, which travels as an exported program plus its residual arrays;
and whether a node's jaxpr can go through ``jax.vjp`` at all (:func:`why_no_vjp`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from daskdag.model.leaves import differentiable_leaves, is_differentiable, is_numeric, partition
from daskdag.model.spec import Node
from daskdag.rules.pullback import EAGER, Batching, Pullback
from daskdag.transport import programs


class JaxPullback(Pullback):
    """The backward half of one node's ``jax.vjp`` at one point: JAX's vjp function, which
    holds the residuals. Moved to another process, it arrives as a :class:`ProgramPullback`,
    or where its program cannot be exported (a host callback inside) a :class:`RedonePullback`.
    """

    __slots__ = ("active", "counts", "batching", "_node", "_vjp", "_args", "_ct_avals", "_rows")

    def __init__(self, node: Node, active: tuple[bool, ...], counts: tuple[int, ...], vjp_fn,
                 args, ct_avals, batching: Batching | None = None, rows=None):
        self._node, self.active, self.counts = node, active, counts
        self._vjp, self._args, self._ct_avals = vjp_fn, args, ct_avals
        self.batching = batching if batching is not None or node.jit else EAGER
        self._rows = rows  # (a compiled program's own: ``rows(vjp_fn, cts)``)

    def __call__(self, ct: tuple, inputs: Sequence[Any], dropped=None) -> tuple:
        return by_arg(self._vjp(list(ct)), self.active, self.counts)

    def rows(self, cts: tuple, inputs: Sequence[Any], dropped=None) -> tuple:
        if self._rows is None:
            return super().rows(cts, inputs, dropped)
        return by_arg(self._rows(self._vjp, list(cts)), self.active, self.counts)

    def residual_nbytes(self) -> int:
        inputs = {id(leaf) for leaf in jax.tree.leaves(self._args)}
        return sum(a.nbytes for a in jax.tree.leaves(self._vjp) if id(a) not in inputs)

    def portable(self) -> dict:
        """What crosses a process boundary: metadata, the program and its residual arrays (those
        that are the node's inputs as slots, which the backward task fills)."""
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
        consts = [None if c in taken else np.asarray(a) for c, a in enumerate(closed.consts)]
        return {**base, "key": key, "program": program, "slots": slots, "consts": consts}

    def __reduce__(self):  # (its residual arrays pickle out of band: Dask's zero-copy frames)
        return received, (self.portable(),)


def received(form: dict) -> Pullback:
    """A :class:`JaxPullback` as it arrives in another process, from its portable ``form``."""
    programs.check_versions(form["versions"])
    return ProgramPullback(form) if "program" in form else RedonePullback(form)


class ProgramPullback(Pullback):
    """A :class:`JaxPullback` received as its exported program and residual arrays."""

    def __init__(self, form: dict):
        self.form, self.active, self.counts = form, form["active"], form["counts"]
        self._program = programs.load(form["key"], form["program"])

    def __call__(self, ct: tuple, inputs: Sequence[Any], dropped=None) -> tuple:
        consts = list(self.form["consts"])
        for c, (d, k) in self.form["slots"]:
            consts[c] = jax.tree.leaves(inputs[d])[k]
        return by_arg(self._program(*ct, *consts), self.active, self.counts)

    def residual_nbytes(self) -> int:
        return sum(a.nbytes for a in self.form["consts"] if a is not None)

    def __reduce__(self):  # passes on as it came
        return received, (self.form,)


class RedonePullback(Pullback):
    """A :class:`JaxPullback` whose program could not be exported, received as its node: the
    forward pass is redone on the backward task's ``inputs``."""

    def __init__(self, form: dict):
        self.form, self.active = form, form["active"]

    def __call__(self, ct: tuple, inputs: Sequence[Any], dropped=None) -> tuple:
        return linearize(self.form["node"], inputs, self.active)[1](ct, inputs)

    def residual_nbytes(self) -> int:
        return 0

    def __reduce__(self):
        return received, (self.form,)


def linearize(node: Node, args: Sequence[Any], active: tuple[bool, ...]):
    """``(primal, Pullback)``: the node's function run once under ``jax.vjp`` in the
    differentiable leaves of the ``active`` args, everything else held constant."""
    primal, primal_diff, vjp_fn = vjp_leaves(node.callable(), args, active)
    return primal, JaxPullback(node, active, diff_counts(args, active), vjp_fn, tuple(args),
                            ct_avals(primal_diff))


def vjp_leaves(fn, args: Sequence[Any], active: tuple[bool, ...]):
    """``(primal, its differentiable leaves, vjp_fn)``: ``jax.vjp`` of ``fn`` at ``args`` as
    :func:`linearize` does; ``vjp_fn`` takes and returns lists of leaves."""
    diff, fn_of_diff, rebuild = of_leaves(fn, args, active)
    primal_diff, vjp_fn, held = jax.vjp(fn_of_diff, *diff, has_aux=True)
    return rebuild(primal_diff, held), primal_diff, vjp_fn


def of_leaves(fn, args: Sequence[Any], active: tuple[bool, ...]):
    """``fn`` of the differentiable leaves of its ``active`` args: ``(diff, fn_of_diff,
    rebuild)``: those leaves; ``fn_of_diff(*diff)``, the differentiable leaves of ``fn``'s
    output and, as aux, its other numeric leaves; ``rebuild(out_diff, held)``, the output."""
    parts = [partition(a, _differentiated) if on else ([[], [a]], _itself)
             for a, on in zip(args, active)]
    diff = [leaf for (taken, _), _ in parts for leaf in taken]
    out: dict = {}

    def fn_of_diff(*diff_leaves):
        leaves = iter(diff_leaves)  # (shared: each arg's combine takes its own in turn)
        (taken, held, static), out["combine"] = partition(
            fn(*[combine(leaves, rest) for (_, rest), combine in parts]), _held_or_static, 3)
        # (held arrays go through the aux: they may depend on traced inputs)
        out["static"] = static
        return taken, held

    def rebuild(out_diff, held):
        return out["combine"](out_diff, held, out["static"])

    return diff, fn_of_diff, rebuild


def _differentiated(leaf) -> int:
    return 0 if is_differentiable(leaf) else 1


def _held_or_static(leaf) -> int:
    """An output's leaf: 0, differentiated; 1, numeric but held; 2, anything else."""
    return 0 if is_differentiable(leaf) else 1 if is_numeric(leaf) else 2


def _itself(_, rest):
    """The combine of an arg that is held whole: the arg."""
    return rest[0]


def by_arg(flat: Sequence[Any], active: tuple[bool, ...], counts: tuple[int, ...]) -> tuple:
    """Cotangent leaves in :func:`vjp_leaves` order as one tuple of ``counts`` leaves per active
    arg, ``None`` for the others."""
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


def of_jaxpr(closed, active: Sequence[bool]) -> tuple[list, list, Callable]:
    """A node's ``ClosedJaxpr`` as a function of its differentiated inputs: ``(diff, held,
    fn)``, the shapes of the floating-point inputs where ``active`` and of the others, and
    ``fn(held, *diff)``, the jaxpr's floating-point outputs."""
    run = jcore.jaxpr_as_fun(closed)
    ins = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in closed.in_avals]
    on = [bool(a) and jnp.issubdtype(s.dtype, jnp.inexact) for a, s in zip(active, ins)]
    out_on = [jnp.issubdtype(a.dtype, jnp.inexact) for a in closed.out_avals]

    def fn(held, *diff):
        taken, kept = iter(diff), iter(held)
        outs = run(*[next(taken) if o else next(kept) for o in on])
        return [x for x, o in zip(outs, out_on) if o]

    return [s for s, o in zip(ins, on) if o], [s for s, o in zip(ins, on) if not o], fn


def why_no_vjp(closed, active: Sequence[bool]) -> str | None:
    """Why ``jax.vjp`` cannot go through a node's jaxpr (traced on shapes); None when it can."""
    diff, held, fn = of_jaxpr(closed, active)
    if not diff:
        return None

    def pulled(held, diff):
        out, pull = jax.vjp(partial(fn, held), *diff)
        return pull(out)

    try:
        jax.eval_shape(pulled, held, diff)
    except Exception as e:  # e.g. a pure_callback in a custom_jvp rule: it cannot be transposed
        return f"has no reverse-mode rule: jax.vjp fails through it ({in_brief(e)})"
    return None


def in_brief(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
