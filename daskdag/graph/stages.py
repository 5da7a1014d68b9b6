"""Stages: the units a call runs as Dask tasks, between the plan and the graph.

In:  a :class:`~daskdag.model.plan.Plan`.
Out: its needed nodes grouped into :class:`Stage` s, in topological order. Nothing here runs a
     node: :mod:`daskdag.graph.run` runs a stage's nodes, in the stage's forward task.

A stage runs as one forward task and one backward task (for every output whose gradient passes
through it: :func:`daskdag.graph.tasks.backward` pulls their cotangents back together). Two kinds:

- **chains** of eager nodes ``n1 -> n2 -> ... -> nk``: each node but the last feeds only the next
  and is no requested output. Every edge in a chain is a dependency Dask could never use (the
  next node needs the value at once), while on a ``distributed`` cluster each task costs a
  scheduler round trip of a few milliseconds. The nodes run one by one, under one ``jax.vjp``
  of the chain (or each under its kind's rule, :mod:`daskdag.rules.registry`), so they keep
  their semantics: called once, in order, op by op, Python control flow and side effects
  included. A node with several consumers ends its
  chain, so fan-out keeps its parallelism; a node that takes values from other stages starts a
  chain of its own, so fan-in does too (a stage starts once all its deps are there).
- **fused** groups of connected jittable nodes (``jit=True``; in a sweep, ``vmap=True``): one
  function of the group's inputs, linearized once as one XLA program (in a sweep,
  ``jit(vmap(vjp))`` over the chunk), so XLA sees across node boundaries. Several of its nodes
  may be used outside it (or be requested outputs); their values are the stage's ``exposed``
  values.

A stage whose cotangents all start at its own outputs is *closed* (:mod:`daskdag.graph.build`): its
forward task runs its backward pass too (:func:`daskdag.graph.tasks.forward_backward`); a fused one
then runs as one program (:func:`daskdag.graph.run.gradients`), as ``jax.jit`` of each output's
``value_and_grad`` would.

All nodes of a stage need the same resources. ``dask.config`` ``daskdag.fuse-chains`` (default
True): False makes every node its own stage. A ``remat`` node is always a stage of its own.
"""

from __future__ import annotations

import graphlib
from dataclasses import dataclass
from typing import Any, Sequence

from daskdag import config
from daskdag.model.custom import is_custom
from daskdag.model.plan import Plan
from daskdag.model.spec import Node
from daskdag.rules.registry import element_of
from daskdag.transport.protocol import token_kept



@token_kept()  # (its fields are names, indices and flags)
@dataclass(frozen=True)
class Stage:
    """Nodes run in one task. ``sources[j][k]`` says where node ``j``'s ``k``-th dep comes from:
    ``("dep", i)`` is ``deps[i]``, a value from outside the stage (a free input or another
    stage's node); ``("node", i)`` is the stage's own node ``i``. ``active[j][k]``: that dep is
    differentiated (a ``wrt`` input or a node that depends on one). ``exposed``: indices of the
    nodes whose values leave the stage (used by other stages, or requested). ``fused``: its
    nodes run as one jitted function (see the module's docstring)."""

    nodes: tuple[str, ...]
    deps: tuple[str, ...]
    sources: tuple[tuple[tuple[str, int], ...], ...]
    active: tuple[tuple[bool, ...], ...]
    exposed: tuple[int, ...]
    needs: tuple  # the nodes' Dask resources, as sorted (name, amount) pairs
    fused: bool = False

    @property
    def name(self) -> str:
        """For task keys: ``B+C+D``, or ``n0+998more+n999`` for a long chain."""
        return abbreviate(self.nodes)

    @property
    def outputs(self) -> tuple[str, ...]:
        """The names of the exposed nodes."""
        return tuple(self.nodes[j] for j in self.exposed)

    @property
    def has_pullback(self) -> bool:
        """Some node runs under ``jax.vjp``: the forward task leaves a pullback."""
        return any(any(a) for a in self.active)

    @property
    def bare(self) -> bool:
        """The forward task's result is its one exposed value itself (no pullback, no tuple), so
        later stages read it directly."""
        return not self.has_pullback and len(self.exposed) == 1

    def inputs(self, j: int, deps: Sequence[Any], values: Sequence[Any]) -> list:
        """Node ``j``'s inputs: from ``deps`` (the stage's deps) and ``values`` (its own
        nodes'), as :attr:`sources` says."""
        return [deps[i] if kind == "dep" else values[i] for kind, i in self.sources[j]]

    def dep_active(self) -> tuple[bool, ...]:
        """Per dep: differentiated by some node of the stage."""
        on = [False] * len(self.deps)
        for sources, active in zip(self.sources, self.active):
            for (kind, i), a in zip(sources, active):
                if kind == "dep" and a:
                    on[i] = True
        return tuple(on)


def make_stages(plan: Plan, fan_in: bool = False) -> tuple[Stage, ...]:
    """The plan's needed nodes as stages (see the module's docstring), in topological order.

    ``fan_in``: a jittable node that takes values from several fused groups joins them all
    into one (where no other group stands between them), so that a DAG of ``jit=True`` nodes
    is one program; else it joins one of them, and the others stay tasks of their own, which a
    cluster can run side by side. (A call in this process takes the first: its tasks run on
    one machine, where XLA spreads a large op over the cores anyway.)"""
    spec, needed = plan.spec, set(plan.needed)
    fuse = config.get("fuse-chains")
    groups: list[list[str]] = []
    group_of: dict[str, int] = {}
    jittable: dict[int, bool] = {}
    # A remat node is a stage of its own, run node by node: its backward task then redoes that
    # node alone, and no joint vjp of a chain, nor a fused program, keeps its residuals. (Inside
    # a fused program, jax.checkpoint would do too; a stage of its own is simpler, and costs a
    # task, little beside a node large enough to be worth recomputing.)
    alone: dict[int, bool] = {}
    takes: dict[int, set[int]] = {}  # group -> the groups it takes values from

    def consumers(d):
        return {c for c, _ in spec.uses.get(d, ()) if c in needed}

    def everywhere(d):
        return {c for c, _ in spec.uses.get(d, ())}

    def comes_after(e, g):  # group e takes values from g, directly or not
        seen, stack = set(), [e]
        while stack:
            h = stack.pop()
            if h == g:
                return True
            if h not in seen:
                seen.add(h)
                stack.extend(takes[h])
        return False

    def fusable(g, n, deps) -> bool:  # group g may take node n in
        node = spec.nodes[n]
        return (jittable[g] == _jittable(node) and not alone[g]
                and all(spec.nodes[m].needs == node.needs for m in groups[g][:1])
                # (a node in wrt: its cotangent must leave its stage, see _stage)
                and not any(e in plan.wrt for e in deps if group_of[e] == g))

    def merged_takes(members: set[int], deps) -> set[int]:
        return set().union(*(takes[m] for m in members), {group_of[e] for e in deps}) - members

    def merge(members: list[int]) -> int:
        """Groups ``members`` as one (the first), its nodes in topological order."""
        into, rest = members[0], set(members[1:])
        everyone = set(members)
        for m in rest:
            for name in groups[m]:
                group_of[name] = into
            groups[into].extend(groups[m])
            groups[m] = []
        groups[into].sort(key=position.__getitem__)
        takes[into] = set().union(*(takes[m] for m in everyone)) - everyone
        for m in rest:
            takes[m] = set()
        for h, taken in takes.items():  # (the groups that took from a merged one take from it)
            if taken & rest:
                takes[h] = (taken - rest) | {into} - {h}
        return into

    position = {n: k for k, n in enumerate(plan.needed)}
    for n in plan.needed:
        node, deps = spec.nodes[n], [d for d in dict.fromkeys(spec.nodes[n].deps) if d in group_of]
        kind = _jittable(node)
        joined = None
        if kind and fuse and not node.remat:
            # fused: a connected jittable group it can join without a cycle (no group outside
            # it taking from it and feeding n); with fan_in, every such group
            members: list[int] = []
            for g in dict.fromkeys(group_of[d] for d in deps):
                if not fusable(g, n, deps):
                    continue
                trial = {*members, g}
                if not any(comes_after(h, m) for h in merged_takes(trial, deps) for m in trial):
                    members.append(g)
                    if not fan_in:
                        break
            if members:
                joined = merge(members)
        for d in deps if fuse and not node.remat and not kind else ():
            g = group_of[d]
            if spec.nodes[d].needs != node.needs or jittable[g] != kind or alone[g]:
                continue
            if any(e in plan.wrt for e in deps if group_of[e] == g):
                continue  # (a node in wrt: its cotangent must leave its stage, see _stage)
            others = {group_of[e] for e in deps} - {g}
            # chain: n follows d, its one consumer in the whole DAG (so that calls that need
            # different parts of it cut the chains they share alike, and calls computed
            # together share those stages' tasks), and takes nothing g does not wait for
            # already (a stage starts once all its deps are there: a fan-in node joining one
            # branch's chain would hold that branch back until the others are done)
            if groups[g][-1] == d and d not in plan.outputs and everywhere(d) == {n} \
                    and others <= takes[g]:
                joined = g
                break
        if joined is None:
            joined = len(groups)
            groups.append([])
            jittable[joined], takes[joined], alone[joined] = kind, set(), bool(node.remat)
        groups[joined].append(n)
        group_of[n] = joined
        takes[joined] |= {group_of[e] for e in deps} - {joined}
    # A group may grow past a later group's start (D joining B's in a diamond A->B,C->D): order
    # the groups by what they take from each other.
    order = graphlib.TopologicalSorter(takes).static_order()
    return tuple(_stage(plan, tuple(groups[g]), jittable[g] and len(groups[g]) > 1, consumers)
                 for g in order if groups[g])


def _jittable(node: Node) -> bool:
    element, in_axes = element_of(node)
    if in_axes is not None:  # over a batch: a vmap node (the user's own code vectorizes itself)
        return element.vmap and not is_custom(element.fn)
    return node.jit


def _stage(plan: Plan, nodes: tuple[str, ...], fused: bool, consumers) -> Stage:
    spec, index = plan.spec, {n: j for j, n in enumerate(nodes)}
    deps: dict[str, int] = {}
    sources, active = [], []
    for n in nodes:
        ds = spec.nodes[n].deps
        sources.append(tuple(("node", index[d]) if d in index else
                             ("dep", deps.setdefault(d, len(deps))) for d in ds))
        active.append(tuple(d in plan.wrt or d in plan.active for d in ds))
    exposed = tuple(j for j, n in enumerate(nodes) if n in plan.outputs or n in plan.wrt
                    or any(c not in index for c in consumers(n)))
    needs = tuple(sorted(spec.nodes[nodes[0]].needs.items()))
    return Stage(nodes, tuple(deps), tuple(sources), tuple(active), exposed, needs, fused)


def abbreviate(names: Sequence[str]) -> str:
    """Names in a task key: ``B+C+D``, or ``n0+998more+n999`` for many."""
    return "+".join(names) if len(names) <= 4 else f"{names[0]}+{len(names) - 2}more+{names[-1]}"
