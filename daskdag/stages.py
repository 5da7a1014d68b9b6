"""Stages: the units a call runs as Dask tasks, between the plan and the graph.

In:  a :class:`~daskdag.plan.Plan`.
Out: its needed nodes grouped into :class:`Stage` s, in topological order. Nothing here runs.

A stage is a chain of nodes ``n1 -> n2 -> ... -> nk`` that runs as one forward task and, per
output, one backward task: each node but the last feeds only the next one and is no requested
output, and all need the same resources. Within the chain every edge is a dependency Dask
could never use (the next node needs the value at once, on the same kind of worker), while on
a ``distributed`` cluster each task costs a scheduler round trip of a few milliseconds. Nodes
with several consumers end their stage, so fan-out keeps its parallelism; every node is still
called once, eagerly unless it says ``jit=True``, in the order of the chain.

``dask.config`` ``daskdag.fuse-chains`` (default True): False makes every node its own stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import dask

from .errors import node_errors
from .progress import Cancelled
from .plan import Plan

FUSE = "daskdag.fuse-chains"


@dataclass(frozen=True)
class Stage:
    """Nodes run in one task. ``sources[j][k]`` says where node ``j``'s ``k``-th dep comes from:
    ``("dep", i)`` is ``deps[i]``, a value from outside the stage (a free input or another
    stage's last node); ``("node", i)`` is the stage's own node ``i``. ``active[j][k]``: that
    dep is differentiated (a ``wrt`` input or a node that depends on one). Only the last node's
    value leaves the stage."""

    nodes: tuple[str, ...]
    deps: tuple[str, ...]
    sources: tuple[tuple[tuple[str, int], ...], ...]
    active: tuple[tuple[bool, ...], ...]
    needs: tuple  # the nodes' Dask resources, as sorted (name, amount) pairs

    @property
    def name(self) -> str:
        """For task keys: ``B+C+D``, or ``n0+998more+n999`` for a long chain."""
        if len(self.nodes) <= 4:
            return "+".join(self.nodes)
        return f"{self.nodes[0]}+{len(self.nodes) - 2}more+{self.nodes[-1]}"

    @property
    def last(self) -> str:
        return self.nodes[-1]

    @property
    def linearized(self) -> bool:
        """Some node runs under ``jax.vjp``: the forward task leaves a :class:`StagePullback`."""
        return any(any(a) for a in self.active)


def make_stages(plan: Plan) -> tuple[Stage, ...]:
    """The plan's needed nodes as chains (see the module's docstring), in topological order."""
    spec, needed = plan.spec, set(plan.needed)
    fuse = dask.config.get(FUSE, True)
    chains: list[list[str]] = []
    chain_of: dict[str, list[str]] = {}
    for n in plan.needed:
        node = spec.nodes[n]
        chain = None
        if fuse:
            for d in dict.fromkeys(node.deps):
                if (d in chain_of and chain_of[d][-1] == d and d not in plan.outputs
                        and {c for c, _ in spec.uses[d] if c in needed} == {n}
                        and spec.nodes[d].needs == node.needs):
                    chain = chain_of[d]
                    break
        if chain is None:
            chain = []
            chains.append(chain)
        chain.append(n)
        chain_of[n] = chain
    # A chain may grow past a later chain's start (D joining B's in a diamond A->B,C->D): in
    # the order of their last nodes, every stage comes after those it takes values from.
    position = {n: k for k, n in enumerate(plan.needed)}
    chains.sort(key=lambda c: position[c[-1]])
    return tuple(_stage(plan, tuple(c)) for c in chains)


def _stage(plan: Plan, nodes: tuple[str, ...]) -> Stage:
    spec, index = plan.spec, {n: j for j, n in enumerate(nodes)}
    deps: dict[str, int] = {}
    sources, active = [], []
    for n in nodes:
        ds = spec.nodes[n].deps
        sources.append(tuple(("node", index[d]) if d in index else ("dep", deps.setdefault(d, len(deps)))
                             for d in ds))
        active.append(tuple(d in plan.wrt or d in plan.active for d in ds))
    needs = tuple(sorted(spec.nodes[nodes[0]].needs.items()))
    return Stage(nodes, tuple(deps), tuple(sources), tuple(active), needs)


class StagePullback:
    """The backward half of a stage's forward task: its nodes' pullbacks, and the values of its
    own nodes that later nodes took as inputs (a pullback that moved to another process takes
    its input residuals from them, see :class:`~daskdag.pullback.Pullback`).

    Call: ``pullback(ct, deps, dropped=None)``, with the cotangent of the stage's last node (a
    flat tuple, see :mod:`daskdag.pullback`) and the values of ``stage.deps``; returns a tuple
    aligned with ``stage.deps``: each dep's cotangent, ``None`` where none flows. A node that
    fails is named in a :class:`~daskdag.NodeError`. ``dropped()``, asked between two nodes,
    stops it (:class:`~daskdag.progress.Cancelled`) when true.
    """

    __slots__ = ("stage", "pullbacks", "values")

    def __init__(self, stage: Stage, pullbacks: Sequence[Any], values: Sequence[Any]):
        self.stage, self.pullbacks, self.values = stage, tuple(pullbacks), tuple(values)

    def __call__(self, ct: tuple, deps: Sequence[Any], dropped=None) -> tuple:
        stage = self.stage
        cts: list = [None] * len(stage.nodes)
        cts[-1] = ct
        out: list = [None] * len(stage.deps)
        for j in reversed(range(len(stage.nodes))):
            if self.pullbacks[j] is None or cts[j] is None:  # held constant, or nothing flows
                continue
            if dropped is not None and j < len(stage.nodes) - 1 and dropped():
                raise Cancelled(f"the call no longer waits for node {stage.nodes[j]!r}")
            inputs = [deps[i] if kind == "dep" else self.values[i] for kind, i in stage.sources[j]]
            with node_errors(stage.nodes[j], "backward"):
                shares = self.pullbacks[j](cts[j], inputs)
            for (kind, i), share in zip(stage.sources[j], shares):
                if share is not None:
                    into = out if kind == "dep" else cts
                    into[i] = share if into[i] is None else add(into[i], share)
        return tuple(out)

    def residual_nbytes(self) -> int:
        """Bytes that moving it ships: the pullbacks' residuals and the kept values."""
        from dask.sizeof import sizeof
        return (sum(pb.residual_nbytes() for pb in self.pullbacks if pb is not None)
                + sum(sizeof(v) for v in self.values if v is not None))

    def __reduce__(self):  # node pullbacks pickle as their portable forms, arrays out of band
        return StagePullback, (self.stage, self.pullbacks, self.values)


def add(a: tuple, b: tuple) -> tuple:
    """Two cotangents (flat tuples) summed leaf by leaf."""
    return tuple(x + y for x, y in zip(a, b))
