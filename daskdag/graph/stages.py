"""Stages: a plan's needed nodes grouped into units of one forward and one backward task. A
stage is a **chain** of eager nodes, each but the last feeding only the next and no output
(fan-out ends a chain, fan-in starts one, so both keep their parallelism), or a **fused** group
of jittable nodes, one XLA program: connected ones, and siblings that take values from the same
other stages alone (the heads that read one eager node, ready together); a lone jitted node of
plain JAX code is one too. A stage's nodes share
resources and device; a ``remat`` node is a stage of its own, and so is every node without
``daskdag.fuse-chains``.
"""

from __future__ import annotations

import graphlib
from dataclasses import dataclass
from typing import Any, Sequence

import daskdag.config as config
from daskdag.model.implicit import Solve
from daskdag.model.plan import Plan
from daskdag.model.spec import Node, is_custom
from daskdag.rules.vjp import element_of, has_rules
from daskdag.transport.packing import unwrap
from daskdag.transport.protocol import token_kept


@token_kept()  # (its fields are names, indices and flags)
@dataclass(frozen=True)
class Stage:
    """Nodes run in one task. ``sources[j][k]``: where node ``j``'s ``k``-th dep comes from,
    ``("dep", i)`` (``deps[i]``) or ``("node", i)``; ``active[j][k]``: it is differentiated.
    ``exposed``: indices of the nodes whose values leave the stage."""

    nodes: tuple[str, ...]
    deps: tuple[str, ...]
    sources: tuple[tuple[tuple[str, int], ...], ...]
    active: tuple[tuple[bool, ...], ...]
    exposed: tuple[int, ...]
    needs: tuple  # the nodes' Dask resources, as sorted (name, amount) pairs
    fused: bool = False
    device: str | None = None

    @property
    def name(self) -> str:
        """For task keys: ``B+C+D``, or ``n0+998more+n999`` for a long chain."""
        return abbreviate(self.nodes)

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(self.nodes[j] for j in self.exposed)

    @property
    def has_pullback(self) -> bool:
        """Some node runs under ``jax.vjp``: the forward task leaves a pullback."""
        return any(any(a) for a in self.active)

    @property
    def value_only(self) -> bool:
        """The forward task's result is its one exposed value itself (no pullback, no tuple)."""
        return not self.has_pullback and len(self.exposed) == 1

    def inputs(self, j: int, deps: Sequence[Any], values: Sequence[Any]) -> list:
        """Node ``j``'s inputs, from the stage's ``deps`` and its own nodes' ``values``."""
        return [deps[i] if kind == "dep" else values[i] for kind, i in self.sources[j]]

    def dep_active(self) -> tuple[bool, ...]:
        """Per dep: differentiated by some node of the stage."""
        on = [False] * len(self.deps)
        for sources, active in zip(self.sources, self.active):
            for (kind, i), a in zip(sources, active):
                if kind == "dep" and a:
                    on[i] = True
        return tuple(on)


def stages_for(plan: Plan, packs: bool) -> tuple[Stage, ...]:
    """The plan's stages, with ``fan_in`` unless values are packed and some node is eager."""
    return make_stages(plan, fan_in=not packs or all(plan.spec.nodes[n].jit for n in plan.needed))


def make_stages(plan: Plan, fan_in: bool = False) -> tuple[Stage, ...]:
    """The plan's needed nodes as stages, in topological order. ``fan_in``: a jittable node
    taking values from several fused groups merges them all (else it joins one)."""
    grouping = _Grouping(plan, fan_in)
    for n in plan.needed:
        grouping.add(n)
    needed = set(plan.needed)

    def consumers(d):
        return {c for c, _ in plan.spec.uses.get(d, ()) if c in needed}

    return tuple(_stage(plan, tuple(nodes), fused, consumers)
                 for nodes, fused in grouping.ordered())


class _Grouping:
    """The groups of nodes that become stages, made node by node: ``alone[g]``, a ``remat``
    node's group; ``takes[g]``, the groups it takes values from."""

    def __init__(self, plan: Plan, fan_in: bool):
        self.plan, self.spec, self.fan_in = plan, plan.spec, fan_in
        self.fuse = config.get("fuse-chains")
        self.groups: list[list[str]] = []
        self.group_of: dict[str, int] = {}
        self.jittable: dict[int, bool] = {}
        self.alone: dict[int, bool] = {}
        self.takes: dict[int, set[int]] = {}
        self.position = {n: k for k, n in enumerate(plan.needed)}

    def add(self, n: str) -> None:
        """Node ``n`` into a fused group, the chain of its dep, or a group of its own."""
        node = self.spec.nodes[n]
        deps = [d for d in dict.fromkeys(node.deps) if d in self.group_of]
        kind = _jittable(node)
        joined = None
        if self.fuse and not node.remat:
            joined = self._fused(n, deps) if kind else self._chain(n, deps)
            if joined is None and kind:
                joined = self._sibling(n, deps)
        if joined is None:
            joined = len(self.groups)
            self.groups.append([])
            self.jittable[joined], self.takes[joined] = kind, set()
            self.alone[joined] = bool(node.remat)
        self.groups[joined].append(n)
        self.group_of[n] = joined
        self.takes[joined] |= {self.group_of[e] for e in deps} - {joined}

    def ordered(self):
        """``(nodes, fused)`` of each group, ordered by what they take from each other: a
        jittable group is one program, one jitted node too where its function is plain JAX
        (compiled forward and backward programs, called without tracing; a node of a registered
        kind keeps its rule, an implicit node its own compiled solve)."""
        for g in graphlib.TopologicalSorter(self.takes).static_order():
            nodes = self.groups[g]
            if nodes:
                plain = len(nodes) > 1 or _plain(self.spec.nodes[nodes[0]])
                yield nodes, self.jittable[g] and plain

    def _fused(self, n: str, deps: list[str]) -> int | None:
        """The jittable group ``n`` joins without a cycle (with ``fan_in``, all such merged)."""
        members: list[int] = []
        for g in dict.fromkeys(self.group_of[d] for d in deps):
            if not self._fusable(g, n, deps):
                continue
            trial = {*members, g}
            if not any(self._comes_after(h, m) for h in self._merged_takes(trial, deps)
                       for m in trial):
                members.append(g)
                if not self.fan_in:
                    break
        return self._merge(members) if members else None

    def _sibling(self, n: str, deps: list[str]) -> int | None:
        """The jittable group that takes values from the same groups as jittable ``n``, and from
        no other (siblings, ready together after the same eager nodes: one program)."""
        taken = {self.group_of[d] for d in deps}
        # (the groups that take from one of those: their nodes read one of the groups' nodes)
        readers = {self.group_of[c] for t in taken for m in self.groups[t]
                   for c, _ in self.spec.uses.get(m, ()) if c in self.group_of}
        for g in sorted(readers, reverse=True):
            if self.jittable[g] and self.takes[g] == taken and self._fusable(g, n, deps):
                return g
        return None

    def _chain(self, n: str, deps: list[str]) -> int | None:
        """The chain eager node ``n`` follows: its dep's, ending with it, no output and only
        taken by ``n``, where ``n`` takes nothing the chain does not wait for already."""
        spec, node = self.spec, self.spec.nodes[n]
        for d in deps:
            g = self.group_of[d]
            if (not together(spec.nodes[d], node) or self.jittable[g] or self.alone[g]
                    or self._holds_wrt(g, deps)):
                continue
            others = {self.group_of[e] for e in deps} - {g}
            if self.groups[g][-1] == d and d not in self.plan.outputs \
                    and {c for c, _ in spec.uses.get(d, ())} == {n} and others <= self.takes[g]:
                return g
        return None

    def _holds_wrt(self, g: int, deps: list[str]) -> bool:
        """A ``wrt`` node among ``deps`` in group ``g`` (its cotangent must leave its stage)."""
        return any(e in self.plan.wrt for e in deps if self.group_of[e] == g)

    def _fusable(self, g: int, n: str, deps: list[str]) -> bool:
        node = self.spec.nodes[n]
        return (self.jittable[g] == _jittable(node) and not self.alone[g]
                and all(together(self.spec.nodes[m], node) for m in self.groups[g][:1])
                and not self._holds_wrt(g, deps))

    def _comes_after(self, e: int, g: int) -> bool:
        """Group ``e`` takes values from ``g``, directly or not."""
        seen, stack = set(), [e]
        while stack:
            h = stack.pop()
            if h == g:
                return True
            if h not in seen:
                seen.add(h)
                stack.extend(self.takes[h])
        return False

    def _merged_takes(self, members: set[int], deps) -> set[int]:
        return set().union(*(self.takes[m] for m in members),
                           {self.group_of[e] for e in deps}) - members

    def _merge(self, members: list[int]) -> int:
        """Groups ``members`` as one (the first), its nodes in topological order."""
        into, rest = members[0], set(members[1:])
        everyone = set(members)
        for m in rest:
            for name in self.groups[m]:
                self.group_of[name] = into
            self.groups[into].extend(self.groups[m])
            self.groups[m] = []
        self.groups[into].sort(key=self.position.__getitem__)
        self.takes[into] = set().union(*(self.takes[m] for m in everyone)) - everyone
        for m in rest:
            self.takes[m] = set()
        for h, taken in self.takes.items():  # (the groups that took from a merged one take from it)
            if taken & rest:
                self.takes[h] = (taken - rest) | {into} - {h}
        return into


def one_stage(plan: Plan) -> Stage:
    """All of the plan's needed nodes as one stage, run node by node."""
    return _stage(plan, plan.needed, False, lambda d: ())


def _plain(node: Node) -> bool:
    """A node whose function is the user's JAX code: not of a registered kind, not a solve."""
    return not has_rules(node) and not isinstance(unwrap(node.fn), Solve)


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
    return Stage(nodes, tuple(deps), tuple(sources), tuple(active), exposed, needs, fused,
                 spec.nodes[nodes[0]].device)


def together(a: Node, b: Node) -> bool:
    """Nodes ``a`` and ``b`` may share a stage: the same resources, the same device."""
    return a.device == b.device and a.needs == b.needs


def abbreviate(names: Sequence[str]) -> str:
    """Names in a task key: ``B+C+D``, or ``n0+998more+n999`` for many."""
    return "+".join(names) if len(names) <= 4 else f"{names[0]}+{len(names) - 2}more+{names[-1]}"
