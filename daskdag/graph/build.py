"""Wire a :class:`~daskdag.model.plan.Plan` into one Dask graph of forward and backward tasks.

In:  a plan, the input values, where the outputs' cotangents start (a seeding:
:class:`GradientSeeding` or :class:`JacobianSeeding`), how the graph takes in its values (a
:class:`~daskdag.transport.transports.Transport`).
Out: ``{output: (value, {input: grad})}`` of ``dask.delayed.Delayed`` objects sharing one graph.

Tasks are per stage (:mod:`daskdag.graph.stages`), assembled with :mod:`daskdag.graph.assembly`,
whose keys name them: ``fwd:B+C-<token>`` runs the stage of nodes B and C (``val:C-<token>``
takes C's value apart from its pullback, so later stages never fetch residuals),
``bwd:B+C[D+E]-<token>`` its backward pass for outputs D and E (for a closed stage, where every
cotangent starts at its own outputs, the forward task runs it too and ``bwd:`` takes its
cotangents), ``grad:D[x]-<token>`` input (or ``wrt`` node) x's gradient for D (for a Jacobian,
its rows). Outputs share forward keys, so every node runs once per call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from dask.delayed import Delayed
from dask.task_spec import Task, TaskRef

import daskdag.config as config
from daskdag.graph import tasks
from daskdag.graph.assembly import (Intake, Inline, Keeper, TaskGraph, ident, is_root, key,
                                    token_of)
from daskdag.graph.stages import abbreviate, make_stages
from daskdag.model.plan import Plan
from daskdag.rules.lifted import Lift
from daskdag.rules.seeds import PerItem, basis_size
from daskdag.transport.packing import unwrap
from daskdag.transport.transports import Transport


@dataclass(frozen=True)
class GradientSeeding:
    """Seeding for gradients: each output starts from its seed (1 for a real scalar, else its
    cotangent in ``cotangents``), one cotangent per output
    (:data:`~daskdag.graph.tasks.PER_OUTPUT`). ``items``: over a sweep's chunk, the
    :class:`~daskdag.rules.seeds.PerItem` that seeds its values and gathers its gradients. A
    cotangent that is a ``TaskRef`` (a template's slot, :func:`daskdag.running.local.slot`) is
    the call's data: the seed is made from it as the tasks run."""

    cotangents: dict = field(default_factory=dict)
    items: PerItem | None = None
    pull: ClassVar[Any] = tasks.PER_OUTPUT

    def seed(self, output: str) -> tasks.Seed | Task:
        ct = self.cotangents.get(output)
        if isinstance(ct, TaskRef):
            return Task(None, tasks.Seed, output, ct, self.items)
        return tasks.Seed(output, ct, self.items)


@dataclass(frozen=True)
class JacobianSeeding:
    """Seeding for a Jacobian: each output starts from the rows of the identity over its
    elements (one per colour for a sparse one), pulled back as stacks (``pull``, a
    :class:`~daskdag.graph.tasks.Rows`), and its "gradients" are the Jacobian's rows;
    ``items`` as for :class:`GradientSeeding`."""

    pull: tasks.Rows
    items: PerItem | None = None

    def seed(self, output: str) -> tasks.Basis:
        return tasks.Basis(output, self.pull.colours_of(output), self.items)


def build(plan: Plan, values: dict, seeding: GradientSeeding | JacobianSeeding,
          transport: Transport, place=None, stop=None, stages=None, keep: Keeper | None = None,
          base=None) -> dict[str, tuple[Delayed, dict[str, Delayed]]]:
    """The graph of one call.

    Args:
        plan: the call's plan, its node functions packed where ``transport`` packs them
            (:func:`daskdag.model.plan.ship`).
        values: ``{input: value}``; a ``TaskRef`` is a value already on the cluster.
        seeding: where the outputs' cotangents start: :class:`GradientSeeding` or
            :class:`JacobianSeeding`.
        transport: how the graph takes in values and functions
            (:class:`~daskdag.graph.assembly.Intake`).
        place: keeps large values on the cluster (:mod:`daskdag.running.resident`), or None.
        stop: for a call in this process, a ``daskdag.cancel.Stop`` whose setting (on Ctrl-C,
            :func:`daskdag.running.compute.compute`) stops running stages at their next node.
        stages: the plan's stages (:func:`~daskdag.graph.stages.make_stages`), when a prepared
            call made them already.
        keep: where a durable call keeps each stage's forward result as it finishes, and reads
            it back instead of running the stage again (:class:`~daskdag.graph.assembly.Keeper`),
            or None.
        base: the graph of tasks that ``values`` refer to (``TaskRef``), to join this one
            (``HighLevelGraph``), or None.

    Returns:
        ``{output: (value, {name: grad})}`` of ``Delayed`` sharing one graph.
    """
    intake = Intake(TaskGraph(), transport, place, keep)
    return _Wiring(plan, values, seeding, intake, stop, stages).graph(base)


class _Wiring:
    """The tasks of one call, made stage by stage: :meth:`forward` in topological order,
    :meth:`backward` in reverse (autograd's backward pass, where a node's ``outgrads`` are the
    shares its consumer stages' backward tasks pull back), :meth:`gradients` last. ``val``:
    name -> the task (or inline value) of each input and exposed node; ``bwd``: stage -> its
    backward task; ``through``: stage -> the outputs whose gradients pass through it.
    Constructed whole: its seeds, inputs, closed and dense stages are settled here, and
    :meth:`graph` makes the tasks."""

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
        # stages whose backward pass travels as their Jacobian
        self.items = seeding.items
        self.dense: set = set() if self.items is not None else self._dense_stages(values)

    def graph(self, base=None) -> dict:
        """The call's results (:meth:`gradients`) as ``Delayed`` over the whole graph, joined
        to ``base`` (as :meth:`~daskdag.graph.assembly.TaskGraph.delayed`)."""
        self.forward()
        self.backward()
        return self.g.delayed(self.gradients(), self.intake.call, base)

    def _closed_stages(self) -> dict:
        """A stage whose gradients all start at its own outputs (none comes from a later stage)
        is closed: its forward task runs the backward pass too (tasks.forward_backward), a
        fused one as one program; its residuals never leave it (``daskdag.close-stages``)."""
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
        """On a cluster, the open stages whose backward pass travels as their dense Jacobian
        (:mod:`daskdag.graph.dense`) and runs inside the tasks that take their cotangents: those
        (no ``remat`` node among them) whose differentiated deps are the call's inputs, at most
        ``daskdag.dense-inputs`` elements in all. A closed stage all of whose deps are inputs
        or nodes of such stages hands its cotangents over inside those tasks too."""
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
        """Each stage once (its nodes under jax.vjp where they depend on a differentiated
        input), and the ``val`` tasks of its values (:meth:`_values`)."""
        spec, intake, val = self.plan.spec, self.intake, self.val
        for s in self.stages:
            sent = [intake.node(n, spec.nodes[n]) for n in s.nodes]
            closed = self.closed.get(s)
            # (A Jacobian's rows change only what a closed stage's task computes: the others
            # are the same forward tasks as for gradients, shared when both run together.)
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
        """One task per stage, for every output whose gradient passes through it (their
        cotangents pulled back together, tasks.backward): each exposed node's cotangent is its
        output's seed, or the sum of its consumer stages' shares (:class:`tasks.Shares`)."""
        for s in reversed(self.stages):
            if not self.through[s] or s in self.closed:
                continue
            sources: dict
            flows, sources = [], {}
            for o in self.through[s]:
                flows.append(tuple(self._flow(s, n, o, sources) for n in s.outputs))
            k = self.intake.key("bwd", self._label(s), self.forward_task[s].key, flows,
                                list(sources), self.pull)
            args = (s, self.stop, tuple(flows), self.pull, self.forward_task[s],
                    *(self.val[d] for d in s.deps), *(self.sources[src] for src in sources))
            if s in self.dense:  # (run inside each task that takes its cotangents)
                self._source(s, Inline(self.g.nested(tasks.backward, *args), token_of(k)))
            else:
                self._source(s, self.g.task(k, dict(s.needs), tasks.backward, *args))

    def _source(self, s, bwd) -> None:
        """``bwd``, stage ``s``'s backward task (or the nested task that stands for it), as the
        source its consumers take their shares from."""
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
        """``{output: (value, {name: grad})}``: each wrt name's gradient, the sum of the shares
        its consumer stages pulled back (for the output itself, its seed too)."""
        results = {}
        for o in self.plan.outputs:
            grads = {}
            output = self.val[o] if self.pull.stacked else None  # (a Jacobian's zeros need rows)
            for i in self.plan.wrt:  # inputs, and nodes (the output itself starts from its seed)
                sources: dict = {}
                locations = self._shares(i, o, sources)
                own = self.seeds[o] if i == o else None
                k = self.intake.key("grad", f"{o}[{i}]", ident(self.val[i]), list(sources),
                                    locations, own, self.pull)
                basis = self.seeds[o] if self.pull.stacked else None
                grads[i] = self.g.task(k, None, tasks.gradient,
                                       tuple((k, p) for _, k, p in locations), self.val[i], output,
                                       basis, own, self.items,
                                       *(self.sources[src] for src in sources))
            results[o] = (self.val[o], grads)
        return results

    def _shares(self, name: str, output: str, sources: dict, within=None) -> tuple:
        """Where ``name``'s cotangent for ``output`` comes from: ``(source, output index,
        position)`` for each stage that consumes it, other than its own stage ``within``.
        ``sources`` maps the idents of those stages' backward tasks, in the order they are the
        task's arguments, to ``source``, their index; new ones are added."""
        locations = []
        for s in _feeding(self.plan.consumers(name, output), self.stage_of, within):
            source = sources.setdefault(ident(self.bwd[s]), len(sources))
            locations.append((source, self.through[s].index(output), s.deps.index(name)))
        return tuple(locations)

    def _label(self, s) -> str:
        return f"{s.name}[{abbreviate(self.through[s])}]"


def _kind_of(stage, spec) -> str:
    """A forward task's kind, as its key names it: ``jvp`` where the stage pushes tangents
    (a lifted node, :mod:`daskdag.rules.lifted`), else ``fwd``."""
    lifted = any(isinstance(unwrap(spec.nodes[n].fn), Lift) for n in stage.nodes)
    return "jvp" if lifted else "fwd"


def _feeding(uses, stage_of, within=None) -> list:
    """The stages of the consuming nodes in ``uses``, each once, other than ``within``: those
    that pull a share of the cotangent back."""
    return [s for s in dict.fromkeys(stage_of[c] for c, _ in uses) if s is not within]


