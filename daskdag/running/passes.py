"""The one program every kind of call runs: a forward pass over a DAG and, where the call
pulls cotangents back, a reverse pass from its outputs' seeds (:class:`Compiled`), and the
derivative kinds as strategies over it (:class:`Derivative`).

A kind of call is *lowered* (:class:`Lowered`) to what those passes run: a DAG (the user's,
or lifted to forward-mode pairs where the call pushes tangents: :mod:`daskdag.rules.lifted`),
the names its reverse pass differentiates (none: a forward pass alone) and its seeds (a
Jacobian's rows: :class:`~daskdag.graph.tasks.Rows`):

=================  ===========================  ==================  =======================
kind               DAG                          reverse pass        seeds
=================  ===========================  ==================  =======================
gradients          the user's                   from the outputs    cotangents (1)
Jacobian, rev      the user's                   from the outputs    rows of the identity
Jacobian, fwd      lifted, identity's columns   none                none
JVPs               lifted, your tangents        none                none
HVPs               lifted, your ``v``           from the outputs    ``(0, ct)`` on tangents
=================  ===========================  ==================  =======================

Everything else is written once, here and below, for every kind: the program compiled once
(:mod:`daskdag.running.programs`); the graph of a call in this process built once
(:class:`~daskdag.running.local.Template`); the whole call as one XLA program
(:mod:`daskdag.graph.whole`); on a cluster, spread or in one task
(:class:`~daskdag.running.jobs.Spreading`); reuse across calls (:mod:`daskdag.running.reuse`);
a durable store (:meth:`~daskdag.running.jobs.Job.stored`); a lazy call
(:func:`~daskdag.running.jobs.as_collection`); sweeps (:mod:`daskdag.sweeps`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Any, Callable, ClassVar

import jax
from dask.task_spec import TaskRef

from daskdag.graph.build import GradientSeeding, JacobianSeeding, build
from daskdag.graph.stages import Stage, stages_for
from daskdag.graph.tasks import Rows
from daskdag.graph.whole import Entry, WholeGradients, one_task, program_task, whole_stage
from daskdag.graph.whole import fits as whole_fits
from daskdag.model import devices
from daskdag.model.leaves import PyTree, is_array
from daskdag.model.plan import Plan, make_plan, ship
from daskdag.model.request import given_values, names_the_input, parsed
from daskdag.model.spec import Spec
from daskdag.running import programs
from daskdag.running.compute import log_reused
from daskdag.running.jobs import CallInfo, Job, Spreading
from daskdag.running.local import GraphInOneTask, Template, run_graph, slot
from daskdag.running.programs import Program
from daskdag.running.reuse import KEPT, Kept, kept_part
from daskdag.transport.transports import Transport


@dataclass(frozen=True)
class Lowered:
    """A kind of call lowered to passes (the module's docstring): the ``plan`` they run (its
    functions not packed yet; its ``wrt``, what the reverse pass differentiates), the
    ``inputs`` a call gives, ``wrt``, the names the call differentiates by (inputs and nodes,
    as resolved), ``moving``, the inputs whose values are the call's data (tangents: no node
    that reads them is kept between calls), ``rows`` (a Jacobian's reverse pass, else None:
    seeded by cotangents), the user's ``spec``, and what the kind needs to make its results
    of the passes' (``extra``). ``tail``: where the call is one program in this process, the
    first part of the kind's ``finish``, run in that program (jittable and hashable, the same
    for the same call; ``finish`` takes what it returns)."""

    plan: Plan
    inputs: tuple[str, ...]
    spec: Spec
    wrt: tuple[str, ...]
    moving: tuple[str, ...] = ()
    rows: Rows | None = None
    extra: Any = None
    tail: Callable[[dict], Any] | None = None

    def bare(self) -> Lowered:
        """This without the user's functions (:meth:`Plan.bare`; its ``extra``'s too,
        where it has a ``bare``): what its results are made with, which travels with a lazy
        call to where Dask finishes it. Made once."""
        made = self.__dict__.get("_bare")
        if made is None:
            extra = self.extra.bare() if hasattr(self.extra, "bare") else self.extra
            made = replace(self, plan=self.plan.bare(), spec=self.spec.bare(), extra=extra)
            object.__setattr__(self, "_bare", made)
        return made

    def __getstate__(self) -> dict:  # (its bare form travels as itself, never beside it)
        return {k: v for k, v in self.__dict__.items() if k != "_bare"}


@dataclass(frozen=True)
class Compiled:
    """A lowered call compiled (:mod:`daskdag.running.programs`), its node functions packed for
    its ``transport``: the parts the module's docstring lists; ``kept``: where some nodes keep
    their values between calls, those nodes and the passes of the others, which a call runs."""

    plan: Plan
    stages: tuple[Stage, ...]
    inputs: tuple[str, ...]
    transport: Transport
    rows: Rows | None = None
    whole: WholeGradients | None = None
    spreading: Spreading = field(default_factory=Spreading, compare=False)
    kept: tuple[Kept, Compiled] | None = field(default=None, compare=False)
    lowered: Lowered | None = field(default=None, compare=False)  # (what it was compiled of)

    @classmethod
    def make(cls, lowered: Lowered, transport: Transport, watch: programs.Watch) -> Compiled:
        """``lowered`` compiled for ``transport``; ``watch`` takes the fingerprints of the
        functions it packs."""
        plan = ship(lowered.plan, transport, watched(lowered.plan, transport, watch))
        split = kept_part(plan, lowered.moving)
        kept = None if split is None else (
            Kept(split[0], transport),
            cls.of(split[1], (*lowered.inputs, *split[0].outputs), transport, lowered.rows))
        return cls.of(plan, lowered.inputs, transport, lowered.rows, kept, lowered)

    @classmethod
    def of(cls, plan: Plan, inputs: tuple[str, ...], transport: Transport,
           rows: Rows | None = None, kept: tuple[Kept, Compiled] | None = None,
           lowered: Lowered | None = None) -> Compiled:
        """The passes of ``plan`` (shipped), whose calls give values to ``inputs``; with
        ``kept``, a call now runs ``kept``'s passes."""
        stages = stages_for(plan, transport.packs)
        stage = whole_stage(plan, stages)
        whole = None if stage is None else WholeGradients.of(
            plan, stage, not transport.packs, rows is not None, rows.colours if rows else ())
        made = cls(plan, stages, inputs, transport, rows, whole, kept=kept, lowered=lowered)
        _ = made.template  # (built now, with the program: a call only fills it)
        return made

    @cached_property
    def template(self) -> Template | None:
        """A call in this process: its graph, built once, with slots for its inputs, the
        outputs' cotangents and the stop signal (None: where values are packed, or some nodes
        are kept: then a call builds the graph it runs)."""
        return None if self.transport.packs or self.kept is not None else Template(self.slotted())

    def slotted(self, place: Any = None) -> dict:
        """The graph of a call whose values are slots (:func:`~daskdag.running.local.slot`);
        ``place`` as for :func:`~daskdag.graph.build.build`."""
        return self.build({i: slot("input", i) for i in self.inputs},
                          {o: slot("cotangent", o) for o in self.plan.outputs}, place,
                          slot("stop"))

    @property
    def whole_here(self) -> WholeGradients | None:
        """The whole program a call runs in this process (None: none, values packed, or some
        nodes kept between calls)."""
        if self.whole is None or self.transport.packs or self.kept is not None or \
                self.lowered is None:
            return None
        return self.whole

    @property
    def one_task_needs(self) -> dict | None:
        """On a cluster, the resources of the call's graph run whole in one task, where it can
        be (None: in this process or a lazy call, a whole program's call, or stages that need
        different resources, which no one worker may have)."""
        needs = {stage.needs for stage in self.stages}
        if not self.transport.remote or self.whole is not None or len(needs) != 1:
            return None
        return dict(needs.pop())

    @cached_property
    def in_one_task(self) -> GraphInOneTask:
        """The call's graph to run whole in one task (where :attr:`one_task_needs`), built at
        the first call that runs that way."""
        slots = (*(("input", i) for i in self.inputs),
                 *(("cotangent", o) for o in self.plan.outputs))
        return GraphInOneTask.built(self.slotted, slots, self.one_task_needs or {})

    def job(self, values: dict, cts: dict, info: CallInfo, finish: Callable[[CallInfo, dict], Any],
            keep: Any = None) -> CompiledJob:
        """The call of the input ``values`` (by name) and the outputs' cotangents ``cts``,
        whose results ``finish(info, computed)`` makes (with :attr:`kept`, its values first);
        ``keep`` as for :class:`~daskdag.running.jobs.Job`."""
        return CompiledJob(self, values, cts, info, finish, keep)

    def build(self, values: dict, cts: dict, place: Any = None, stop: Any = None,
              keep: Any = None, base: Any = None) -> dict:
        """The graph of a call of ``values`` and cotangents ``cts`` (a Jacobian's: its ``rows``;
        :func:`~daskdag.graph.build.build`, ``place``, ``stop``, ``keep`` and ``base`` as there)."""
        seeding = GradientSeeding(dict(cts)) if self.rows is None else JacobianSeeding(self.rows)
        return build(self.plan, values, seeding, self.transport, place=place, stop=stop,
                     stages=self.stages, keep=keep, base=base)


@dataclass(frozen=True)
class CompiledJob(Job):
    """A call of a :class:`Compiled` program (:meth:`Compiled.job`), and every way it runs: its
    input ``values`` by name, its outputs' cotangents ``cts``, its ``info``, and ``done``,
    which makes its results (``done(info, computed)``); ``keep`` as for
    :class:`~daskdag.running.jobs.Job`; ``keeper``: a durable call's, where every graph it
    makes keeps its stages (:meth:`stored`)."""

    compiled: Compiled
    values: dict
    cts: dict
    info: CallInfo
    done: Callable[[CallInfo, dict], Any]
    keep: Any = None
    keeper: Any = None

    @property
    def plan(self) -> Plan:  # type: ignore[override]
        return self.compiled.plan

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.info.call

    @property
    def solves(self) -> dict:  # type: ignore[override]
        return self.info.solves

    @property
    def spreading(self) -> Spreading | None:  # type: ignore[override]
        compiled = self.compiled
        return None if compiled.one_task_needs is None or self.keeper is not None \
            else compiled.spreading

    def finish(self, computed: dict) -> Any:
        return self.done(self.info, computed)

    def graph(self, place: Any, stop: Any) -> Any:
        compiled = self.compiled
        if self.keeper is not None:
            return self.stored(place, stop, self.keeper)
        whole = compiled.whole
        if whole is not None and place is not None and whole_fits(whole.stage, self.values):
            return one_task(whole, self.values, self.cts, compiled.transport, place)
        if compiled.template is not None:
            return compiled.template.fill(
                {**{slot("input", i): v for i, v in self.values.items()},
                 **{slot("cotangent", o): self.cts.get(o) for o in compiled.plan.outputs},
                 slot("stop"): stop})
        return self.stored(place, stop, None)

    def stored(self, place: Any, stop: Any, keep: Any) -> dict:
        return self.compiled.build(self.values, self.cts, place, stop, keep)

    def in_one_task(self, place: Any) -> Any:
        compiled = self.compiled
        graph = compiled.in_one_task
        return program_task(graph, "graph", graph.needs, run_graph,
                            [(kind, name, self.values[name] if kind == "input"
                              else self.cts.get(name)) for kind, name in graph.slots],
                            compiled.transport, place, graph.kept)

    def directly(self) -> Any:
        compiled = self.compiled
        if compiled.whole is None or compiled.transport.packs:
            return None
        lowered = compiled.lowered
        computed = compiled.whole(self.values, self.cts,
                                  None if lowered is None else lowered.tail)
        return None if computed is None else self.finish(computed)

    def ahead(self, client: Any, local: str | None, progress: bool) -> Job:
        if self.compiled.kept is None or self.keeper is not None:
            return self
        kept, rest = self.compiled.kept
        found, again = kept.values(self.values, client, local, progress)
        reused = kept.plan.needed if again else ()
        if reused:
            log_reused(self.info.call, reused)
        return replace(self, compiled=rest, values={**self.values, **found},
                       info=replace(self.info, reused=reused))

    def later(self) -> tuple[dict, Callable[[dict], Any]]:
        # (its finish travels to where Dask finishes the call: the kind's, bound to the info
        # alone, never this job, which holds the user's code)
        if self.compiled.kept is None or self.keeper is not None:
            return self.graph(None, None), partial(self.done, self.info)
        kept, rest = self.compiled.kept
        found = kept.last(self.values)
        if found is not None:  # (the kept nodes' values go in as inputs)
            info = replace(self.info, reused=kept.plan.needed)
            inner = replace(self, compiled=rest, values={**self.values, **found}, info=info)
            return inner.graph(None, None), partial(self.done, info)
        first = kept.graph(self.values)  # (and their values, once computed, are kept)
        graph = rest.build({**self.values, **{n: TaskRef(first[n][0].key) for n in first}},
                           self.cts, base=next(iter(first.values()))[0].dask)
        graph[KEPT] = (graph[self.plan.outputs[0]][0], {n: v for n, (v, _) in first.items()})
        return graph, kept.lazily(self.values, partial(self.done, self.info))


def _on_one_device(finish: Callable[..., Any], info: CallInfo, computed: dict, *args: Any
                   ) -> Any:
    """``finish(info, computed, *args)``, the computed values put on JAX's default device first
    (nodes on several devices computed them)."""
    return finish(info, devices.put(computed, devices.DEFAULT), *args)


def watched(plan: Plan, transport: Transport, watch: programs.Watch) -> dict[int, Any]:
    """The fingerprints of the node functions :func:`~daskdag.model.plan.ship` packs for
    ``plan`` and ``transport``, by ``id``, each taken through ``watch``."""
    prints: dict[int, Any] = {}
    for n in plan.needed:
        node = plan.spec.nodes[n]
        if transport.packs_function(node.jit) and id(node.fn) not in prints:
            prints[id(node.fn)] = watch(n, node.fn)
    return prints


def packed(spec: Spec, outputs: tuple[str, ...], wrt: Sequence[str] | None,
           transport: Transport, watch: programs.Watch) -> Spec:
    """``spec`` with the functions of the nodes a call of ``outputs`` and ``wrt`` runs packed
    for ``transport`` (:func:`~daskdag.model.plan.ship`) before a kind lowers it: as they are
    now, before a kind that traces them (a Jacobian's mode or pattern) runs their code."""
    plan = make_plan(spec, outputs, tuple(w for w in wrt or () if w in spec.nodes))
    return ship(plan, transport, watched(plan, transport, watch)).spec


def names_key(names: Any) -> Any:
    """Output or ``wrt`` names as (part of) a program's key."""
    return names if names is None or isinstance(names, str) else tuple(names)


@dataclass(frozen=True)
class Derivative:
    """A derivative kind, as a strategy over :class:`Compiled` (the module's docstring), with the
    DAG, outputs, ``wrt`` and options of one call (or of a prepared function's every call). A
    kind says what it is (:attr:`call`, :attr:`call_mode`), how it lowers (:meth:`lower`), a
    call's inputs and cotangents (:meth:`inputs`) and its results (:meth:`finish`); the rest
    (:meth:`compile`, :meth:`job`, and what :mod:`daskdag.durable` and :mod:`daskdag.sweeps`
    make of them) is the same for every kind. A call's ``data`` (cotangents, tangents,
    directions; a tuple) are its inputs, never its program's structure."""

    dag: Mapping[str, Any]
    outputs: str | Sequence[str]
    wrt: Sequence[str] | None

    #: The public function of this kind and its sweep's, as :class:`~daskdag.CallInfo` names it.
    call: ClassVar[str]
    sweep_call: ClassVar[str]
    #: Its mode, as :class:`~daskdag.CallInfo` gives it (a kind with several: :meth:`info`).
    call_mode: ClassVar[str]
    #: Whether its calls take data (tangents, ``v``) beside their inputs.
    takes_data: ClassVar[bool] = False
    #: Whether :meth:`finish` only rearranges what it is given (reads no value of it).
    rearranges: ClassVar[bool] = False

    def options(self, data: tuple) -> tuple:
        """What of the kind's options and of a call's ``data`` its program depends on, as a
        key (hashable)."""
        return ()

    def lower(self, spec: Spec, outputs: tuple[str, ...], values: dict, data: tuple,
              candidates: dict, watch: programs.Watch) -> Lowered:
        """The call lowered, for input ``values`` like the call's (one item's, in a sweep)
        and its ``data``; ``candidates``: the inputs ``wrt`` defaults to (those with a
        floating-point leaf among them)."""
        raise NotImplementedError

    def inputs(self, lowered: Lowered, values: dict, data: tuple,
               batched: frozenset | None = None) -> tuple[dict, dict]:
        """``(input values, cotangents)`` of the passes for a call's input ``values`` and
        ``data``; ``batched``: a sweep's inputs that carry a leading axis of items."""
        raise NotImplementedError

    def finish(self, lowered: Lowered, info: CallInfo, computed: dict,
               failed: Mapping | None = None) -> Any:
        """The call's results from the passes' ``{output: (value, {name: grad})}``; a sweep's
        stacked over its items, with the items that ``failed`` (None: a call's)."""
        raise NotImplementedError

    def info(self, lowered: Lowered, data: tuple, why: str | None, where: str) -> CallInfo:
        return CallInfo(self.call, self.call_mode, len(lowered.plan.outputs),
                        prepared=why is None, why=why, where=where)

    def compile(self, x: PyTree, data: tuple, transport: Transport
                ) -> tuple[Program[Compiled], str | None]:
        """The call's program for inputs like ``x`` (:func:`daskdag.running.programs.compile`)."""
        return programs.compile(
            self.call, self.dag, x,
            (names_key(self.outputs), names_key(self.wrt), self.options(data), transport),
            partial(self.make, x, data, transport))

    def make(self, x: PyTree, data: tuple, transport: Transport, watch: programs.Watch
             ) -> Compiled:
        spec, names, values = parsed(self.dag, x, self.outputs, watch.hold)
        lowered = self.lower(packed(spec, names, self.wrt, transport, watch), names, values,
                              data, values, watch)
        return Compiled.make(lowered, transport, watch)

    def job(self, program: Program[Compiled], x: PyTree, data: tuple, why: str | None,
            where: str) -> CompiledJob:
        """The call of ``program`` for inputs ``x`` and ``data``; ``why`` it was compiled (None:
        an earlier call's served), ``where`` it runs, in words."""
        passes = program.value
        lowered = passes.lowered
        assert lowered is not None  # (Compiled.make's)
        values, cts = self.inputs(lowered, given_values(lowered.spec, x), data)
        info = self.info(lowered, data, why, where)
        return passes.job(values, cts, info, self.finishing(lowered),
                          keep=tuple(self.dag.values()))

    def entry(self, program: Program[Compiled], x: PyTree, where: str,
              shape: Callable[[Any], Any]) -> Entry | None:
        """A later call of ``program`` in this process with inputs like ``x`` and no data, as
        its whole program (:meth:`WholeGradients.program`) and ``shape`` of the results made of
        what it returns; None where the call cannot run so (no whole program here, the kind's
        data, a device, a leaf of ``x`` that is not an array)."""
        passes = program.value
        lowered, whole = passes.lowered, passes.whole_here
        if whole is None or whole.stage.device is not None or self.takes_data or \
                not all(map(is_array, jax.tree.leaves(x))):
            return None
        assert lowered is not None  # (whole_here's)
        probe = {i: None for i in lowered.spec.inputs}
        values, cts = self.inputs(lowered, probe, ())
        if values is not probe:  # (the kind makes its own values of the inputs)
            return None
        inputs = lowered.spec.inputs
        info = self.info(lowered, (), None, where)
        finish = partial(self.finishing(lowered), info)
        return Entry(whole, lowered.tail, inputs,
                     len(inputs) == 1 and names_the_input(inputs[0], x), cts,
                     lambda computed: shape(finish(computed)), info, self.rearranges, x)

    def finishing(self, lowered: Lowered) -> Callable[..., Any]:
        """:meth:`finish` of ``lowered``, bound to what it needs and nothing of the user's
        code (a lazy call's travels to where Dask finishes it, which may not import it). Where
        some node has a device, the results are made on JAX's default device, where the
        computed values meet (:func:`_on_one_device`)."""
        finish = partial(self._bare.finish, lowered.bare())
        plan = lowered.plan
        if all(plan.spec.nodes[n].device is None for n in plan.needed):
            return finish
        return partial(_on_one_device, finish)

    @cached_property
    def _bare(self) -> Derivative:
        """The kind without its DAG (:meth:`finishing`), made once."""
        return replace(self, dag={})
