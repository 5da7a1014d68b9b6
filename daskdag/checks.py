"""Derivatives checked against central finite differences: every node's VJP against the node
alone (:func:`check_grads`), and the outputs' gradients against the whole DAG
(:func:`check_totals`), as OpenMDAO's ``check_partials`` and ``check_totals``.

Each node a gradient passes through is checked by one task, which also gives its value to the
nodes after it (one Dask graph; other nodes run plainly): the node linearized once, then per
projection a random unit cotangent ``u`` pulled back, and per active dep a random tangent ``v``
(leaves of about their RMS magnitude); ``fd = <u, J v>`` by central differences at ``x +- eps
v`` (perturbed in each leaf's dtype, ``v`` taken as the perturbation that happened) against
``ad = <VJP(u), v>``, where ``<a, b> = real(sum(conj(a) * b))``.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np

from daskdag.api import compute_grads
from daskdag.errors import DAGError, GradientCheckError, TotalCheckError, node_errors
from daskdag.graph.assembly import Intake, TaskGraph, ident, key, token_of
from daskdag.transport import transports
from daskdag.transport.transports import Transport
from daskdag.model import devices
from daskdag.model.plan import make_plan, ship
from daskdag.model.leaves import PyTree, differentiable_leaves, on_differentiable
from daskdag.rules.finite_differences import (PROJECTIONS, ROUNDING, check_node, compare,
                                              dtype_of, inner, magnitude, perturbed, unit, wide)
from daskdag.model.request import nodes_in_wrt, prepare
from daskdag.running.programs import where
from daskdag.running.jobs import GraphJob, run

if TYPE_CHECKING:
    from distributed import Client
    from daskdag.model.plan import Plan
    from daskdag.model.spec import Node


def check_grads(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
                wrt: Sequence[str] | None = None, eps: float | None = None,
                rtol: float | None = None, client: Client | None = None,
                scheduler: str | Client | None = None) -> dict[str, float]:
    """Check the VJP of every node on the way from the differentiated inputs to ``outputs``
    against central finite differences of that node alone, at the point the forward pass reached.
    ``dag``, ``x``, ``outputs``, ``wrt``, ``client`` and ``scheduler`` are as for
    [`daskdag.compute_grads`][daskdag.compute_grads].

    Args:
        eps: the finite-difference step, relative: each element of a leaf moves by about ``eps``
            times the leaf's RMS magnitude (1 for an all-zero leaf), in a random direction.
            Default ``cbrt(finfo.eps)`` of the lowest precision among the node's differentiated
            and output leaves, balancing truncation (``eps**2``) against rounding
            (``finfo.eps / eps``): 4.9e-3 for float32, 6.1e-6 for float64.
        rtol: default ``2 * cbrt(finfo.eps)`` (9.8e-3 for float32, 1.2e-5 for float64): a
            margin of ``finfo.eps ** (-1/3)`` over the accuracy of a central difference at that
            step (``finfo.eps ** (2/3)``), while a VJP off by a few percent (float64) or by a
            factor (float32) fails.

    A projection passes when ``|fd - ad| <= rtol * scale + noise``, where ``scale = max(|fd|,
    |ad|, ||J v|| / sqrt(n))`` (``n``: the output's real degrees of freedom, so that a large
    output hides no wrong VJP) and ``noise = ROUNDING * finfo.eps / eps * sqrt(sum |u_i
    f_i|^2)``, what rounding the node's outputs ``f`` adds to ``fd``.

    Returns:
        ``{node: relative error}``, for each node checked the largest ``|fd - ad| / (scale +
            noise / rtol)`` over its deps and projections, so at most ``rtol`` where it passed.

    Raises:
        GradientCheckError: the first node in topological order whose VJP disagrees (after
            checking all of them; the error names the others that failed).
        NodeError: a node raised.
        DAGError: as for [`compute_grads`][daskdag.compute_grads].
        ClusterError: as for [`compute_grads`][daskdag.compute_grads].

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    print(daskdag.check_grads(dag, jnp.arange(3.0), "B"))  # {node: relative error}, each <= rtol
    ```
    """
    client, local = where(client, scheduler)
    request = prepare(dag, x, outputs, wrt)
    plan, spec = request.plan, request.spec
    on_path = {n for o in plan.outputs for n in plan.backward[o]}
    checked = [n for n in spec.order if n in on_path]
    if not checked:
        return {}
    transport = transports.for_call(client)
    forward = ship(make_plan(spec, plan.needed, ()), transport)
    graph = partial(_graph, plan, forward, request.values, checked, eps, rtol, transport)
    found = run(GraphJob(forward, graph, "check_grads"), client, local, False)
    failed = [n for n in checked if found[n][0][1]]
    if failed:
        first = found[failed[0]][0][1]
        dep = spec.nodes[failed[0]].deps[first["position"]]
        raise GradientCheckError(failed[0], dep, others=tuple(failed[1:]), **first)
    return {n: found[n][0][0] for n in checked}


def check_totals(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
                 wrt: Sequence[str] | None = None, eps: float | None = None,
                 rtol: float | None = None, client: Client | None = None,
                 scheduler: str | Client | None = None) -> dict[str, float]:
    """Check the gradients of whole ``outputs`` (what [`compute_grads`][daskdag.compute_grads]
    gives) against central finite differences of the composed DAG, as OpenMDAO's
    ``check_totals``. ``dag``, ``x``, ``client`` and ``scheduler`` are as for
    [`compute_grads`][daskdag.compute_grads].

    Args:
        outputs: as for [`compute_grads`][daskdag.compute_grads]; any real or complex arrays
            or pytrees.
        wrt: as for [`compute_grads`][daskdag.compute_grads]: free inputs only.
        eps: as for [`check_grads`][daskdag.check_grads]; its default by the lowest precision
            among the differentiated inputs' leaves.
        rtol: as for [`check_grads`][daskdag.check_grads]; its default by the lowest precision
            among the differentiated inputs' leaves and the outputs' leaves.

    Per projection, ``<u, J v>`` by central differences, for a random unit cotangent ``u`` of
    each output and tangent ``v`` of each input, against ``<J^T u, v>`` from ``compute_grads``
    seeded with ``u``, compared as [`check_grads`][daskdag.check_grads] does: the DAG runs
    ``1 + 2 * PROJECTIONS * len(wrt)`` times plainly and ``PROJECTIONS`` times differentiated.

    Returns:
        ``{output: its largest relative error}`` over inputs and projections (at most
            ``rtol`` where it passed).

    Raises:
        TotalCheckError: (a [`GradientCheckError`][daskdag.GradientCheckError]) naming the
            first output and input that disagree, and the other pairs that failed.
        NodeError, DAGError, ClusterError: as for [`check_grads`][daskdag.check_grads].

    For example, on the DAG of [`check_grads`][daskdag.check_grads]'s example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    print(daskdag.check_totals(dag, jnp.arange(3.0), "B"))  # {output: relative error}
    ```
    """
    client, local = where(client, scheduler)
    request = prepare(dag, x, outputs, wrt)
    plan, spec, values = request.plan, request.spec, request.values
    refused = nodes_in_wrt(spec, plan.wrt, "check_totals perturbs")
    if refused:
        raise DAGError(refused)
    rng = np.random.default_rng(0)
    leaves = {i: differentiable_leaves(values[i]) for i in plan.wrt}
    machine = max(float(jnp.finfo(dtype_of(leaf)).eps) for ls in leaves.values() for leaf in ls)
    step = float(eps) if eps is not None else machine ** (1 / 3)
    moves: list[dict]
    points, moves = [values], []  # the point, then x -/+ eps v per projection and input
    for _ in range(PROJECTIONS):
        moves.append({})
        for i in plan.wrt:
            size = np.sqrt(sum(np.size(leaf) for leaf in leaves[i]))
            v = [t * size * magnitude(leaf) for t, leaf in zip(unit(rng, leaves[i]), leaves[i])]
            plus, minus, moves[-1][i] = perturbed(values[i], v, step)
            points += [{**values, i: minus}, {**values, i: plus}]
    transport = transports.for_call(client)
    forward = ship(make_plan(spec, plan.outputs, ()), transport)
    evaluated = run(GraphJob(forward, partial(_points_graph, forward, points, transport),
                             "check_totals"), client, local, False)
    at = [{o: differentiable_leaves(evaluated[f"{e}:{o}"][0]) for o in plan.outputs}
          for e in range(len(points))]
    machine = max([machine] + [float(jnp.finfo(dtype_of(leaf)).eps) for ls in at[0].values()
                               for leaf in ls])
    rtol = float(rtol) if rtol is not None else 2 * machine ** (1 / 3)
    worst = {o: 0.0 for o in plan.outputs}
    failures: dict = {}
    for p in range(PROJECTIONS):
        cts = {o: on_differentiable(evaluated[f"0:{o}"][0], [
            np.conj(u).astype(dtype_of(leaf)) for u, leaf in zip(unit(rng, at[0][o]), at[0][o])])
            for o in plan.outputs}
        grads = compute_grads(dag, x, list(plan.outputs), wrt=list(plan.wrt), cotangents=cts,
                              client=client, scheduler=scheduler)
        for o in plan.outputs:
            u = [np.conj(wide(c)) for c in differentiable_leaves(cts[o])]
            f = [wide(leaf) for leaf in at[0][o]]
            noise = ROUNDING * machine / step * np.sqrt(sum(np.sum(np.abs(a * b) ** 2)
                                                            for a, b in zip(u, f)))
            for k, i in enumerate(plan.wrt):
                e = 1 + 2 * (p * len(plan.wrt) + k)
                jv = [(wide(a) - wide(b)) / (2 * step) for a, b in zip(at[e + 1][o], at[e][o])]
                grad = grads[o].grad if len(spec.inputs) == 1 else grads[o].grad[i]
                ad = inner(moves[p][i], [np.conj(wide(g)) for g in differentiable_leaves(grad)])
                relative, failure = compare(inner(jv, u), ad, jv, f, rtol, noise)
                worst[o] = max(worst[o], float(relative))
                if failure is not None and relative >= failures.get((o, i), (-1,))[0]:
                    failures[(o, i)] = (relative, failure)
    if failures:
        (o, i), (_, failure) = next(iter(failures.items()))
        raise TotalCheckError(o, i, eps=step, others=tuple(list(failures)[1:]), **failure)
    return worst


def _points_graph(forward: Plan, points: list[dict], transport: Transport, place: Any, stop: Any
                  ) -> dict:
    """The DAG evaluated plainly at each of ``points`` (input values): ``{"e:output": value}``."""
    g = TaskGraph()
    intake = Intake(g, transport, place)
    sent = {n: intake.node(n, forward.spec.nodes[n]) for n in forward.needed}
    out: dict = {}
    for e, point in enumerate(points):
        value_of = {i: intake.value("input", i, f"input {i!r}", v) for i, v in point.items()}
        for n in forward.needed:
            node = forward.spec.nodes[n]
            deps = [value_of[d] for d in node.deps]
            k = intake.key("fwd", f"{n}@{e}", ident(sent[n]), [ident(d) for d in deps])
            value_of[n] = g.task(k, dict(node.needs), _value, n, sent[n], *deps)
        out.update({f"{e}:{o}": (value_of[o], {}) for o in forward.outputs})
    return g.delayed(out, intake.call)


def _graph(plan: Plan, forward: Plan, values: dict, checked: Sequence[str], eps: float | None,
           rtol: float | None, transport: Transport, place: Any, stop: Any) -> dict:
    """The graph of the checks, in topological order: a :func:`check_node` task for each
    ``checked`` node, which also gives the node's value to the nodes after it, and a plain task
    (:func:`_value`) for each other needed node."""
    g = TaskGraph()
    intake = Intake(g, transport, place)
    value_of = {i: intake.value("input", i, f"input {i!r}", values[i])
                for i in plan.spec.inputs if i in values}
    checks: dict = {}
    for n in plan.needed:
        node, needs = forward.spec.nodes[n], dict(forward.spec.nodes[n].needs)
        sent = intake.node(n, node)
        deps = [value_of[d] for d in node.deps]
        if n not in checked:
            k = intake.key("fwd", n, ident(sent), [ident(d) for d in deps])
            value_of[n] = g.task(k, needs, _value, n, sent, *deps)
            continue
        active = tuple(d in plan.wrt or d in plan.active for d in node.deps)
        k = intake.key("check", n, ident(sent), active, eps, rtol, [ident(d) for d in deps])
        task = g.task(k, needs, check_node, n, sent, active, eps, rtol, *deps)
        checks[n] = (g.task(key("checked", n, token_of(k)), None, operator.getitem, task, 0), {})
        value_of[n] = g.task(key("val", n, token_of(k)), needs, operator.getitem, task, 1)
    return g.delayed(checks, intake.call)


def _value(name: str, node: Node, *deps: Any) -> Any:
    """A node that is not checked, run plainly, on its device: its value."""
    with devices.on(node.device, name), node_errors(name, "forward"):
        return node.callable()(*devices.put(deps, node.device, name))
