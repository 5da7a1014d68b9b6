"""Work every item of a sweep shares: the nodes it computes from its shared inputs alone, run
once for the whole sweep (:func:`share`), taken out of the chunks' plan. Nodes through which no
gradient passes (:func:`constants`) become shared inputs of every chunk; nodes of shared inputs
in ``wrt`` (:func:`differentiated`) keep their pullback (:class:`Through`), through which each
chunk's gradients there are pulled back. Outputs and nodes in ``wrt`` stay in the chunks. Where
a node run once fails, the chunks run it, so that the error names the item.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import daskdag.config as config
from daskdag.errors import NodeError
from daskdag.graph.build import GradientSeeding, build
from daskdag.graph.stages import Stage, one_stage, together
from daskdag.graph.tasks import Rows, linearize
from daskdag.model.leaves import differentiable_leaves, is_numeric, on_differentiable
from daskdag.model.plan import Plan, make_plan
from daskdag.rules.vjp import total
from daskdag.running.compute import compute, logger
from daskdag.sweeps.chunked import chunk_of
from daskdag.sweeps.planning import Sweep
from daskdag.transport.packing import unpack


def share(sweep: Sweep, left: int, chunk_size: int, client, local: str | None) -> Sweep:
    """``sweep`` with its shared work done once, for ``left`` items still to run in chunks of
    ``chunk_size``: constants where more than one chunk is left, nodes differentiated per item
    where more than one item is; none where ``daskdag.share-sweep-work`` is false."""
    if not config.get("share-sweep-work"):
        return sweep
    if left > chunk_size:
        sweep = constants(sweep, client, local)
    if left > 1:
        sweep = differentiated(sweep, client)
    return sweep


def constants(planned: Sweep, client, local: str | None) -> Sweep:
    """``planned`` with its constants (:func:`constants_part`) computed once, their values
    shared inputs of every chunk; ``planned`` itself where there are none, one fails, or, on
    a cluster, a value is not made of arrays and numbers."""
    split = constants_part(planned)
    if split is None:
        return planned
    plan, rest, graph = split
    try:
        computed = compute(graph, client, False, None, local, plan)
    except NodeError:
        return planned
    return _once(planned, rest, {n: computed[n][0] for n in plan.outputs}, plan.needed, "")


def constants_part(sweep: Sweep) -> tuple[Plan, Sweep, dict] | None:
    """The nodes a sweep computes from its shared inputs alone through which no gradient
    passes: ``(plan, rest, graph)``, ``plan`` computing the values the other nodes take,
    ``graph`` its Dask graph, ``rest`` the sweep without them; None where there are none."""
    plan = sweep.plan
    kept = set(plan.outputs) | set(plan.wrt)
    once = [n for n in plan.needed if n not in sweep.carrying and n not in kept]
    if not once:
        return None
    part, taken, rest = plan.cut(once)
    made = make_plan(part, taken, ())
    graph = build(made, {i: sweep.values[i] for i in made.spec.inputs}, GradientSeeding({}),
                  sweep.transport)
    return made, replace(sweep, plan=make_plan(rest, plan.outputs, plan.wrt)), graph


def differentiated(planned: Sweep, client) -> Sweep:
    """``planned`` with its nodes differentiated per item (:func:`differentiated_part`) run
    once, as one task, their pullback kept in its ``through``; ``planned`` itself where there
    are none, one fails, or, on a cluster, a value is not made of arrays and numbers."""
    split = differentiated_part(planned)
    if split is None:
        return planned
    plan, stage, rest = split
    nodes = [plan.spec.nodes[n] for n in stage.nodes]
    deps = tuple(planned.values[d] for d in stage.deps)
    try:
        if client is None:
            values, pullback = linearized(stage, nodes, deps)
        else:
            work = planned.transport.pack("the forward pass of the shared nodes",
                                          (stage, nodes, deps), hashed=False)
            future = client.submit(linearized_packed, work, pure=False,
                                   key=f"fwd:{stage.name}-{uuid.uuid4().hex}",
                                   resources=dict(stage.needs) or None)
            try:
                values, pullback = future.result()
            finally:
                future.release()
    except NodeError:
        return planned
    through = Through(stage, pullback, deps, tuple(values), tuple(planned.plan.wrt))
    return _once(planned, rest, dict(zip(stage.outputs, values)), stage.nodes,
                 ", their pullback kept for each item's gradients", through=through)


def _once(planned: Sweep, rest: Sweep, values: dict, nodes, why: str, **more) -> Sweep:
    """``rest``, the sweep without ``nodes``, taking their ``values`` (and ``more`` fields),
    computed once; ``planned`` where, on a cluster, a value is not made of arrays and numbers
    (which may travel from one worker to all). ``why`` ends the log line."""
    if planned.transport.remote and not all(map(is_numeric, jax.tree.leaves(values))):
        return planned
    logger.info("sweep_grads: nodes %s computed once for every item%s", list(nodes), why)
    return replace(rest, values={**planned.values, **values}, **more)


def differentiated_part(sweep: Sweep) -> tuple[Plan, Stage, Sweep] | None:
    """The nodes a sweep computes from its shared inputs alone that its gradients pass through:
    ``(plan, stage, rest)``, ``plan`` computing the values the other nodes take, ``stage`` its
    nodes as one stage, ``rest`` the sweep without them, those values inputs differentiated per
    item. None where there are none, or they need different resources (they run as one task)."""
    plan, spec = sweep.plan, sweep.plan.spec
    kept = set(plan.outputs) | set(plan.wrt)
    of_items: set[str] = set(sweep.batched)
    free: list[str] = []
    for n in plan.needed:
        deps = spec.nodes[n].deps
        if any(d in of_items for d in deps):
            of_items.add(n)
        elif (n in sweep.carrying and n not in kept
              and all(d in free or (d not in spec.nodes and d in sweep.values) for d in deps)):
            free.append(n)
    if not free or not all(together(spec.nodes[free[0]], spec.nodes[n]) for n in free):
        return None
    own = {n: chunk.node if (chunk := chunk_of(spec.nodes[n])) is not None else spec.nodes[n]
           for n in free}  # each node's own, not over a chunk
    part, taken, rest_spec = replace(plan, spec=replace(spec, nodes={**spec.nodes, **own})
                                     ).cut(free)
    if not taken:
        return None
    once = make_plan(part, taken, tuple(i for i in part.inputs if i in plan.wrt))
    wrt = tuple(w for w in plan.wrt if w in rest_spec.inputs or w in rest_spec.nodes)
    rest = replace(sweep, plan=make_plan(rest_spec, plan.outputs, (*wrt, *taken)),
                   broadcast=frozenset(b for b in sweep.broadcast if b in rest_spec.inputs)
                   | frozenset(taken))
    return once, one_stage(once), rest


def linearized(stage: Stage, nodes, deps) -> tuple[tuple, Any]:
    """The stage's exposed values and its pullback, materialized: it serves every chunk."""
    values, pullback = linearize(stage, nodes, deps)
    return values, pullback.materialize(deps)


def linearized_packed(work) -> tuple[tuple, Any]:
    """:func:`linearized` of ``(stage, nodes, deps)``, packed."""
    return linearized(*unpack(work))


@dataclass(frozen=True)
class Through:
    """The nodes of shared inputs differentiated per item, run once: their ``stage``, its
    ``pullback``, the values of its ``deps`` and of its exposed nodes, and the sweep's ``wrt``."""

    stage: Stage
    pullback: Any
    deps: tuple
    values: tuple
    wrt: tuple[str, ...]

    def pull(self, computed: dict, items: int) -> dict:
        """A chunk's ``{output: (value, {name: grad})}`` of ``items`` items with its gradients at
        the stage's exposed nodes pulled back to its deps and added to theirs: the gradients
        with respect to the sweep's ``wrt``. A Jacobian's rows (after the items) too."""
        outputs = list(computed)
        cts = [tuple(tuple(jax.tree.leaves(grads.get(n))) or None for n in self.stage.outputs)
               for _, grads in computed.values()]  # (a pullback takes leaves, or None)
        lead = next((leaf.shape[:leaf.ndim - np.ndim(v)] for c in cts
                     for ct, value in zip(c, self.values) if ct is not None
                     for leaf, v in zip(ct, differentiable_leaves(value))), (items,))
        cts = [tuple(None if ct is None else tuple(leaf.reshape(-1, *leaf.shape[len(lead):])
                                                   for leaf in ct) for ct in c) for c in cts]
        pulled = Rows().pull(self.pullback, cts, self.values, self.deps, None)
        results = {}
        for o, shares in zip(outputs, pulled):
            value, own = computed[o]
            grads = {}
            for name in self.wrt:
                if name in self.stage.deps:
                    at = self.stage.deps.index(name)
                    share = None if shares[at] is None else tuple(
                        leaf.reshape(*lead, *leaf.shape[1:]) for leaf in shares[at])
                    grads[name] = _sum(self.deps[at], own.get(name), share, lead)
                else:
                    grads[name] = own[name]
            results[o] = (value, grads)
        return results


def _sum(like, own, share, lead: tuple):
    """The gradient of an input whose value is ``like``, stacked over ``lead``: its ``own``
    gradient plus the ``share`` pulled back to it (flat), either None (zeros where both are),
    each leaf of the input's dtype."""
    leaves = differentiable_leaves(like)
    parts = [p for p in (None if own is None else tuple(jax.tree.leaves(own)), share)
             if p is not None]
    flat = total(parts) if parts else tuple(
        np.zeros((*lead, *np.shape(x)), jnp.result_type(x)) for x in leaves)
    return on_differentiable(like, [jnp.asarray(g, jnp.result_type(x))
                                    for g, x in zip(flat, leaves)])
