"""Gradients, and the results every kind but JVPs and HVPs returns (:class:`Result`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from daskdag.errors import NodeError
from daskdag.model.leaves import PyTree, result_pytree
from daskdag.model.plan import make_plan
from daskdag.model.request import alone, cotangents_for, with_rules, wrt_names
from daskdag.running.jobs import CallInfo
from daskdag.running.passes import Derivative, Lowered
from daskdag.transport.protocol import travels, tree_size


@result_pytree("value", "grad")
@travels(lambda r: tree_size((r.value, r.grad)))
@dataclass(frozen=True, repr=False)
class Result:
    """One output's ``value`` and ``grad``, from [`compute_grads`][daskdag.compute_grads],
    [`jacobian`][daskdag.jacobian] or their sweeps. A JAX pytree of ``value`` and ``grad``
    (``failed`` and ``info`` ride along as auxiliary data): ``jax.block_until_ready(results)``
    waits for every array of a call's results, ``jax.device_get`` brings them to the host.

    Attributes:
        value: the output's value; from a sweep, stacked over the items.
        grad: shaped like ``x`` when the DAG has one free input, else a dict ``{input: grad}``
            over the differentiated inputs (for a Jacobian, ``jax.jacrev``'s layout); from a
            sweep, stacked over the items.
        failed: from a sweep with ``errors='collect'``, each item that failed and its
            [`NodeError`][daskdag.NodeError]; its rows hold NaN. Empty otherwise.
        info: how the call was computed ([`CallInfo`][daskdag.CallInfo]: mode, passes,
            whether an earlier call's preparation served it).
    """

    value: Any
    grad: Any
    failed: Mapping[int, NodeError] = field(default_factory=dict)
    info: CallInfo | None = None

    def __repr__(self) -> str:
        failed = f", failed={dict(self.failed)!r}" if self.failed else ""
        return f"Result(value={self.value!r}, grad={self.grad!r}{failed}, info={self.info!r})"


def per_output(outputs: str | Sequence[str], results: dict) -> Any:
    """``results`` (``{output: result}``) as a call returns them: one for a single output name."""
    return results[outputs] if isinstance(outputs, str) else results


@dataclass(frozen=True)
class Gradients(Derivative):
    """[`compute_grads`][daskdag.compute_grads] as a kind, from the outputs' ``cotangents``."""

    cotangents: Mapping[str, PyTree] | None = None
    call = "compute_grads"
    sweep_call = "sweep_grads"
    call_mode = "rev"
    rearranges = True

    def lower(self, spec, outputs, values, data, candidates, watch) -> Lowered:
        wrt = wrt_names(spec, values, self.wrt, candidates=candidates)
        cotangents_for(outputs, self.cotangents)
        return Lowered(with_rules(make_plan(spec, outputs, wrt)), tuple(values), spec, wrt)

    def inputs(self, lowered, values, data, batched=None) -> tuple[dict, dict]:
        return values, cotangents_for(lowered.plan.outputs, self.cotangents)

    def finish(self, lowered, info, computed, failed=None) -> Any:
        return per_output(self.outputs, {o: Result(v, alone(lowered.spec, g), failed or {}, info)
                                         for o, (v, g) in computed.items()})
