"""Checking derivatives against central finite differences: every node's VJP against those of
the node alone (:func:`check_grads`, OpenMDAO's ``check_partials``), and the outputs' gradients
against those of the whole composed DAG (:func:`check_totals`, its ``check_totals``).

In:  a call as for :func:`daskdag.compute_grads` (``dag, x, outputs, wrt, client``), and
     optionally the finite-difference step ``eps`` and tolerance ``rtol``.
Out: ``{node: its largest relative error}`` for every node checked, or a
     :class:`~daskdag.GradientCheckError` naming the first node (topological order) whose VJP
     disagrees, and which of its deps; a node that raises is a :class:`~daskdag.NodeError`.

The nodes checked are those a gradient passes through: the plan's active nodes on a path from
the differentiated inputs to an output (:attr:`daskdag.model.plan.Plan.backward`), each once, by
one task per node, in one Dask graph; the node's value, from its forward pass there, goes on to
the nodes after it (nodes not checked run plainly, in tasks of their own). A check task takes
its deps' values and, at that point:

- linearizes the node as daskdag does (:func:`daskdag.rules.registry.linearizer`: ``jax.vjp``, or a
  registered linearizer such as a user-supplied VJP), once;
- per projection (:data:`PROJECTIONS`), draws a random unit cotangent ``u`` over the output's
  differentiable leaves and pulls it back once; then per active dep, a random tangent ``v``
  over that dep's differentiable leaves (a random direction, each leaf's elements then of
  about the leaf's RMS magnitude), and evaluates the node's function (``node.callable()``, on
  concrete values, never traced by this module) at ``x + eps v`` and ``x - eps v``, perturbed
  in each leaf's own dtype;
- compares ``fd = <u, J v>`` by central differences with ``ad = <VJP(u), v>``, ``<a, b> =
  real(sum(conj(a) * b))`` as ``jax.test_util.check_vjp`` (which conjugates the cotangent on
  the way in and out, so complex nodes check too). ``v`` is taken as the perturbation that
  really happened, ``(x+ - x-) / (2 eps)`` in float64, so rounding the perturbed inputs to
  their dtype costs no accuracy.

So a checked node's function is called once to linearize and ``2 * PROJECTIONS`` times per
active dep, and no more.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from distributed import Client

from daskdag.api import compute_grads
from daskdag.errors import DAGError, GradientCheckError, TotalCheckError, node_errors
from daskdag.graph.assembly import Intake, TaskGraph, ident, key, token_of
from daskdag.transport import transports
from daskdag.transport.transports import Transport
from daskdag.model.plan import make_plan
from daskdag.model.leaves import PyTree, differentiable_leaves, is_differentiable, on_differentiable
from daskdag.rules.registry import linearizer
from daskdag.model.request import nodes_in_wrt, prepare
from daskdag.running.compute import where
from daskdag.running.jobs import Job, run
from daskdag.model.plan import ship

if TYPE_CHECKING:
    from daskdag.model.plan import Plan
    from daskdag.model.spec import Node

PROJECTIONS = 2  # random (u, v) pairs per node and dep
# The FD noise allowed for rounding the node's outputs: each output leaf f_i evaluated with a
# relative error of about ROUNDING machine epsilons (several ops' worth), see check_grads.
ROUNDING = 4.0


def check_grads(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
                wrt: Sequence[str] | None = None, eps: float | None = None,
                rtol: float | None = None, client: Client | None = None,
                scheduler: str | Client | None = None) -> dict[str, float]:
    """Check the VJP of every node on the way from the differentiated inputs to ``outputs``
    against central finite differences of that node alone, at the point the forward pass reached.

    Args:
        dag: as for :func:`daskdag.compute_grads`.
        x: as for :func:`daskdag.compute_grads`.
        outputs: as for :func:`daskdag.compute_grads`.
        wrt: as for :func:`daskdag.compute_grads`.
        client: as for :func:`daskdag.compute_grads`.
        scheduler: as for :func:`daskdag.compute_grads`.
        eps: the finite-difference step, relative: each element of a leaf moves by about ``eps``
            times the leaf's RMS magnitude (1 for an all-zero leaf), in a random direction.
            Default, by the lowest precision among the node's differentiated leaves and output
            leaves: ``cbrt(finfo.eps)``, which balances the truncation error (``eps**2``)
            against rounding (``finfo.eps / eps``): 4.9e-3 for float32, 6.1e-6 for float64.
        rtol: default ``2 * cbrt(finfo.eps)`` (9.8e-3 for float32, 1.2e-5 for float64): a central
            difference at that step is good to about ``finfo.eps ** (2/3)`` (5e-5 in float32,
            4e-11 in float64) on a well-scaled node, so this leaves a margin of
            ``finfo.eps ** (-1/3)`` (200x in float32) for curvature and rounding inside the node,
            while a VJP off by a few percent (float64) or by a factor (float32) fails.

    A projection passes when ``|fd - ad| <= rtol * scale + noise``, where ``scale = max(|fd|,
    |ad|, ||J v|| / sqrt(n))`` (``n``: the output's real degrees of freedom; ``||J v|| /
    sqrt(n)`` is the typical size of ``<u, J v>`` for a random unit ``u``, so a wrong VJP is not
    hidden by a large output) and ``noise = ROUNDING * finfo.eps / eps * sqrt(sum |u_i f_i|^2)``
    is what rounding the node's outputs ``f`` to their precision adds to ``fd``
    (negligible on a well-scaled node; it keeps a node whose outputs are large against their
    variation, or constant, from failing).

    Returns:
        ``{node: relative error}``: for each node checked, the largest ``|fd - ad| /
        (scale + noise / rtol)`` over its deps and projections, so at most ``rtol`` where it passed.
        Raises :class:`~daskdag.GradientCheckError` for the first node in topological order whose
        VJP disagrees (after checking all of them; the error names the others that failed),
        :class:`~daskdag.NodeError` when a node raises, and what :func:`~daskdag.compute_grads`
        raises for a malformed call or a cluster that cannot run it.

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
    # The nodes' functions, packed where they travel; each node runs in its check task (its
    # value taken from there by the nodes after it), or plainly when it is not checked.
    transport = transports.for_call(client)
    forward = ship(make_plan(spec, plan.needed, ()), transport)
    graph = partial(_graph, plan, forward, request.values, checked, eps, rtol, transport)
    found = run(Job(forward, graph, lambda found: found, "check_grads"), client, local, False)
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
    """Check the gradients of whole ``outputs`` (what :func:`~daskdag.compute_grads` gives)
    against central finite differences of the composed DAG, as OpenMDAO's ``check_totals``
    does beside its ``check_partials`` (:func:`check_grads`, node by node).

    Args:
        dag: as for :func:`~daskdag.compute_grads`.
        x: as for :func:`~daskdag.compute_grads`.
        outputs: as for :func:`~daskdag.compute_grads`; any real or complex arrays or pytrees.
        wrt: as for :func:`~daskdag.compute_grads`: free inputs only.
        eps: as for :func:`check_grads`; its default by the lowest precision among the
            differentiated inputs' leaves.
        rtol: as for :func:`check_grads`; its default by the lowest precision among the
            differentiated inputs' leaves and the outputs' leaves.
        client: as for :func:`~daskdag.compute_grads`.
        scheduler: as for :func:`~daskdag.compute_grads`.

    Per projection (:data:`PROJECTIONS`), a random unit cotangent ``u`` over each output's
    differentiable leaves and a random tangent ``v`` per input (each leaf's elements of about
    its RMS magnitude): ``<u, J v>`` by central differences (the DAG evaluated at ``x + eps v``
    and ``x - eps v``, every evaluation a task graph of its own, all in one Dask graph) against
    ``<J^T u, v>`` from ``compute_grads`` seeded with ``u``, compared as :func:`check_grads`
    compares them. So the DAG runs ``1 + 2 * PROJECTIONS * len(wrt)`` times plainly and
    ``PROJECTIONS`` times under ``compute_grads``.

    Returns:
        ``{output: its largest relative error}`` over inputs and projections (at most
        ``rtol`` where it passed). Raises :class:`~daskdag.TotalCheckError` (a
        :class:`~daskdag.GradientCheckError`) naming the first output and input that disagree (and
        the other pairs that failed), :class:`~daskdag.NodeError` when a node raises, and what
        :func:`~daskdag.compute_grads` raises for a malformed call.

    For example:

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
    machine = max(float(jnp.finfo(_dtype(leaf)).eps) for ls in leaves.values() for leaf in ls)
    step = float(eps) if eps is not None else machine ** (1 / 3)
    moves: list[dict]
    points, moves = [values], []  # the point, then x -/+ eps v per projection and input
    for _ in range(PROJECTIONS):
        moves.append({})
        for i in plan.wrt:
            size = np.sqrt(sum(np.size(leaf) for leaf in leaves[i]))
            v = [t * size * _magnitude(leaf) for t, leaf in zip(_unit(rng, leaves[i]), leaves[i])]
            plus, minus, moves[-1][i] = _perturbed(values[i], v, step)
            points += [{**values, i: minus}, {**values, i: plus}]
    transport = transports.for_call(client)
    forward = ship(make_plan(spec, plan.outputs, ()), transport)
    evaluated = run(Job(forward, partial(_points_graph, forward, points, transport),
                        lambda found: found, "check_totals"), client, local, False)
    at = [{o: differentiable_leaves(evaluated[f"{e}:{o}"][0]) for o in plan.outputs}
          for e in range(len(points))]
    machine = max([machine] + [float(jnp.finfo(_dtype(leaf)).eps) for ls in at[0].values()
                               for leaf in ls])
    rtol = float(rtol) if rtol is not None else 2 * machine ** (1 / 3)
    worst = {o: 0.0 for o in plan.outputs}
    failures: dict = {}
    for p in range(PROJECTIONS):
        us = {o: _unit(rng, at[0][o]) for o in plan.outputs}
        value_of = {o: evaluated[f"0:{o}"][0] for o in plan.outputs}
        cts = {o: on_differentiable(value_of[o], [np.conj(u).astype(_dtype(leaf)) for u, leaf
                                                  in zip(us[o], at[0][o])]) for o in plan.outputs}
        grads = compute_grads(dag, x, list(plan.outputs), wrt=list(plan.wrt), cotangents=cts,
                              client=client, scheduler=scheduler)
        for o in plan.outputs:
            u = [np.conj(_wide(c)) for c in differentiable_leaves(cts[o])]
            f = [_wide(leaf) for leaf in at[0][o]]
            noise = ROUNDING * machine / step * np.sqrt(sum(np.sum(np.abs(a * b) ** 2)
                                                            for a, b in zip(u, f)))
            for k, i in enumerate(plan.wrt):
                e = 1 + 2 * (p * len(plan.wrt) + k)
                jv = [(_wide(a) - _wide(b)) / (2 * step) for a, b in zip(at[e + 1][o], at[e][o])]
                grad = grads[o].grad if len(spec.inputs) == 1 else grads[o].grad[i]
                ad = _inner(moves[p][i], [np.conj(_wide(g)) for g in differentiable_leaves(grad)])
                relative, failure = _compare(_inner(jv, u), ad, jv, f, rtol, noise)
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
    """The graph of the checks, node by node in topological order: a :func:`check_node` task
    for each ``checked`` node, whose forward pass also gives the node's value to the nodes after
    it, and a plain task (:func:`_value`) for each other needed node. So each checked node runs
    once to linearize and twice per projection and differentiated dep, and no more."""
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
    """A node that is not checked, run plainly: its value."""
    with node_errors(name, "forward"):
        return node.callable()(*deps)


def check_node(name: str, node: Node, active: tuple[bool, ...], eps: float | None,
               rtol: float | None, *deps: Any) -> tuple[tuple[float, dict | None], Any]:
    """The check task of node ``name`` (see the module's docstring) at its deps' values.

    Returns ``((largest relative error, failure), value)``: ``failure`` is ``None``, or for the
    first failing dep (by position; its worst projection) the keyword arguments of
    :class:`~daskdag.GradientCheckError` less ``node``, ``dep`` and ``others``; ``value``, the
    node's output, for the nodes after it."""
    inputs = list(deps)
    with node_errors(name, "forward"):
        primal, pullback = linearizer(node)(inputs, active)
    outs = differentiable_leaves(primal)
    leaves = {k: differentiable_leaves(inputs[k]) for k, on in enumerate(active) if on}
    leaves = {k: ls for k, ls in leaves.items() if ls}
    if not outs or not leaves:  # nothing differentiable flows through this node
        return (0.0, None), primal
    machine = max(float(jnp.finfo(_dtype(leaf)).eps)
                  for leaf in [*outs, *(leaf for ls in leaves.values() for leaf in ls)])
    eps = float(eps) if eps is not None else machine ** (1 / 3)
    rtol = float(rtol) if rtol is not None else 2 * machine ** (1 / 3)
    fn, rng = node.callable(), np.random.default_rng(0)
    f = [_wide(o) for o in outs]
    failures: dict
    worst, failures = 0.0, {}
    for _ in range(PROJECTIONS):
        # u in the outputs' own dtypes, as the VJP gets it; conj as jax.test_util.check_vjp
        ct = tuple(jnp.asarray(np.conj(u).astype(_dtype(o)))
                   for u, o in zip(_unit(rng, outs), outs))
        u = [np.conj(_wide(c)) for c in ct]
        with node_errors(name, "backward"):
            pulled = pullback(ct, inputs)
        noise = ROUNDING * machine / eps * np.sqrt(sum(np.sum(np.abs(a * b) ** 2)
                                                       for a, b in zip(u, f)))
        for k, dep_leaves in leaves.items():
            # A random direction, each leaf's elements then of about its RMS magnitude: the
            # step moves every element by about eps of its size (a unit vector over N elements
            # would move each by eps / sqrt(N), drowning a large leaf's step in rounding).
            size = np.sqrt(sum(np.size(leaf) for leaf in dep_leaves))
            v = [t * size * _magnitude(leaf) for t, leaf in zip(_unit(rng, dep_leaves), dep_leaves)]
            plus, minus, v = _perturbed(inputs[k], v, eps)
            with node_errors(name, "finite-difference"):
                up = fn(*inputs[:k], plus, *inputs[k + 1:])
                down = fn(*inputs[:k], minus, *inputs[k + 1:])
                up, down = _outputs_like(primal, up), _outputs_like(primal, down)
            jv = [(_wide(a) - _wide(b)) / (2 * eps) for a, b in zip(up, down)]
            fd = _inner(jv, u)
            shares = pulled[k] if pulled[k] is not None else [np.zeros_like(t) for t in v]
            ad = _inner(v, [np.conj(_wide(s)) for s in shares])
            relative, failure = _compare(fd, ad, jv, f, rtol, noise)
            if failure is not None and (k not in failures or relative > failures[k][0]):
                failures[k] = (relative, dict(position=k, eps=eps, **failure))
            worst = max(worst, float(relative))
    return (worst, failures[min(failures)][1] if failures else None), primal


def _compare(fd: float, ad: float, jv: list, f: list, rtol: float, noise: float
             ) -> tuple[float, dict | None]:
    """``<u, J v>`` by finite differences (``fd``; ``jv``: ``J v`` itself) against the VJP's
    (``ad``), ``f`` the node's outputs: ``(error relative to the tolerance, times rtol;
    the failure's fd, ad, error and tolerance, or None where it passed)``."""
    n = sum(a.size * (2 if np.iscomplexobj(a) else 1) for a in f)
    scale = max(abs(fd), abs(ad), np.sqrt(sum(np.sum(np.abs(a) ** 2) for a in jv) / n))
    tolerance = rtol * scale + noise
    error = abs(fd - ad)
    relative = error / (tolerance / rtol) if tolerance > 0 else 0.0 if error == 0 else np.inf
    if error <= tolerance:
        return relative, None
    return (np.inf if np.isnan(relative) else relative,  # (NaN fails)
            dict(fd=float(fd), ad=float(ad), error=float(error), tolerance=float(tolerance)))


def _dtype(leaf: Any) -> np.dtype:
    """The dtype a leaf is computed in: an array's own; a Python number's as JAX takes it."""
    return np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.dtype(jnp.result_type(leaf))


def _wide(a: Any) -> np.ndarray:
    """``a`` as float64 (complex128) NumPy, for sums that add no rounding of their own."""
    a = np.asarray(a)
    return a.astype(np.complex128 if np.iscomplexobj(a) else np.float64)


def _unit(rng: np.random.Generator, leaves: Sequence[Any]) -> list[np.ndarray]:
    """Random normal arrays shaped like ``leaves`` (complex where they are), of norm 1 in all."""
    out = []
    for leaf in leaves:
        shape = np.shape(leaf)
        r = rng.standard_normal(shape)
        out.append(r + 1j * rng.standard_normal(shape) if np.iscomplexobj(leaf) else r)
    norm = np.sqrt(sum(np.sum(np.abs(r) ** 2) for r in out))
    return [r / norm for r in out] if norm > 0 else out


def _magnitude(leaf: Any) -> float:
    """A leaf's RMS magnitude, the scale of its step; 1 where it is all zeros (or not finite)."""
    a = _wide(leaf)
    rms = float(np.sqrt(np.mean(np.abs(a) ** 2))) if a.size else 0.0
    return rms if rms > 0 and np.isfinite(rms) else 1.0


def _perturbed(tree: PyTree, v: list[np.ndarray], eps: float) -> tuple[PyTree, PyTree, list]:
    """``tree`` at ``+eps v`` and ``-eps v`` on its differentiable leaves, each computed in the
    leaf's own dtype and given back as the leaf's kind (JAX array, NumPy array or scalar,
    Python number); and the tangent that really happened, ``(plus - minus) / (2 eps)`` (the
    leaves' rounding included), in float64."""
    leaves, treedef = jax.tree.flatten(tree)
    steps = iter(v)
    plus, minus, happened = [], [], []
    for leaf in leaves:
        if not is_differentiable(leaf):
            plus.append(leaf)
            minus.append(leaf)
            continue
        dtype = _dtype(leaf)
        x, step = np.asarray(leaf, dtype), np.asarray(eps * next(steps)).astype(dtype)
        up, down = x + step, x - step
        happened.append((_wide(up) - _wide(down)) / (2 * eps))
        plus.append(_like(leaf, up))
        minus.append(_like(leaf, down))
    return treedef.unflatten(plus), treedef.unflatten(minus), happened


def _like(leaf: Any, a: np.ndarray) -> Any:
    if isinstance(leaf, jax.Array):
        return jnp.asarray(a)
    if isinstance(leaf, np.ndarray):
        return a
    if isinstance(leaf, np.generic):
        return a[()]
    return type(leaf)(a[()])  # a Python float or complex


def _outputs_like(primal: PyTree, out: PyTree) -> list:
    """``out``'s differentiable leaves, checked to be shaped as ``primal``'s."""
    got, want = differentiable_leaves(out), differentiable_leaves(primal)
    if [np.shape(a) for a in got] != [np.shape(a) for a in want]:
        raise ValueError(f"at a perturbed input it returned differentiable leaves shaped "
                         f"{[np.shape(a) for a in got]}, where its linearization returned "
                         f"{[np.shape(a) for a in want]}")
    return got


def _inner(a: list, b: list) -> float:
    """``real(sum(conj(a) * b))`` over lists of arrays, as ``jax.test_util``'s inner product."""
    return float(sum(np.real(np.sum(np.conj(x) * y)) for x, y in zip(a, b)))
