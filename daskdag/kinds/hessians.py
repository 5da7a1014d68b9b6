"""Hessian-vector products, reverse over forward: the DAG is lifted where ``v`` enters and its
reverse pass seeded with ``(0, ct)`` at each output. The gradient at an input's pair ``(x, v)``
is ``(H v, g)``, so one backward pass gives both, and the backward graph stays as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from daskdag.errors import DAGError, NodeError
from daskdag.model.leaves import on_differentiable, result_pytree
from daskdag.model.plan import make_plan
from daskdag.model.request import alone, cotangents_for
from daskdag.rules.lifted import Lift, OnTangent
from daskdag.rules.vjp import has_rules
from daskdag.running.jobs import CallInfo
from daskdag.running.passes import Lowered
from daskdag.kinds.gradients import Gradients, per_output
from daskdag.kinds.tangents import lifted, paired, unpaired
from daskdag.transport.protocol import travels, tree_size


@result_pytree("value", "grad", "hvp", "tangent")
@travels(lambda r: tree_size((r.value, r.grad, r.hvp)))
@dataclass(frozen=True)
class HVPResult:
    """One output's value, gradient and Hessian-vector product, from
    [`compute_hvps`][daskdag.compute_hvps] or [`sweep_hvps`][daskdag.sweep_hvps].

    Attributes:
        value: the output's value.
        grad: its gradient (of ``<ct, output>`` for a cotangent ``ct``), shaped like ``x`` with
            one free input, else a dict ``{input: ...}``.
        hvp: its Hessian times ``v``, shaped as ``grad``.
        tangent: its Jacobian-vector product along the same ``v``, in the output's structure (zeros
            where no ``wrt`` input reaches it, as [`compute_jvps`][daskdag.compute_jvps] gives).
        info: how the call was computed ([`CallInfo`][daskdag.CallInfo]).
        failed: as [`Result`][daskdag.Result]'s ``failed``.

    From a sweep, each is stacked over the items. A JAX pytree of ``value``, ``grad``, ``hvp``
    and ``tangent``, as [`Result`][daskdag.Result] is of its arrays.
    """

    value: Any
    grad: Any
    hvp: Any
    tangent: Any
    info: CallInfo | None = None
    failed: Mapping[int, NodeError] = field(default_factory=dict)


@dataclass(frozen=True)
class HVPs(Gradients):
    """[`compute_hvps`][daskdag.compute_hvps] as a kind; a call's data, its direction ``v``."""

    call = "compute_hvps"
    sweep_call = "sweep_hvps"
    call_mode = "rev-over-fwd"
    takes_data = True

    def lower(self, spec, outputs, values, data, candidates, watch) -> Lowered:
        plan = super().lower(spec, outputs, values, data, candidates, watch).plan
        own = [n for n in plan.needed if n in plan.active and has_rules(spec.nodes[n])]
        if own:
            raise DAGError(f"node(s) {own} have their own derivative rules (vjp=, fwd=/bwd=): a "
                           f"Hessian-vector product needs the derivative of their VJP, which "
                           f"those rules do not give; write them in JAX, or leave out of wrt "
                           f"the inputs they depend on")
        lifted_spec, where = lifted(spec, outputs, plan.wrt)
        return Lowered(make_plan(lifted_spec, outputs, plan.wrt), where.given(values), spec,
                        plan.wrt, where.moving, extra=where)

    def inputs(self, lowered, values, data, batched=None) -> tuple[dict, dict]:
        cts = cotangents_for(lowered.plan.outputs, self.cotangents)
        seeds = {o: OnTangent(cts.get(o)) if isinstance(lowered.plan.spec.nodes[o].fn, Lift)
                 else cts.get(o) for o in lowered.plan.outputs}  # (where a tangent reaches it)
        return paired(lowered, values, data[0]), seeds

    def finish(self, lowered, info, computed, failed=None) -> Any:
        results = {}
        for o, (value, pairs) in computed.items():
            hvp = alone(lowered.spec, {i: g.primal for i, g in pairs.items()})
            grad = alone(lowered.spec, {i: on_differentiable(g.primal, g.tangent)
                                        for i, g in pairs.items()})
            value, tangent = unpaired(value, None)
            results[o] = HVPResult(value, grad, hvp, tangent, info, failed or {})
        return per_output(self.outputs, results)
