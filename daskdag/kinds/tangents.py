"""Jacobian-vector products (the lifted DAG's forward pass), and what every kind that pushes
tangents shares: where they enter (:func:`lifted`), a call's inputs as pairs (:func:`paired`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from daskdag.errors import DAGError, NodeError
from daskdag.model.leaves import on_differentiable, result_pytree, zeros
from daskdag.model.plan import make_plan
from daskdag.model.request import input_tangents, with_rules, wrt_names
from daskdag.model.spec import Spec
from daskdag.rules.lifted import Pair, lift
from daskdag.running.jobs import CallInfo
from daskdag.running.passes import Derivative, Lowered
from daskdag.kinds.gradients import per_output
from daskdag.transport.protocol import travels, tree_size


@result_pytree("value", "tangent")
@travels(lambda r: tree_size((r.value, r.tangent)))
@dataclass(frozen=True)
class JVPResult:
    """One output's ``value`` and ``tangent``, from [`compute_jvps`][daskdag.compute_jvps] or
    [`sweep_jvps`][daskdag.sweep_jvps]. A JAX pytree of ``value`` and ``tangent``, as
    [`Result`][daskdag.Result] is of its arrays.

    Attributes:
        value: the output's value; from a sweep, stacked over the items.
        tangent: its Jacobian-vector product, in the output's structure, ``None`` at the leaves
            held constant (not floating-point), zeros where no tangent reaches it; with
            ``batched=True`` each leaf has a leading axis of directions.
        info: how the call was computed ([`CallInfo`][daskdag.CallInfo]).
        failed: as [`Result`][daskdag.Result]'s ``failed``.
    """

    value: Any
    tangent: Any
    info: CallInfo | None = None
    failed: Mapping[int, NodeError] = field(default_factory=dict)


@dataclass(frozen=True)
class Carriers:
    """Where tangents enter: ``inputs`` (as ``Pair`` s), and ``added`` (``{wrt node: input}``)."""

    inputs: tuple[str, ...]
    added: dict[str, str]

    @property
    def moving(self) -> tuple[str, ...]:
        return (*self.inputs, *self.added.values())

    def given(self, values: dict) -> tuple[str, ...]:
        """The inputs a lifted call gives: those of ``values``, and the added tangents'."""
        return (*values, *self.added.values())


def lifted(spec: Spec, outputs: tuple[str, ...], wrt: tuple[str, ...], directions: bool = False,
           chunk: int | None = None) -> tuple[Spec, Carriers]:
    """``spec`` lifted for tangents entering at ``wrt`` (inputs and nodes; the nodes they reach
    checked), and where they enter."""
    with_rules(make_plan(spec, outputs, wrt), forward=True)
    taken = set(spec.nodes) | set(spec.inputs)
    added = {}
    for n in (w for w in wrt if w in spec.nodes):
        name = f"{n}.tangent"
        while name in taken:
            name += "'"
        taken.add(name)
        added[n] = name
    where = Carriers(tuple(w for w in wrt if w not in spec.nodes), added)
    return lift(spec, set(where.inputs), added, directions, chunk), where


def paired(lowered: Lowered, values: dict, tangents: Any, directions: bool = False) -> dict:
    """A lifted call's input values: each input carrying tangents as a ``Pair`` of its value
    and flat tangent (zeros where none is given), each node's added tangent, the other inputs
    as they are. ``directions``: each tangent has a leading axis of directions."""
    where: Carriers = lowered.extra
    nodes: dict = {}
    if where.added:
        if not isinstance(tangents, Mapping):
            raise DAGError(f"wrt names node(s) {list(where.added)}: pass the tangents as a dict "
                           f"{{name: tangent}} with an entry for each node that moves")
        nodes = {n: tuple(jax.tree.leaves(t)) for n, t in tangents.items()
                 if n in where.added and t is not None}
        tangents = {i: t for i, t in tangents.items() if i not in where.added}
    flat, k = (input_tangents(lowered.spec, values, tangents, directions)
               if not (isinstance(tangents, Mapping) and not tangents)  # (nodes' alone)
               else ({}, leading_axis(nodes) if directions else None))
    out = dict(values)
    for i in where.inputs:
        if i in values:
            out[i] = Pair(values[i], flat.get(i) or zeros(values[i], k))
    for n, name in where.added.items():
        out[name] = nodes.get(n, ())
    return out


@dataclass(frozen=True)
class JVPs(Derivative):
    """[`compute_jvps`][daskdag.compute_jvps] as a kind; ``batched``: tangents of directions."""

    batched: bool = False
    call = "compute_jvps"
    sweep_call = "sweep_jvps"
    call_mode = "fwd"
    takes_data = True

    def options(self, data: tuple) -> tuple:
        (tangents,) = data
        return bool(self.batched), frozenset(i for i, t in tangents.items() if t is not None) \
            if isinstance(tangents, Mapping) else None

    def moving(self, spec: Spec, values: dict, tangents: Any) -> tuple[str, ...]:
        """The names whose tangents count: ``wrt``, or the inputs given tangents (not None)."""
        if self.wrt is not None:
            return wrt_names(spec, values, self.wrt, candidates=values)
        if len(spec.inputs) == 1 or not isinstance(tangents, Mapping):
            return spec.inputs if len(spec.inputs) == 1 else ()
        return tuple(i for i, t in tangents.items() if i in values and t is not None)

    def lower(self, spec, outputs, values, data, candidates, watch) -> Lowered:
        (tangents,) = data
        wrt = self.moving(spec, values, tangents)
        lifted_spec, where = lifted(spec, outputs, wrt, bool(self.batched))
        return Lowered(make_plan(lifted_spec, outputs, ()), where.given(values), spec, wrt,
                        where.moving, extra=where)

    def inputs(self, lowered, values, data, batched=None) -> tuple[dict, dict]:
        if batched is not None and self.batched:
            raise DAGError("a sweep pushes one tangent per item (batched=False): for several "
                           "directions per item, sweep_jacobians(mode='fwd')")
        return paired(lowered, values, data[0], bool(self.batched)), {}

    def info(self, lowered, data, why, where) -> CallInfo:
        (tangents,) = data
        k = leading_axis(tangents) if self.batched else None
        return CallInfo(self.call, self.call_mode, k or 1, prepared=why is None, why=why,
                        where=where)

    def finish(self, lowered, info, computed, failed=None) -> Any:
        k = info.passes if self.batched else None
        return per_output(self.outputs, {o: JVPResult(*unpaired(value, k), info, failed or {})
                                         for o, (value, _) in computed.items()})


def leading_axis(tree: Any) -> int | None:
    """The length of the leading axis of ``tree``'s leaves (batched tangents' directions, a
    sweep's items), or None where it has no leaf."""
    return next((int(np.shape(leaf)[0]) for leaf in jax.tree.leaves(tree)), None)


def unpaired(value: Any, k: int | None) -> tuple[Any, Any]:
    """An output's value and tangent (zeros, ``k`` directions, where none reached it)."""
    if isinstance(value, Pair):
        return value.primal, on_differentiable(value.primal, value.tangent)
    return value, on_differentiable(value, zeros(value, k))
