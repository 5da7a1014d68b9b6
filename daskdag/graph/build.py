"""A plan wired into one Dask graph: per stage ``fwd:B+C-<token>`` (``val:C-<token>`` takes C's
value apart from the pullback) and ``bwd:B+C[D+E]-<token>`` (its backward pass for outputs D and
E), and ``grad:D[x]-<token>``, x's gradient for D. Outputs share forward keys: nodes run once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dask.delayed import Delayed
from dask.task_spec import Task, TaskRef

import daskdag.config as config
from daskdag.graph import tasks
from daskdag.graph.assembly import (Intake, Inline, Keeper, TaskGraph, ident, is_root, key,
                                    token_of)
from daskdag.graph.stages import abbreviate, make_stages
from daskdag.model.plan import Plan
from daskdag.rules.lifted import Lift
from daskdag.rules.vjp import PerItem, basis_size
from daskdag.transport.packing import unwrap
from daskdag.transport.transports import Transport


@dataclass(frozen=True)
class GradientSeeding:
    """Each output starts from its seed (1 for a real scalar, else its ``cotangents`` entry, a
    ``TaskRef`` seeded as the tasks run); ``items``: over a sweep's chunk, its ``PerItem``."""

    cotangents: dict = field(default_factory=dict)
    items: PerItem | None = None

    @property
    def pull(self) -> tasks.PerOutput:
        """(``daskdag.batch-cotangents`` as the call is built)"""
        return tasks.PerOutput(config.get("batch-cotangents"))

    def seed(self, output: str) -> tasks.Seed | Task:
        ct = self.cotangents.get(output)
        if isinstance(ct, TaskRef):
            return Task(None, tasks.Seed, output, ct, self.items)
        return tasks.Seed(output, ct, self.items)


@dataclass(frozen=True)
class JacobianSeeding:
    """Each output starts from the rows of the identity (one per colour for a sparse Jacobian),
    pulled back as stacks (``pull``), to give the Jacobian's rows."""

    pull: tasks.Rows
    items: PerItem | None = None

    def seed(self, output: str) -> tasks.Basis:
        return tasks.Basis(output, self.pull.colours_of(output), self.items)


def build(plan: Plan, values: dict, seeding: GradientSeeding | JacobianSeeding,
          transport: Transport, place=None, stop=None, stages=None, keep: Keeper | None = None,
          base=None) -> dict[str, tuple[Delayed, dict[str, Delayed]]]:
    """The graph of one call: ``{output: (value, {name: grad})}`` of ``Delayed``. A ``TaskRef``
    among ``values`` is a task of ``base``, a graph joined to this one; ``place`` keeps large
    values on the cluster; ``stop``: a local call's ``Stop``; ``stages``: the plan's, if made;
    ``keep``: where a durable call keeps each stage's forward result."""
    intake = Intake(TaskGraph(), transport, place, keep)
    return _Wiring(plan, values, seeding, intake, stop, stages).graph(base)


class _Wiring:
    """The tasks of one call; ``through``: stage -> the outputs whose gradients pass it."""

    def __init__(self, plan: Plan, values: dict, seeding, intake: Intake, stop, stages=None):
        self.plan, self.intake, self.g, self.stop = plan, intake, intake.graph, stop
        self.pull = seeding.pull
        self.stages = make_stages(plan) if stages is None else stages
        self.stage_of = {n: s for s in self.stages for n in s.nodes}
        self.paths = {o: set(plan.backward[o]) for o in plan.outputs}
        self.through = {s: tuple(o for o in plan.outputs if self.paths[o] & set(s.outputs))
                        for s in self.stages}
        self.seeds = {o: seeding.seed(o) for o in plan.outputs}
        self.val: dict = {i: intake.value("input", i, f"input {i!r}", v) for i, v in values.items()}
        self.forward_task: dict = {}
        self.bwd: dict = {}
        self.sources: dict = {}  # ident -> a backward task, or its nested task (dense stages)
        self.closed: dict = self._closed_stages()
        self.items = seeding.items
        self.dense: set = set() if self.items is not None else self._dense_stages(values)

    def graph(self, base=None) -> dict:
        """The call's results (:meth:`gradients`) as ``Delayed``, joined to ``base``."""
        self.forward()
        self.backward()
        return self.g.delayed(self.gradients(), self.intake.call, base)

    def _closed_stages(self) -> dict:
        """Stages whose gradients all start at their own outputs: their forward task runs the
        backward pass too (``daskdag.close-stages``)."""
        closed: dict = {}
        if not config.get("close-stages"):
            return closed
        plan, through = self.plan, self.through
        for s in self.stages:
            if through[s] and all(n == o or n not in self.paths[o] or not _feeding(
                    plan.consumers(n, o), self.stage_of, s) for o in through[s] for n in s.outputs):
                closed[s] = tuple(tuple(self.seeds[o] if n == o else None for n in s.outputs)
                                  for o in through[s])
        return closed

    def _dense_stages(self, values: dict) -> set:
        """On a cluster, open stages without ``remat`` nodes whose differentiated deps are
        inputs of at most ``daskdag.dense-inputs`` elements: their backward pass travels dense."""
        dense: set = set()
        most = config.get("dense-inputs")
        if not (self.intake.transport.remote and most):
            return dense
        nodes = self.plan.spec.nodes
        for s in self.stages:
            if not s.has_pullback or s in self.closed or not self.through[s] or any(
                    nodes[n].remat for n in s.nodes):
                continue
            active = [d for d, on in zip(s.deps, s.dep_active()) if on]
            if all(d in values and not isinstance(values[d], TaskRef) for d in active) and sum(
                    basis_size(values[d]) for d in active) <= most:
                dense.add(s)
        return dense

    def forward(self) -> None:
        """Each stage's forward task, and the ``val`` tasks of its values."""
        spec, intake, val = self.plan.spec, self.intake, self.val
        for s in self.stages:
            sent = [intake.node(n, spec.nodes[n]) for n in s.nodes]
            closed = self.closed.get(s)
            dense = s in self.dense
            k = intake.key(_kind_of(s, spec), s.name, s, [ident(n) for n in sent],
                           [ident(val[d]) for d in s.deps], closed, self.pull if closed else None,
                           *(["dense"] if dense else []))
            run = ((tasks.forward_dense if dense else tasks.forward,) if closed is None else
                   (tasks.forward_backward, closed, self.pull))
            fwd = intake.stage(k, dict(s.needs), run[0], 2 + len(run) - 1 + len(sent), s,
                               self.stop, *run[1:], *sent, *(val[d] for d in s.deps),
                               root=is_root(s, spec))
            if closed is not None:
                label = self._label(s)
                if self.dense and all(self.stage_of[d] in self.dense for d in s.deps
                                      if d in self.stage_of):
                    self._source(s, Inline(self.g.nested(tasks.cotangents_of, fwd),
                                           f"{label}-{token_of(k)}"))
                else:
                    self._source(s, self.g.task(key("bwd", label, token_of(k)), dict(s.needs),
                                                tasks.cotangents_of, fwd))
            elif s.has_pullback:
                self.forward_task[s] = fwd
            self._values(s, fwd, token_of(k))

    def _values(self, s, fwd, token: str) -> None:
        for e, n in enumerate(s.outputs):
            if s.value_only:
                self.val[n] = fwd
            elif n in self.plan.outputs or (self.intake.transport.packs and s not in self.dense):
                # (consumers never fetch residuals)
                self.val[n] = self.g.task(key("val", n, token), dict(s.needs), tasks.pick, fwd,
                                          s.has_pullback, e)
            else:  # nothing travels, or what does is small: a consumer picks the value itself
                self.val[n] = Inline(self.g.nested(tasks.pick, fwd, s.has_pullback, e),
                                     f"{token}.{e}")

    def backward(self) -> None:
        """Per open stage, one task pulling back the cotangents of every output through it."""
        for s in reversed(self.stages):
            if not self.through[s] or s in self.closed:
                continue
            sources: dict = {}
            flows = [tuple(self._flow(s, n, o, sources) for n in s.outputs)
                     for o in self.through[s]]
            k = self.intake.key("bwd", self._label(s), self.forward_task[s].key, flows,
                                list(sources), self.pull)
            args = (s, self.stop, tuple(flows), self.pull, self.forward_task[s],
                    *(self.val[d] for d in s.deps), *(self.sources[src] for src in sources))
            if s in self.dense:  # (run inside each task that takes its cotangents)
                self._source(s, Inline(self.g.nested(tasks.backward, *args), token_of(k)))
            else:
                self._source(s, self.g.task(k, dict(s.needs), tasks.backward, *args))

    def _source(self, s, bwd) -> None:
        """``bwd``, stage ``s``'s backward task (or nested task), as its consumers' source."""
        self.bwd[s] = bwd
        self.sources[ident(bwd)] = bwd

    def _flow(self, s, n: str, o: str, sources: dict):
        """Where output ``o``'s cotangent at node ``n`` of stage ``s`` comes from, or None."""
        if n == o:
            return self.seeds[o]
        if n not in self.paths[o]:
            return None
        locations = self._shares(n, o, sources, within=s)
        return tasks.Shares(locations) if locations else None

    def gradients(self) -> dict:
        """``{output: (value, {name: grad})}``, each grad a task summing its shares; in this
        process, those of outputs that do not depend on the name picked from one task making
        every such zero (elsewhere each is its own, run where the name's value is)."""
        results, zero = {}, []
        together = not self.intake.transport.packs
        for o in self.plan.outputs:
            grads: dict[str, TaskRef | None] = {}
            output = self.val[o] if self.pull.stacked else None  # (a Jacobian's zeros need rows)
            for i in self.plan.wrt:  # inputs, and nodes (the output itself starts from its seed)
                sources: dict = {}
                locations = self._shares(i, o, sources)
                own = self.seeds[o] if i == o else None
                k = self.intake.key("grad", f"{o}[{i}]", ident(self.val[i]), list(sources),
                                    locations, own, self.pull)
                if together and not (locations or own or self.pull.stacked or self.items):
                    grads[i] = None  # (its place, in the order of wrt: filled below)
                    zero.append((o, i, k))
                    continue
                basis = self.seeds[o] if self.pull.stacked else None
                grads[i] = self.g.task(k, None, tasks.gradient,
                                       tuple((k, p) for _, k, p in locations), self.val[i], output,
                                       basis, own, self.items,
                                       *(self.sources[src] for src in sources))
            results[o] = (self.val[o], grads)
        if zero:
            label = abbreviate(list(dict.fromkeys(i for _, i, _ in zero)))
            made = self.g.task(self.intake.key("zeros", label, [k for _, _, k in zero]), None,
                               tasks.zero_gradients, *(self.val[i] for _, i, _ in zero))
            for n, (o, i, k) in enumerate(zero):
                results[o][1][i] = self.g.task(k, None, tasks.pick, made, False, n,
                                               computes=False)
        return results

    def _shares(self, name: str, output: str, sources: dict, within=None) -> tuple:
        """``(source, output index, position)`` for each stage but ``within`` that consumes
        ``name``; ``sources`` maps their backward tasks' idents to ``source``, their index
        among the task's arguments (new ones added)."""
        locations = []
        for s in _feeding(self.plan.consumers(name, output), self.stage_of, within):
            source = sources.setdefault(ident(self.bwd[s]), len(sources))
            locations.append((source, self.through[s].index(output), s.deps.index(name)))
        return tuple(locations)

    def _label(self, s) -> str:
        return f"{s.name}[{abbreviate(self.through[s])}]"


def _kind_of(stage, spec) -> str:
    """A forward task's kind: ``jvp`` where the stage pushes tangents (a lifted node)."""
    lifted = any(isinstance(unwrap(spec.nodes[n].fn), Lift) for n in stage.nodes)
    return "jvp" if lifted else "fwd"


def _feeding(uses, stage_of, within=None) -> list:
    """The stages of the consuming nodes in ``uses``, each once, other than ``within``."""
    return [s for s in dict.fromkeys(stage_of[c] for c, _ in uses) if s is not within]


