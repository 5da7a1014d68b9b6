"""Reverse mode, every node's backward half. The pullback protocol (:class:`Pullback`), which
Dask sizes and moves the same way whoever made one; one registry of rules by the type of a node's
function (:func:`register`: the user's own, a sweep's chunk of items; a type not registered is
JAX code); remat (:class:`RematPullback`); JAX's own rule, ``jax.vjp`` leaf by leaf, whose
:class:`JaxPullback` travels as an exported program plus its residual arrays; whether a node's
jaxpr can go through ``jax.vjp`` at all (:func:`why_no_vjp`); and where cotangents start and
how they add up (:func:`seed`, :func:`basis`, :func:`total`)."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial, reduce, singledispatch
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from daskdag.errors import DAGError
from daskdag.model.colouring import check_rows, count
from daskdag.model.devices import beside
from daskdag.model.leaves import (aval, describe, differentiable_leaves, dtype_is, dtype_of,
                                  is_differentiable, is_numeric, ones_like, partition)
from daskdag.model.spec import Node
from daskdag.transport import programs, weak
from daskdag.transport.packing import unwrap
from daskdag.transport.protocol import travels


@dataclass(frozen=True)
class Batching:
    """When pulling several cotangents back at once under ``jax.vmap`` pays, where dispatching
    each op costs more than its arithmetic (small cotangents, on the CPU): from ``least``
    cotangents, each of at most ``most_elements`` elements. On an accelerator, and with
    ``daskdag.batch-cotangents: always``, from two cotangents of any size."""

    least: int
    most_elements: int | None = None

    def worth(self, cts: list, any_size: bool = False) -> bool:
        """``cts``: per output, a cotangent per exposed value (flat tuples, or None);
        ``any_size``: from two cotangents, whatever their size."""
        if any_size:
            return len(cts) >= 2
        if len(cts) < self.least:
            return False
        return self.most_elements is None or max(
            sum(int(np.size(leaf)) for c in per_output if c is not None for leaf in c)
            for per_output in cts) <= self.most_elements


# A compiled program's batched trace is cached; vmap of an eager pullback traces it anew. On the
# CPU a loop over large cotangents runs faster, without stacking them (XLA's CPU matmuls over a
# batch axis take longer than the same matmuls one by one). (A compiled stage's own pullback is
# :attr:`Pullback.apart`: its ``each`` takes several cotangents of any size, unstacked.)
COMPILED = Batching(2, 2 ** 15)
EAGER = Batching(8, 2 ** 15)


@travels(lambda pb: pb.residual_nbytes())
class Pullback(abc.ABC):
    """The backward half of a forward pass at one point.

    Call: ``pullback(ct, inputs, dropped=None)``. ``ct``: the cotangent of what the forward
    pass returned, flat tuples of leaves (a stage's: one per exposed node, ``None`` where none
    flows); ``inputs``: the forward pass's, which the backward task holds anyway;
    ``dropped()``, asked between two nodes, stops it. Returns one cotangent per input, ``None``
    for those held constant.
    """

    #: When several cotangents are best pulled back at once; None: never (the user's code, or
    #: the vjp of a jitted function, which ``vmap`` recompiles on every call).
    batching: Batching | None = None
    #: JAX can trace it (``jax.vmap`` over a Jacobian's rows).
    traceable: bool = True
    #: :meth:`each` pulls several outputs' cotangents back as one compiled program, each apart
    #: (no stacking before nor splitting after).
    apart: bool = False

    @abc.abstractmethod
    def __call__(self, ct: Any, inputs: Sequence[Any], dropped: Callable[[], bool] | None = None
                 ) -> tuple:
        ...

    def rows(self, cts: Any, inputs: Sequence[Any], dropped: Callable[[], bool] | None = None
             ) -> tuple:
        """The pullback of each row of ``cts`` (each leaf stacked over a Jacobian's rows), under
        ``jax.vmap``; one that cannot be vmapped raises, and is pulled back row by row."""
        return jax.vmap(lambda ct: self(ct, inputs, dropped))(cts)

    def each(self, cts: Sequence[Any], inputs: Sequence[Any], dropped=None) -> list:
        """The pullback of each of ``cts`` (several outputs' cotangents): where :attr:`apart`,
        as one pass that keeps them apart, else one call each."""
        return [self(ct, inputs, dropped) for ct in cts]

    def materialize(self, inputs: Sequence[Any]) -> Pullback:
        """The pullback a backward task calls on these ``inputs``: itself, or for one that keeps
        no residuals (a :class:`RematPullback`), one that recomputed them, once for the task."""
        return self

    @abc.abstractmethod
    def residual_nbytes(self) -> int:
        """Bytes that moving it ships: its residuals, less what the backward task holds."""


@dataclass(frozen=True)
class Rules:
    """How nodes of one kind are differentiated. ``linearize(fn, node, args, active) ->
    (primal, pullback)``; ``push(fn, node, args, tangents, active) -> (primal, tangent)``;
    ``fn``: the node's function unpacked; ``active``: per dep, whether it is differentiated."""

    linearize: Callable | None = None
    push: Callable | None = None
    #: For a function that maps one element's node over a batch (a sweep's chunk):
    #: ``element(fn) -> (node, in_axes)``, per dep its batch axis (0) or None;
    #: ``batch(fn, in_axes, vectorized)``, a function of one element made to run over the batch
    #: the same way (``vectorized``: under ``jax.vmap``, else element by element).
    element: Callable | None = None
    batch: Callable | None = None


RULES: dict[type, Rules] = {}


def register(kind: type, **rules: Callable) -> None:
    """The rules (:class:`Rules`' fields) for functions of type ``kind`` and its subclasses."""
    RULES[kind] = Rules(**rules)


def function_of(node: Node):
    """``node``'s function itself: unpacked, and not as a preparation holds it (weakly)."""
    return weak.held(unwrap(node.fn))


def rules_of(node: Node) -> Rules | None:
    """The rules registered for the kind of ``node``'s function, else None (JAX code)."""
    for kind in type(function_of(node)).__mro__:
        if kind in RULES:
            return RULES[kind]
    return None


def has_rules(node: Node) -> bool:
    """Its function is of a registered kind (not plain JAX code)."""
    return rules_of(node) is not None


def linearizer(node: Node) -> Callable:
    """``f(args, active) -> (primal, pullback)`` for ``node``."""
    return rule_for(node, "linearize", linearize)


def rule_for(node: Node, rule: str, jax_rule: Callable) -> Callable:
    """The ``rule`` (a :class:`Rules` field) registered for ``node``'s kind, on its function,
    else ``jax_rule`` (JAX's own), each taking ``node`` first."""
    rules = rules_of(node)
    own = None if rules is None else getattr(rules, rule)
    return partial(jax_rule, node) if own is None else partial(own, function_of(node), node)


def element_of(node: Node) -> tuple[Node, tuple | None]:
    """``(the node one element runs, per dep its batch axis)`` for a node that maps one over a
    batch (:attr:`Rules.element`); else ``(node, None)``."""
    rules = rules_of(node)
    if rules is None or rules.element is None:
        return node, None
    return rules.element(function_of(node))


def forward_rule(node: Node) -> Callable:
    """:func:`linearizer` as a forward task runs ``node``; for a ``remat`` node
    (``Node(..., remat=True)``), its value computed undifferentiated (no residuals even for a
    moment) and a :class:`RematPullback`."""
    if not node.remat:
        return linearizer(node)
    return lambda inputs, active: (node.callable()(*inputs), RematPullback(node, tuple(active)))


class RematPullback(Pullback):
    """The backward half of a ``remat`` node: no residuals (the backward task holds the inputs).
    :meth:`materialize` redoes the forward pass under the node's rule and returns its ordinary
    pullback, as :func:`jax.checkpoint` does."""

    batching = None  # (until materialized)
    traceable = False

    def __init__(self, node: Node, active: tuple[bool, ...]):
        self.node, self.active = node, active

    def materialize(self, inputs: Sequence[Any]) -> Pullback:
        return linearizer(self.node)(list(inputs), self.active)[1]

    def __call__(self, ct: tuple, inputs: Sequence[Any], dropped=None) -> tuple:
        return self.materialize(inputs)(ct, inputs, dropped)

    def residual_nbytes(self) -> int:
        return 0

    def __reduce__(self):
        return RematPullback, (self.node, self.active)


class JaxPullback(Pullback):
    """The backward half of one node's ``jax.vjp`` at one point: JAX's vjp function, which
    holds the residuals. Moved to another process, it arrives as a :class:`ProgramPullback`,
    or where its program cannot be exported (a host callback inside) a :class:`RedonePullback`.
    """

    __slots__ = ("active", "counts", "batching", "apart", "_node", "_vjp", "_args", "_ct_avals",
                 "_rows", "_each")

    def __init__(self, node: Node, active: tuple[bool, ...], counts: tuple[int, ...], vjp_fn,
                 args, ct_avals, batching: Batching | None = None, rows=None, each=None):
        self._node, self.active, self.counts = node, active, counts
        self._vjp, self._args, self._ct_avals = vjp_fn, args, ct_avals
        self.batching = batching if batching is not None or node.jit else EAGER
        # (a compiled program's own: ``rows(vjp_fn, cts)``, ``each(vjp_fn, [ct, ...])``)
        self._rows, self._each, self.apart = rows, each, each is not None

    def __call__(self, ct: tuple, inputs: Sequence[Any], dropped=None) -> tuple:
        return by_arg(self._vjp(list(ct)), self.active, self.counts)

    def rows(self, cts: tuple, inputs: Sequence[Any], dropped=None) -> tuple:
        if self._rows is None:
            return super().rows(cts, inputs, dropped)
        return by_arg(self._rows(self._vjp, list(cts)), self.active, self.counts)

    def each(self, cts: Sequence[Any], inputs: Sequence[Any], dropped=None) -> list:
        if self._each is None:
            return super().each(cts, inputs, dropped)
        return [by_arg(flat, self.active, self.counts)
                for flat in self._each(self._vjp, [list(ct) for ct in cts])]

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
    return list(map(aval, primal_diff))


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


@singledispatch
def seed(primal, output: str, ct, batched: bool = False) -> tuple:
    """The cotangent an output starts from, flat: 1 for a real scalar, else the user's ``ct``
    (the output's structure, ``None`` at leaves held constant). ``batched``: the output has a
    leading item axis; ``ct`` is one item's, broadcast over the items."""
    if ct is None:
        check_scalar(primal, output, batched)
        return (ones_like(jax.tree.leaves(primal)[0]),)
    leaves = jax.tree.leaves(primal)
    item = [aval(p, batched) if is_differentiable(p) else None for p in leaves]
    ct_leaves, ct_def = jax.tree.flatten(ct, is_leaf=lambda c: c is None)
    if ct_def != jax.tree.structure(primal, is_leaf=lambda c: c is None) or any(
            i is not None and jnp.shape(c) != i.shape for c, i in zip(ct_leaves, item)):
        raise DAGError(f"cotangent for output {output!r} is {describe(ct)}, "
                       f"but the output is {describe(primal, batched)}", argument="cotangents")
    seeds = []
    for c, i, p in zip(ct_leaves, item, leaves):
        if i is None:  # a leaf held constant carries no cotangent
            continue
        if jnp.iscomplexobj(c) and not jnp.issubdtype(i.dtype, jnp.complexfloating):
            raise DAGError(f"cotangent for output {output!r} is complex, but the output is real "
                           f"({i.dtype}): its imaginary part would be dropped",
                           argument="cotangents")
        c = jnp.asarray(c, i.dtype)
        seeds.append(np.broadcast_to(c, jnp.shape(p)) if batched else c)
    return tuple(seeds)


def check_scalar(primal, output: str, batched: bool = False) -> None:
    """Refuse an ``output`` without a cotangent unless it is a real scalar (per item,
    ``batched``), which starts from 1."""
    leaves = jax.tree.leaves(primal)
    leaf = leaves[0] if len(leaves) == 1 else None
    shape = () if leaf is None else tuple(np.shape(leaf))
    if not (leaf is not None and leaf is primal and (shape[1:] if batched else shape) == ()
            and dtype_is(dtype_of(leaf), jnp.floating)):
        raise DAGError(f"output {output!r} is not a real scalar: it is "
                       f"{describe(primal, batched)}; pass cotangents={{{output!r}: ct}} "
                       f"with ct shaped like it", argument="cotangents")


def basis(output: str, primal, colours=None) -> tuple:
    """The rows of the identity over the elements of ``primal``'s differentiable leaves as a
    cotangent, one ``[rows, *leaf.shape]`` array per leaf: pulled back, row ``r`` is row ``r``
    of the Jacobian. With ``colours`` (one per element), row ``k`` is 1 on every element of
    colour ``k``, pulled back the sum of their gradients."""
    leaves = check_real(output, primal)
    size_all = basis_size(primal)
    if colours is not None:
        check_rows(output, len(colours), size_all)
    n = size_all if colours is None else basis_rows(primal, colours)
    rows = np.arange(size_all) if colours is None else np.asarray(colours)
    start, seeds = 0, []
    for leaf in leaves:
        size = math.prod(jnp.shape(leaf))
        eye = np.zeros((n, size), jnp.result_type(leaf))
        eye[rows[start:start + size], np.arange(size)] = 1
        seeds.append(eye.reshape(n, *jnp.shape(leaf)))  # (NumPy: a program takes it as it is)
        start += size
    return tuple(seeds)


def check_real(output: str, value) -> list:
    """``value``'s differentiable leaves, refused where complex: a Jacobian needs real outputs."""
    leaves = differentiable_leaves(value)
    for leaf in leaves:
        if jnp.iscomplexobj(leaf):
            raise DAGError(f"output {output!r} is complex ({jnp.result_type(leaf)}): a "
                           f"Jacobian needs real outputs, as jax.jacrev does")
    return leaves


class PerItem:
    """How a call over a sweep's chunk seeds its outputs and gathers its gradients: values with
    a leading item axis. A sweep that passes values item by item extends it."""

    def __dask_tokenize__(self):
        return type(self).__qualname__

    def seed(self, value, output: str, ct) -> tuple:
        """:func:`seed` of each item, ``ct`` one item's."""
        return seed(value, output, ct, batched=True)

    def basis(self, value, output: str, colours=None) -> tuple:
        """:func:`basis` of each item, each leaf ``(rows, items, *item shape)`` (row ``r`` the
        same for every item)."""
        rows = basis(output, jax.tree.map(lambda a: a[0], value), colours)
        n = len(jax.tree.leaves(value)[0])
        return tuple(np.broadcast_to(r[:, None], (r.shape[0], n, *r.shape[1:])) for r in rows)

    def rows(self, value, colours=None) -> int:
        """:func:`basis_rows` of one item."""
        return basis_rows(jax.tree.map(lambda a: a[0], value), colours)

    def gradient(self, value, grad, rows: bool):
        """The gradient of ``value`` over the chunk, as a sweep stacks it: its items first (a
        Jacobian's rows after them: ``(items, rows, ...)``)."""
        return jax.tree.map(lambda g: jnp.moveaxis(g, 0, 1), grad) if rows else grad


def basis_rows(primal, colours=None) -> int:
    """How many rows :func:`basis` has."""
    return basis_size(primal) if colours is None else count(np.asarray(colours))


def basis_size(primal) -> int:
    """The elements of ``primal``'s differentiable leaves."""
    return sum(math.prod(jnp.shape(leaf)) for leaf in differentiable_leaves(primal))


def total(cts):
    """Sum cotangents (flat tuples, one array per differentiable leaf)."""
    return reduce(add, cts)


def add(a: tuple, b: tuple) -> tuple:
    """Two cotangents summed leaf by leaf, each sum on its first leaf's device."""
    return tuple(x + beside(x, y) for x, y in zip(a, b))
