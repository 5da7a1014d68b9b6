"""Forward mode: :func:`compute_jvps` (Jacobian-vector products, values and tangents pushed
forward together, :mod:`daskdag.graph.forward`), its lazy form :func:`jvps`, and
:class:`JVPResult`."""

from __future__ import annotations

import os

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, overload


from daskdag.api import entries, input_values, names_key, watched
from daskdag.durable import calls as durable
from daskdag.graph import forward as jvp_graph
from daskdag.graph.stages import Stage, stages_for
from daskdag.model.leaves import PyTree
from daskdag.model.plan import Plan, make_plan, ship
from daskdag.model.request import input_tangents, parsed, with_rules
from daskdag.running import programs
from daskdag.running.compute import where
from daskdag.running.jobs import CallInfo, Job, call, lazy
from daskdag.running.lazy import Call
from daskdag.running.local import Template, slot
from daskdag.running.programs import Program
from daskdag.transport.transports import Transport

if TYPE_CHECKING:
    from distributed import Client
    from zarr.abc.store import Store as ZarrStore


@dataclass(frozen=True)
class JVPResult:
    """One output's ``value`` and ``tangent``, from [`compute_jvps`][daskdag.compute_jvps].

    Attributes:
        value: the output's value.
        tangent: its Jacobian-vector product, in the output's structure, ``None`` at the leaves
            held constant (not floating-point), zeros where no tangent reaches it; with
            ``batched=True`` each leaf has a leading axis of directions.
        info: how the call was computed ([`CallInfo`][daskdag.CallInfo]).
    """

    value: Any
    tangent: Any
    info: CallInfo | None = None


@overload  # (a str is a Sequence[str] too: the first that fits, str, wins)
def compute_jvps(dag: Mapping[str, Any], x: PyTree, tangents: PyTree, outputs: str,
                 *, batched: bool = False, client: Client | None = None,
                 scheduler: str | Client | None = None, progress: bool = False,
                 store: str | os.PathLike | ZarrStore | None = None) -> JVPResult: ...


@overload
def compute_jvps(dag: Mapping[str, Any], x: PyTree, tangents: PyTree, outputs: Sequence[str],
                 *, batched: bool = False, client: Client | None = None,
                 scheduler: str | Client | None = None, progress: bool = False,
                 store: str | os.PathLike | ZarrStore | None = None) -> dict[str, JVPResult]: ...


def compute_jvps(dag: Mapping[str, Any], x: PyTree, tangents: PyTree, outputs: str | Sequence[str],
                 *, batched: bool = False, client: Client | None = None,
                 scheduler: str | Client | None = None, progress: bool = False,
                 store: str | os.PathLike | ZarrStore | None = None
                 ) -> JVPResult | dict[str, JVPResult]:
    """Values and Jacobian-vector products (forward mode) of ``outputs`` of ``dag``, each node
    computed once.

    Args:
        dag: as for [`compute_grads`][daskdag.compute_grads].
        x: as for [`compute_grads`][daskdag.compute_grads].
        outputs: as for [`compute_grads`][daskdag.compute_grads].
        client: as for [`compute_grads`][daskdag.compute_grads].
        scheduler: as for [`compute_grads`][daskdag.compute_grads].
        progress: as for [`compute_grads`][daskdag.compute_grads].
        store: as for [`compute_grads`][daskdag.compute_grads]: each stage's values and
            tangents kept as they finish (forward mode has no residuals to keep); the
            tangents are part of what the store records.
        tangents: with one free input, a pytree shaped like ``x``: the tangent of each floating-point
            leaf (``None`` there means zero), ``None`` at the leaves held constant (ints,
            bools, functions); or ``{input_name: tangent}``, read as ``x`` is. With several
            inputs, a dict ``{input_name: tangent}``; the inputs left out are held constant.
        batched: every tangent leaf has a leading axis of K directions, and so has every
            output's tangent, ``(K, *output shape)``: with the identity as the K directions,
            row ``k`` is the Jacobian's column ``k``, so the whole is the transpose of
            ``jax.jacfwd``'s Jacobian (which puts the output's axes first). Each node's jvp runs
            under ``jax.vmap`` over the directions (its function still runs once); a node
            whose jvp cannot be vmapped (non-JAX code under its own JVP rule) runs once per
            direction.

    Returns:
        ``{output: JVPResult(value, tangent)}`` (a single name: one
            [`JVPResult`][daskdag.JVPResult]); ``tangent`` has the output's structure, ``None`` at
            its leaves held constant, zeros where no tangent reaches it.
            [`jvps`][daskdag.jvps] is the same call, not computed yet.

    Raises:
        DAGError: a malformed call: a tangent whose structure, shape or dtype does not match
            its input (naming it), a tangent for a name that is no input.
        NodeError: a node raised; a node that ``jax.jvp`` cannot differentiate (NumPy code)
            raises there unless it gives its own ``jvp=``.
        ClusterError: as for [`compute_grads`][daskdag.compute_grads].

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    res = daskdag.compute_jvps(dag, jnp.arange(3.0), jnp.ones(3), "B")
    print(res.value, res.tangent)  # the directional derivative along ones
    ```
    """
    client, local = where(client, scheduler)
    if store is not None:
        return durable.call(JVPs(dag, outputs, batched), "compute_jvps", x, tangents,
                            client=client, local=local, progress=progress, store=store)
    return call(JVPs(dag, outputs, batched), x, tangents, client=client, local=local,
                progress=progress)


def jvps(dag: Mapping[str, Any], x: PyTree, tangents: PyTree, outputs: str | Sequence[str], *,
         batched: bool = False) -> Call:
    """[`compute_jvps`][daskdag.compute_jvps], not computed yet: a Dask collection, as [`grads`][daskdag.grads] is.

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    print(daskdag.jvps(dag, jnp.arange(3.0), jnp.ones(3), "B").compute().tangent)
    ```
    """
    return lazy(JVPs(dag, outputs, batched), x, tangents)


@dataclass(frozen=True)
class Pushforward:
    """:func:`compute_jvps` compiled: the plan of the inputs that carry tangents, checked for
    forward mode and packed for its ``transport``, its stages, and for calls in this process
    their graphs (a :class:`~daskdag.running.local.Template` per number of directions, made
    when first needed)."""

    plan: Plan
    stages: tuple[Stage, ...]
    transport: Transport
    templates: dict = field(default_factory=dict, compare=False)

    @classmethod
    def make(cls, dag: Mapping[str, Any], x: PyTree, tangents: PyTree,
             outputs: str | Sequence[str], batched: bool, transport: Transport,
             watch: programs.Watch) -> Pushforward:
        spec, names, values = parsed(dag, x, outputs, watch.hold)
        flat, _ = input_tangents(spec, values, tangents, bool(batched))
        plan = with_rules(make_plan(spec, names, tuple(flat)), forward=True)
        plan = ship(plan, transport, watched(plan, transport, watch))
        return cls(plan, stages_for(plan, transport.packs), transport)


@dataclass(frozen=True)
class JVPs:
    """:func:`compute_jvps` as a kind of call (:class:`~daskdag.running.jobs.Kind`): its
    program is a :class:`Pushforward`; a call's data, its tangents."""

    dag: Mapping[str, Any]
    outputs: str | Sequence[str]
    batched: bool

    def compile(self, x: PyTree, data: tuple, transport: Transport
                ) -> tuple[Program[Pushforward], str | None]:
        (tangents,) = data
        return programs.compile(
            "jvps", self.dag, x, (names_key(self.outputs), tuple(tangents) if isinstance(
                tangents, Mapping) else None, bool(self.batched), transport),
            partial(Pushforward.make, self.dag, x, tangents, self.outputs, self.batched,
                    transport))

    def job(self, program: Program[Pushforward], x: PyTree, data: tuple, why: str | None,
            where: str) -> Job:
        (tangents,) = data
        made = program.value
        plan = made.plan
        values = input_values(plan.spec, x)
        flat, k = input_tangents(plan.spec, values, tangents, bool(self.batched))
        info = CallInfo("compute_jvps", "fwd", k or 1, prepared=why is None, why=why,
                        where=where)

        def make(place: Any, stop: Any) -> Any:
            if made.transport.packs:
                return jvp_graph.build(plan, values, flat, made.transport, k, place=place,
                                       stop=stop, stages=made.stages)
            template = made.templates.get(k)
            if template is None:
                template = made.templates[k] = Template(jvp_graph.build(
                    plan, {i: slot("input", i) for i in values},
                    {i: slot("tangent", i) for i in flat}, made.transport, k,
                    stop=slot("stop"), stages=made.stages))
            return template.fill({**{slot("input", i): v for i, v in values.items()},
                                  **{slot("tangent", i): t for i, t in flat.items()},
                                  slot("stop"): stop})

        def stored(place: Any, stop: Any, keeper: Any) -> Any:
            return jvp_graph.build(plan, values, flat, made.transport, k, place=place,
                                   stop=stop, stages=made.stages, keep=keeper)

        return Job(plan, make, partial(_jvp_results, self.outputs, info), "compute_jvps",
                   keep=entries(self.dag), stored=stored)


def _jvp_results(outputs: str | Sequence[str], info: CallInfo, computed: dict[str, Any]
                 ) -> JVPResult | dict[str, JVPResult]:
    results = {o: JVPResult(v, t[jvp_graph.TANGENT], info) for o, (v, t) in computed.items()}
    return results[outputs] if isinstance(outputs, str) else results
