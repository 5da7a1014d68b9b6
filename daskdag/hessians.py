"""Hessian-vector products: :func:`compute_hvps` and its lazy form :func:`hvps`.

Each node is lifted to its forward-mode pair, ``(x, dx) -> (f(x), J(x) dx)`` (``jax.jvp``, as
:func:`daskdag.rules.jvp.jvp_leaves`), and the lifted DAG goes through the reverse-mode graph of
:func:`daskdag.compute_grads` seeded with ``(0, ct)`` at each output: reverse over forward. The
gradient it gives at an input's pair ``(x, v)`` is ``(H v, g)``: the derivative of ``<ct, J v>``
by ``x`` is the Hessian of ``<ct, f>`` times ``v``, and by ``v`` it is ``J^T ct``, the gradient
itself. So one backward pass gives both, each node runs once (its jvp, under ``jax.vjp`` in its
forward task), and its residuals travel between workers as any pullback's do.

This is the same product as forward over reverse (``jax.jvp`` of ``jax.grad``): the Hessian is
symmetric. Reverse over forward keeps the backward graph as it is; a JVP of the backward graph
would need the tangents of every residual to travel with it, or each node recomputed in its
backward task.
"""

from __future__ import annotations

import os

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, overload

import jax
import jax.numpy as jnp

from daskdag.api import Gradients, entries, input_values, names_key
from daskdag.durable import calls as durable
from daskdag.transport.transports import Transport
from daskdag.errors import DAGError
from daskdag.model.leaves import PyTree, differentiable_leaves, on_differentiable
from daskdag.model.plan import Plan, make_plan
from daskdag.model.request import (cotangents_for, input_tangents, nodes_in_wrt, parsed,
                                   wrt_names)
from daskdag.model.spec import Node
from daskdag.rules.jvp import jvp_leaves
from daskdag.rules.registry import has_rules
from daskdag.rules.seeds import seed
from daskdag.running import programs
from daskdag.running.compute import where
from daskdag.running.jobs import CallInfo, Job, call, lazy
from daskdag.running.lazy import Call
from daskdag.running.programs import Program

if TYPE_CHECKING:
    from distributed import Client
    from zarr.abc.store import Store as ZarrStore

    from daskdag.model.spec import Spec


@dataclass(frozen=True)
class HVPResult:
    """One output's value, gradient and Hessian-vector product, from
    [`compute_hvps`][daskdag.compute_hvps].

    Attributes:
        value: the output's value.
        grad: its gradient (of ``<ct, output>`` for a cotangent ``ct``), shaped like ``x`` with
            one free input, else a dict ``{input: ...}``.
        hvp: its Hessian times ``v``, shaped as ``grad``.
        tangent: its Jacobian-vector product along the same ``v``, in the output's structure
            (zeros where no ``wrt`` input reaches it, as [`compute_jvps`][daskdag.compute_jvps]
            gives).
        info: how the call was computed ([`CallInfo`][daskdag.CallInfo]).
    """

    value: Any
    grad: Any
    hvp: Any
    tangent: Any
    info: CallInfo | None = None


@overload  # (a str is a Sequence[str] too: the first that fits, str, wins)
def compute_hvps(dag: Mapping[str, Any], x: PyTree, v: PyTree, outputs: str, *,
                 wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
                 client: Client | None = None, scheduler: str | Client | None = None,
                 progress: bool = False, store: str | os.PathLike | ZarrStore | None = None) -> HVPResult: ...


@overload
def compute_hvps(dag: Mapping[str, Any], x: PyTree, v: PyTree, outputs: Sequence[str], *,
                 wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
                 client: Client | None = None, scheduler: str | Client | None = None,
                 progress: bool = False,
                 store: str | os.PathLike | ZarrStore | None = None) -> dict[str, HVPResult]: ...


def compute_hvps(dag: Mapping[str, Any], x: PyTree, v: PyTree, outputs: str | Sequence[str], *,
                 wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
                 client: Client | None = None, scheduler: str | Client | None = None,
                 progress: bool = False, store: str | os.PathLike | ZarrStore | None = None
                 ) -> HVPResult | dict[str, HVPResult]:
    """Values, gradients and Hessian-vector products of ``outputs`` of ``dag``, each node
    computed once: ``jax.jvp(jax.grad(f), (x,), (v,))`` of the composed function, in one
    backward pass (reverse over forward, see ``daskdag.hessians``).

    Args:
        dag: as for [`compute_grads`][daskdag.compute_grads].
        x: as for [`compute_grads`][daskdag.compute_grads].
        v: the vector, as ``tangents`` of [`compute_jvps`][daskdag.compute_jvps]: with one free
            input a pytree shaped like ``x`` (``None`` at the leaves held constant), else a
            dict ``{input: v}``; the inputs left out move by zero. An input outside ``wrt`` is
            held constant, so its part of ``v`` is ignored: ``hvp`` is the Hessian over the
            ``wrt`` inputs times ``v``'s part on them.
        outputs: as for [`compute_grads`][daskdag.compute_grads].
        wrt: as for [`compute_grads`][daskdag.compute_grads]: free inputs only.
        cotangents: as for [`compute_grads`][daskdag.compute_grads]; then ``hvp`` is the Hessian of
            ``<ct, output>`` times ``v``.
        client: as for [`compute_grads`][daskdag.compute_grads].
        scheduler: as for [`compute_grads`][daskdag.compute_grads].
        progress: as for [`compute_grads`][daskdag.compute_grads].
        store: as for [`compute_grads`][daskdag.compute_grads]: each stage's forward result
            (values and tangents, and the residuals of their backward pass) kept as it
            finishes; ``v`` is part of what the store records.

    Returns:
        ``{output: HVPResult(value, grad, hvp, tangent)}`` (a single name: one
            [`HVPResult`][daskdag.HVPResult]). Each node runs under ``jax.jvp`` inside
            ``jax.vjp``, so it must be twice differentiable by JAX.
            [`hvps`][daskdag.hvps] is the same call, not computed yet.

    Raises:
        DAGError: as for [`compute_grads`][daskdag.compute_grads]; also a node with its own
            derivative rules (``vjp=``, ``fwd=`` / ``bwd=``: NumPy code) on the way, naming it.
        NodeError: a node raised; a ``jax.custom_vjp`` function inside a node fails here (JAX
            has no forward mode for it).
        ClusterError: as for [`compute_grads`][daskdag.compute_grads].

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    res = daskdag.compute_hvps(dag, jnp.arange(3.0), jnp.ones(3), "B")
    print(res.grad, res.hvp)  # sin(2x), 2 cos(2x) * 1
    ```
    """
    client, local = where(client, scheduler)
    if store is not None:
        return durable.call(HVPs(dag, outputs, wrt, cotangents), "compute_hvps", x, v,
                            client=client, local=local, progress=progress, store=store)
    return call(HVPs(dag, outputs, wrt, cotangents), x, v, client=client, local=local,
                progress=progress)


def hvps(dag: Mapping[str, Any], x: PyTree, v: PyTree, outputs: str | Sequence[str], *,
         wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None) -> Call:
    """[`compute_hvps`][daskdag.compute_hvps], not computed yet: a Dask collection, as [`grads`][daskdag.grads] is.

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    print(daskdag.hvps(dag, jnp.arange(3.0), jnp.ones(3), "B").compute().hvp)
    ```
    """
    return lazy(HVPs(dag, outputs, wrt, cotangents), x, v)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Pair:
    """A lifted value: the ``primal`` and its ``tangent`` (a flat tuple over its differentiable
    leaves, :mod:`daskdag.model.leaves`)."""

    primal: Any
    tangent: tuple


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class OnTangent:
    """An output's cotangent ``ct`` (None: 1 for a real scalar), seeded on its tangent alone.
    (Never None itself, so no stage takes it for a plain scalar's seed of 1 everywhere.)"""

    ct: Any = None


@seed.register
def _(value: Pair, output: str, ct: OnTangent, batched: bool = False) -> tuple:
    # (0, ct): the output's tangent is seeded, its value not (see the module's docstring).
    zeros = tuple(jnp.zeros_like(leaf) for leaf in differentiable_leaves(value.primal))
    return zeros + seed(value.primal, output, ct.ct, batched)


def lifted(fn: Callable[..., Any], active: tuple[bool, ...], *args: Any) -> Pair:
    """A node's function on lifted deps (``Pair`` where ``active``): its value and its JVP."""
    primals = [a.primal if on else a for a, on in zip(args, active)]
    tangents = [a.tangent if on else None for a, on in zip(args, active)]
    primal, tangent = jvp_leaves(fn, primals, tangents, active)
    return Pair(primal, tangent)


@dataclass(frozen=True)
class HVPs:
    """:func:`compute_hvps` as a kind of call (:class:`~daskdag.running.jobs.Kind`): its
    program is a :class:`Lifted`; a call's data, its direction ``v``."""

    dag: Mapping[str, Any]
    outputs: str | Sequence[str]
    wrt: Sequence[str] | None
    cotangents: Mapping[str, PyTree] | None

    def compile(self, x: PyTree, data: tuple, transport: Transport
                ) -> tuple[Program[Lifted], str | None]:
        return programs.compile(
            "hvps", self.dag, x, (names_key(self.outputs), names_key(self.wrt), transport),
            partial(Lifted.make, self.dag, x, self.outputs, self.wrt, self.cotangents,
                    transport))

    def job(self, program: Program[Lifted], x: PyTree, data: tuple, why: str | None,
            where: str) -> Job:
        (v,) = data
        made, outputs = program.value, self.outputs
        spec, plan = made.spec, made.plan
        values = input_values(spec, x)
        cts = cotangents_for(plan.outputs, self.cotangents)
        given, _ = input_tangents(spec, values, v, batched=False)
        pairs = {i: Pair(values[i], given.get(i) or tuple(
            jnp.zeros_like(leaf) for leaf in differentiable_leaves(values[i])))
            for i in plan.wrt}
        lifted_x = ({**values, **pairs} if len(spec.inputs) > 1 else
                    pairs.get(spec.inputs[0], values[spec.inputs[0]]))
        info = CallInfo("compute_hvps", "rev-over-fwd", len(plan.outputs), prepared=why is None,
                        why=why, where=where)
        job = made.gradients.job(lifted_x, _seeds(plan, cts), info, outputs)
        direct = job.direct

        def directly() -> Any:
            result = direct() if direct is not None else None
            return None if result is None else _results(spec, outputs, result)

        return Job(job.plan, job.make,
                   lambda computed: _results(spec, outputs, job.finish(computed)),
                   "compute_hvps", keep=entries(self.dag),
                   direct=directly if direct is not None else None, stored=job.stored)


@dataclass(frozen=True)
class Lifted:
    """:func:`compute_hvps` compiled: the user's spec and plan, and the lifted DAG's
    :class:`~daskdag.api.Gradients`, each node's function lifted once."""

    spec: Spec
    plan: Plan
    gradients: Gradients

    @classmethod
    def make(cls, dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str],
             wrt: Sequence[str] | None, cotangents: Mapping[str, PyTree] | None,
             transport: Transport, watch: programs.Watch) -> Lifted:
        spec, names, values = parsed(dag, x, outputs, watch.hold)
        wrt = wrt_names(spec, values, wrt, candidates=values)
        refused = nodes_in_wrt(spec, wrt, "compute_hvps differentiates")
        if refused:
            raise DAGError(refused)
        plan = make_plan(spec, names, wrt)
        own = [n for n in plan.needed if n in plan.active and has_rules(spec.nodes[n])]
        if own:
            raise DAGError(f"node(s) {own} have their own derivative rules (vjp=, fwd=/bwd=): a "
                           f"Hessian-vector product needs the derivative of their VJP, which "
                           f"those rules do not give; write them in JAX, or leave out of wrt "
                           f"the inputs they depend on")
        cotangents_for(names, cotangents)
        pairs = {i: Pair(values[i], tuple(jnp.zeros_like(leaf)
                                          for leaf in differentiable_leaves(values[i])))
                 for i in wrt}
        lifted_dag = {}
        for n in spec.order:  # (every node, so that the lifted DAG has the same free inputs)
            node = spec.nodes[n]
            if n in plan.active:
                active = tuple(d in pairs or d in plan.active for d in node.deps)
                node = Node(partial(lifted, node.fn, active),  # type: ignore[arg-type]
                            node.deps, jit=node.jit, device=node.device,
                            resources=node.resources, remat=node.remat)
            lifted_dag[n] = node
        lifted_x = ({**values, **pairs} if len(spec.inputs) > 1 else
                    pairs.get(spec.inputs[0], values[spec.inputs[0]]))
        return cls(spec, plan, Gradients.make(lifted_dag, lifted_x, outputs, list(wrt),
                                              _seeds(plan, {}), transport, watch, hold=False))


def _seeds(plan: Plan, cotangents: Mapping[str, Any]) -> dict[str, Any]:
    """The lifted DAG's cotangents: ``(0, ct)`` at each output that moves with ``v``."""
    return {o: OnTangent(cotangents.get(o)) if o in plan.active else cotangents.get(o)
            for o in plan.outputs}


def _results(spec: Spec, outputs: str | Sequence[str], computed: Any
             ) -> HVPResult | dict[str, HVPResult]:
    """:class:`HVPResult` s from compute_grads' results on the lifted DAG."""
    per_output = {outputs: computed} if isinstance(outputs, str) else computed
    results = {}
    for o, r in per_output.items():
        one = len(spec.inputs) == 1 and isinstance(r.grad, Pair)
        grads = {spec.inputs[0]: r.grad} if one else r.grad
        hvp = {i: g.primal for i, g in grads.items()}
        grad = {i: on_differentiable(g.primal, g.tangent) for i, g in grads.items()}
        if isinstance(r.value, Pair):
            value, tangent = r.value.primal, on_differentiable(r.value.primal, r.value.tangent)
        else:  # no differentiated input reaches the output: its tangent is zeros
            value = r.value
            tangent = on_differentiable(value, [jnp.zeros_like(leaf)
                                                for leaf in differentiable_leaves(value)])
        i0 = spec.inputs[0]
        results[o] = HVPResult(value, grad[i0] if one else grad, hvp[i0] if one else hvp, tangent,
                               r.info)
    return results[outputs] if isinstance(outputs, str) else results
