"""The public entry points of reverse mode: :func:`compute_grads`, :func:`sweep_grads`,
their lazy forms, and the results they return (Jacobians: :mod:`daskdag.full_jacobians`). Each checks its arguments
(:mod:`daskdag.model.request`), builds its graph (:mod:`daskdag.graph`) and runs it
(:mod:`daskdag.running`; sweeps, :mod:`daskdag.sweeps`)."""

from __future__ import annotations

import os

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, Callable, overload


from daskdag.durable import calls as durable
from daskdag.errors import DAGError, NodeError
from daskdag.graph.build import GradientSeeding, build
from daskdag.graph.stages import Stage, stages_for
from daskdag.graph.whole import WholeGradients, one_task, program_task, whole_stage
from daskdag.graph.whole import fits as whole_fits
from daskdag.model.leaves import PyTree
from daskdag.model.plan import Plan, ship
from daskdag.model.request import (batched_names, check_chunk_size, check_errors,
                                   cotangents_for, given_values, one_input, parsed, prepare)
from daskdag.running import log, programs
from daskdag.running.compute import where
from daskdag.running.jobs import CallInfo, Job, Spreading, call, lazy, not_on_processes
from daskdag.running.programs import Program
from daskdag.running.reuse import Kept, kept_part
from daskdag.running.lazy import Call
from daskdag.running.local import GraphInOneTask, Template, run_graph, slot
from daskdag.running.log import where as where_in_words
from daskdag.sweeps import arrays, planning, sweep
from daskdag.sweeps.store import SweepStore
from daskdag.transport import transports
from daskdag.transport.transports import Transport

if TYPE_CHECKING:
    from distributed import Client
    from zarr.abc.store import Store as ZarrStore

    from daskdag.model.spec import Spec

@dataclass(frozen=True, repr=False)
class Result:
    """One output's ``value`` and ``grad``, from [`compute_grads`][daskdag.compute_grads],
    [`jacobian`][daskdag.jacobian] or [`sweep_grads`][daskdag.sweep_grads].

    Attributes:
        value: the output's value; from a sweep, stacked over the items.
        grad: shaped like ``x`` when the DAG has one free input, else a dict ``{input: grad}``
            over the differentiated inputs (for a Jacobian, ``jax.jacrev``'s layout); from a
            sweep, stacked over the items.
        failed: from a sweep with ``errors='collect'``, each item that failed and its
            [`NodeError`][daskdag.NodeError]; its rows hold NaN. Empty otherwise.
        info: how the call was computed ([`CallInfo`][daskdag.CallInfo]: mode, passes,
            whether an earlier call's preparation served it).
    """

    value: Any
    grad: Any
    failed: Mapping[int, NodeError] = field(default_factory=dict)
    info: CallInfo | None = None

    def __repr__(self) -> str:
        failed = f", failed={dict(self.failed)!r}" if self.failed else ""
        return f"Result(value={self.value!r}, grad={self.grad!r}{failed}, info={self.info!r})"


@overload  # (a str is a Sequence[str] too: the first that fits, str, wins)
def compute_grads(dag: Mapping[str, Any], x: PyTree, outputs: str, *,
                  wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
                  client: Client | None = None, scheduler: str | Client | None = None,
                  progress: bool = False,
                  store: str | os.PathLike | ZarrStore | None = None) -> Result: ...


@overload
def compute_grads(dag: Mapping[str, Any], x: PyTree, outputs: Sequence[str], *,
                  wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
                  client: Client | None = None, scheduler: str | Client | None = None,
                  progress: bool = False,
                  store: str | os.PathLike | ZarrStore | None = None) -> dict[str, Result]: ...


def compute_grads(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
                  wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
                  client: Client | None = None, scheduler: str | Client | None = None,
                  progress: bool = False, store: str | os.PathLike | ZarrStore | None = None
                  ) -> Result | dict[str, Result]:
    """Values and gradients of ``outputs`` of ``dag``, each node computed once.

    Args:
        dag: ``{name: (fn, [deps])}`` or ``{name: daskdag.Node(fn, deps, jit=...)}``; a dep that
            is no node's name is a free input.
        x: the free input's value (any pytree of arrays) when there is one, else a mapping
            ``{input_name: value}``. With one free input, a mapping with the input's name as a
            key is that form too (``{"x": value}``), and one that reads as values for other
            names is refused (keys that all name nodes, or one array under a single other
            name): ``{"x": that mapping}`` gives it as the value.
        outputs: node names; a single name returns a single [`Result`][daskdag.Result].
        wrt: input names to differentiate; default every given input with a floating-point
            leaf. Within an input, floating-point (and complex) array leaves are
            differentiated, other leaves (ints, bools, functions) held constant. Node
            names too: their gradient is d output / d the node's value (its cotangent in
            the same backward pass; zeros where the output does not depend on it).
        cotangents: ``{output: ct}`` seeds for outputs that are not real scalars (scalars get 1).
        client: a ``distributed.Client``; default the active one, else Dask's threaded scheduler.
        scheduler: as Dask's own ``scheduler=``: ``"threads"`` or ``"sync"`` run in this process
            even while a default client exists; a ``distributed.Client`` is ``client=``.
        progress: show Dask's progress bar over the call's tasks (``dask.diagnostics.ProgressBar``
            on the local scheduler, ``distributed.progress``'s text bar on a cluster).
        store: a directory (made if missing) or a Zarr store object, where each stage's
            forward result (its nodes' values and the residuals its backward pass needs) is
            written durably by the task that computed it, as it finishes, so that the call
            outlives its client and its scheduler: the same call with the same store runs
            only the stages the store does not hold, and returns what an uninterrupted call
            returns, bit for bit. A store holding another call (a node, input, output,
            ``wrt``, cotangent or setting changed, an array changed in place included) raises
            [`StoreError`][daskdag.StoreError] naming what changed, and so does one another
            call or sweep is using, or a location that holds something else. Default None:
            nothing is kept. See the guide "Durable calls".

    Returns:
        ``{output: Result(value, grad)}`` (a single name: one [`Result`][daskdag.Result]);
            each gradient has its input's (or node's) structure, with ``None`` at the leaves
            held constant, and JAX arrays of the leaves' JAX dtypes (as ``jax.grad`` gives them:
            float32 for a Python float), whether JAX or a node's own NumPy rule computed them.
            [`grads`][daskdag.grads] is the same call, not computed yet.

    Raises:
        DAGError: a malformed call, naming the node, input or output concerned.
        NodeError: a node raised, in its forward or backward pass.
        ClusterError: the cluster cannot run the graph: a client that is not running, no
            worker within ``daskdag.worker-wait``, a resource no worker offers, versions that
            differ.
        StoreError: with ``store``: the store holds another call, or is in use, or is not a
            daskdag store, or its disk is full (the stages written before stay usable).

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    res = daskdag.compute_grads(dag, jnp.arange(3.0), ["A", "B"], cotangents={"A": jnp.ones(3)})
    print(res["B"].value, res["B"].grad)  # sum(sin(x)**2), sin(2x)
    ```
    """
    client, local = where(client, scheduler)
    if store is not None:
        return durable.call(Grads(dag, outputs, wrt, cotangents), "compute_grads", x,
                            client=client, local=local, progress=progress, store=store)
    return call(Grads(dag, outputs, wrt, cotangents), x, client=client, local=local,
                progress=progress)


def grads(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
          wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None) -> Call:
    """[`compute_grads`][daskdag.compute_grads], not computed yet: a Dask collection (``Call``)
    whose ``.compute()`` returns what [`compute_grads`][daskdag.compute_grads] does; ``dask.compute``,
    ``dask.persist`` and ``.visualize()`` take it with any other Dask collection, and the
    forward tasks of calls computed together are shared. It runs where Dask runs it: the
    default ``distributed`` client in effect at compute time (checked then, as
    [`compute_grads`][daskdag.compute_grads] checks it), else the scheduler passed to ``compute``, else threads.
    ([`compute_grads`][daskdag.compute_grads] on a cluster also keeps the call's inputs and nodes there for the
    next calls; a lazy call carries them in its graph.)

    For example:

    ```python
    import dask
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    call = daskdag.grads(dag, jnp.arange(3.0), "B")
    res, total = dask.compute(call, dask.delayed(sum)([1, 2]))
    print(res.grad, total)
    ```
    """
    return lazy(Grads(dag, outputs, wrt, cotangents), x)


@dataclass(frozen=True)
class Gradients:
    """:func:`compute_grads` compiled (:mod:`daskdag.running.programs`): the checked plan, its
    node functions packed for its ``transport``, its stages, the names of its ``inputs``, and
    for a call in this process its graph (a :class:`~daskdag.running.local.Template` whose
    slots take the inputs and the outputs' cotangents); the whole call as one program where it
    is one (:mod:`daskdag.graph.whole`): run at once in this process, one task on a cluster; on
    a cluster, how its calls spread (:class:`~daskdag.running.jobs.Spreading`); where some nodes
    keep their values from one call to the next (:mod:`daskdag.running.reuse`), those nodes and
    the program of the others, which an eager call runs."""

    plan: Plan
    stages: tuple[Stage, ...]
    inputs: tuple[str, ...]
    template: Template | None
    transport: Transport
    whole: WholeGradients | None = None  # the call as one program (daskdag.graph.whole)
    spreading: Spreading = field(default_factory=Spreading, compare=False)
    kept: tuple[Kept, Gradients] | None = field(default=None, compare=False)

    @classmethod
    def make(cls, dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str],
             wrt: Sequence[str] | None, cotangents: Mapping[str, PyTree] | None,
             transport: Transport, watch: programs.Watch, hold: bool = True) -> Gradients:
        """``hold``: the DAG's functions are the user's, held weakly
        (:meth:`~daskdag.running.programs.Watch.hold`); False for a DAG of daskdag's own making,
        which holds the user's functions itself."""
        request = prepare(dag, x, outputs, wrt, cotangents, watch.hold if hold else None)
        plan = ship(request.plan, transport, watched(request.plan, transport, watch))
        inputs = tuple(request.values)
        split = kept_part(plan)
        kept = None if split is None else (
            Kept(split[0], transport),
            cls.of(split[1], (*inputs, *split[0].outputs), transport))
        return cls.of(plan, inputs, transport, kept)

    @classmethod
    def of(cls, plan: Plan, inputs: tuple[str, ...], transport: Transport,
           kept: tuple[Kept, Gradients] | None = None) -> Gradients:
        """The program of ``plan`` (shipped), whose calls give values to ``inputs``; with
        ``kept``, its eager calls run ``kept``'s program, and its own graph is built only by a
        call that runs it (a lazy or durable one), not kept as a template."""
        stages = stages_for(plan, transport.packs)
        template = None if transport.packs or kept is not None else Template(
            cls.graph_template(plan, inputs, stages, transport))
        stage = whole_stage(plan, stages)
        whole = None if stage is None else WholeGradients.of(plan, stage, not transport.packs)
        return cls(plan, stages, inputs, template, transport, whole, kept=kept)

    @staticmethod
    def graph_template(plan: Plan, inputs: tuple[str, ...], stages: Sequence[Stage],
                       transport: Transport, place: Any = None) -> Any:
        """The graph of a call, with slots for its inputs, the outputs' cotangents and the stop
        signal; ``place`` as for :func:`~daskdag.graph.build.build`."""
        return build(plan, {i: slot("input", i) for i in inputs},
                     GradientSeeding({o: slot("cotangent", o) for o in plan.outputs}),
                     transport, place=place, stop=slot("stop"), stages=stages)

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
        return GraphInOneTask.built(partial(self.graph_template, self.plan, self.inputs,
                                            self.stages, self.transport), slots,
                                    self.one_task_needs or {})

    def job(self, x: PyTree, cotangents: Mapping[str, PyTree] | None, info: CallInfo,
            outputs: str | Sequence[str], keep: Any = None) -> Job:
        """The call for inputs ``x`` and ``cotangents`` (its data); ``keep`` as for
        :class:`~daskdag.running.jobs.Job`."""
        values = input_values(self.plan.spec, x)
        cts = cotangents_for(self.plan.outputs, cotangents)
        job = self.job_of(values, cts, info, outputs, keep)
        if self.kept is None:
            return job
        kept, rest = self.kept

        def before(client: Any, local: str | None, progress: bool) -> Job:
            found = kept.values(values, client, local, progress)
            reused = kept.plan.needed if found.reused else ()
            if reused:
                log.reused(job.kind, reused)
            return rest.job_of({**values, **found.values}, cts, replace(info, reused=reused),
                               outputs, keep)

        return replace(job, before=before)

    def job_of(self, values: dict, cts: dict, info: CallInfo, outputs: str | Sequence[str],
               keep: Any = None) -> Job:
        """:meth:`job`, the inputs' values and the outputs' cotangents given by name."""
        plan, template = self.plan, self.template

        whole = self.whole

        def make(place: Any, stop: Any) -> Any:
            if whole is not None and place is not None and whole_fits(whole.stage, values):
                return one_task(whole, values, cts, self.transport, place)
            if template is not None:
                return template.fill({**{slot("input", i): v for i, v in values.items()},
                                      **{slot("cotangent", o): cts.get(o) for o in plan.outputs},
                                      slot("stop"): stop})
            return build(plan, values, GradientSeeding(cts), self.transport, place=place,
                         stop=stop, stages=self.stages)

        def contained(place: Any) -> Any:
            graph = self.in_one_task
            return program_task(graph, "graph", graph.needs, run_graph,
                                [(kind, name, values[name] if kind == "input" else cts.get(name))
                                 for kind, name in graph.slots], self.transport, place,
                                graph.kept)

        def stored(place: Any, stop: Any, keeper: Any) -> Any:
            return build(plan, values, GradientSeeding(cts), self.transport, place=place,
                         stop=stop, stages=self.stages, keep=keeper)

        finish = partial(_results, plan.spec, outputs, info=info)
        direct = None if whole is None or self.transport.packs else partial(
            _directly, whole, finish, values, cts)
        return Job(plan, make, finish, "compute_grads", keep=keep, direct=direct,
                   contained=None if self.one_task_needs is None else contained,
                   spreading=self.spreading, stored=stored)


def _directly(whole: WholeGradients, finish: Callable[[dict], Any], values: dict,
              cts: dict) -> Any:
    """The call's result from its one program, or None where it cannot run it."""
    computed = whole(values, cts)
    return None if computed is None else finish(computed)


@dataclass(frozen=True)
class Grads:
    """:func:`compute_grads` as a kind of call (:class:`~daskdag.running.jobs.Kind`): its
    program is a :class:`Gradients`; a call's data, its cotangents (given here once, as
    [`value_and_grad`][daskdag.value_and_grad] takes them)."""

    dag: Mapping[str, Any]
    outputs: str | Sequence[str]
    wrt: Sequence[str] | None
    cotangents: Mapping[str, PyTree] | None

    def compile(self, x: PyTree, data: tuple, transport: Transport
                ) -> tuple[Program[Gradients], str | None]:
        return programs.compile(
            "grads", self.dag, x, (names_key(self.outputs), names_key(self.wrt), transport),
            partial(Gradients.make, self.dag, x, self.outputs, self.wrt, self.cotangents,
                    transport))

    def job(self, program: Program[Gradients], x: PyTree, data: tuple, why: str | None,
            where: str) -> Job:
        made = program.value
        info = CallInfo("compute_grads", "rev", len(made.plan.outputs), prepared=why is None,
                        why=why, where=where)
        return made.job(x, self.cotangents, info, self.outputs, keep=entries(self.dag))


def entries(dag: Mapping[str, Any]) -> tuple:
    """The DAG's entries, for a lazy call to keep (:class:`~daskdag.running.jobs.Job`)."""
    return tuple(dag.values())


def names_key(names: Any) -> Any:
    """Output or ``wrt`` names as (part of) a preparation's key."""
    return names if names is None or isinstance(names, str) else tuple(names)


def input_values(spec: Spec, x: PyTree) -> dict[str, Any]:
    """``{input: value}`` of inputs already checked (:func:`daskdag.model.request.input_values`)
    for inputs like ``x`` (a preparation's key holds their structure)."""
    return given_values(spec, x)


def watched(plan: Plan, transport: Transport, watch: programs.Watch) -> dict[int, Any]:
    """The fingerprints of the node functions :func:`~daskdag.model.plan.ship` packs for
    ``plan`` and ``transport``, by ``id``, each taken through ``watch``."""
    prints: dict[int, Any] = {}
    for n in plan.needed:
        node = plan.spec.nodes[n]
        if transport.packs_function(node.jit) and id(node.fn) not in prints:
            prints[id(node.fn)] = watch(n, node.fn)
    return prints


@overload  # (a str is a Sequence[str] too: the first that fits, str, wins)
def sweep_grads(dag: Mapping[str, Any], xs: PyTree, outputs: str, *,
                batched: Sequence[str] | None = None, wrt: Sequence[str] | None = None,
                cotangents: Mapping[str, PyTree] | None = None, chunk_size: int | None = None,
                client: Client | None = None, scheduler: str | Client | None = None,
                progress: bool = False, errors: str = "raise",
                store: str | os.PathLike | SweepStore | ZarrStore | None = None
                ) -> Result: ...


@overload
def sweep_grads(dag: Mapping[str, Any], xs: PyTree, outputs: Sequence[str], *,
                batched: Sequence[str] | None = None, wrt: Sequence[str] | None = None,
                cotangents: Mapping[str, PyTree] | None = None, chunk_size: int | None = None,
                client: Client | None = None, scheduler: str | Client | None = None,
                progress: bool = False, errors: str = "raise",
                store: str | os.PathLike | SweepStore | ZarrStore | None = None
                ) -> dict[str, Result]: ...


def sweep_grads(dag: Mapping[str, Any], xs: PyTree, outputs: str | Sequence[str], *,
                batched: Sequence[str] | None = None, wrt: Sequence[str] | None = None,
                cotangents: Mapping[str, PyTree] | None = None, chunk_size: int | None = None,
                client: Client | None = None, scheduler: str | Client | None = None,
                progress: bool = False, errors: str = "raise",
                store: str | os.PathLike | SweepStore | ZarrStore | None = None
                ) -> Result | dict[str, Result]:
    """[`compute_grads`][daskdag.compute_grads] for every item of a batch, spread over the cluster in chunks.

    Args:
        xs: like ``x`` of [`compute_grads`][daskdag.compute_grads], the ``batched`` inputs carrying a leading
            item axis of one common length N.
        batched: the inputs that carry it (default: all given); the others are shared by every
            item and sent to each worker once.
        wrt: default every batched input with floating leaves. A shared input named here gets
            a gradient per item; a node, its gradient per item (as for compute_grads).
        cotangents: ``{output: ct}`` for outputs that are not real scalars, shaped like one item's
            output; the same for every item.
        client: as for [`compute_grads`][daskdag.compute_grads] (``"sync"``: one chunk at a time).
        scheduler: as for [`compute_grads`][daskdag.compute_grads] (``"sync"``: one chunk at a time).
        chunk_size: items per chunk (default: about four chunks per worker thread, at most 256;
            when every node that carries items is ``vmap=True``, one chunk per worker
            thread, at most 64 MiB of items each).
            Within a chunk, ``Node(vmap=True)`` nodes run vectorized, others item by item.
        progress: show a progress bar over items, in the look of a call's (Dask's text bar),
            on stderr; it advances as items are done inside running chunks, and ends at the
            exact number of items computed.
        errors: ``'raise'``: the first failing item's [`NodeError`][daskdag.NodeError], naming the
            item and node. ``'collect'``: every item that succeeded, and in
            ``Result.failed`` the ones that did not; their rows hold NaN.
        store: a directory (made if missing), a Zarr store object (an object store...), or a
            [`SweepStore`][daskdag.SweepStore], where each chunk's values, gradients and failed items
            are written as the chunk finishes, durably, so that the sweep outlives this
            process: the same call with the same store computes only the chunks it does not
            hold, and returns what an uninterrupted sweep returns. A store holding another
            sweep (another DAG, other inputs, outputs or settings) raises
            [`StoreError`][daskdag.StoreError] naming what changed, and so does one another sweep is
            writing to, or a location that holds something else. Its chunk size is the
            store's; without ``chunk_size``, items computed one by one (no ``vmap=True`` node)
            are written in pieces of about 10 s of work, so that an interrupt early in a long
            sweep finds something saved. With dask-array items, or
            ``SweepStore(..., lazy=True)``, the results are dask arrays reading the store. See
            the sweeps guide, "Durable sweeps".

    Returns:
        ``{output: Result(value, grad, failed)}``, values and gradients as NumPy arrays
            stacked on a leading axis of length N (gradients shaped ``(N, *input item shape)``,
            values ``(N, *item output shape)``).

    When no item gives a result (N = 0, or every item failed with ``errors='collect'``), the
    shapes come from tracing the nodes with ``jax.eval_shape`` on one item's shapes (no data;
    a node's Python code runs once on abstract values): gradients are always shaped (zero or
    NaN rows), and values too unless a node on the way cannot be traced abstractly (Python
    control flow on values, ``float(x)``, non-JAX code). Then that output's ``value`` is
    ``None``.

    Ctrl-C (``KeyboardInterrupt``) stops the sweep: chunks that have not started never do,
    running ones stop after their current item, on threads and on a cluster. With a store,
    what was computed is written first, and the ``KeyboardInterrupt`` says how much: "N of M
    items saved in STORE; run the same call again to resume".

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    xs = jnp.arange(12.0).reshape(4, 3)  # 4 items of 3
    res = daskdag.sweep_grads(dag, xs, "B")
    print(res.value.shape, res.grad.shape)  # (4,) (4, 3)
    ```
    """
    client, local = where(client, scheduler)
    if local == "processes":
        raise DAGError(not_on_processes("sweep_grads"))
    check_errors(errors)
    check_chunk_size(chunk_size)
    if arrays.holds_dask({"": xs}, [""]):  # lazily, over dask arrays (daskdag.sweeps.arrays)
        spec, names, values = parsed(dag, xs, outputs)
        batched = batched_names(values, batched)
        if arrays.holds_dask(values, batched) and store is None:
            return _results(spec, outputs, arrays.sweep_grads(
                spec, outputs, names, values, batched, wrt=wrt, cotangents=cotangents,
                chunk_size=chunk_size, client=client, progress=progress, errors=errors))
    transport = transports.for_call(client)
    like = arrays.stand_in(xs)  # (a store's dask-array items are read chunk by chunk)
    program, why = programs.compile(
        "sweep", dag, like, (names_key(outputs), names_key(batched), names_key(wrt), transport),
        partial(planning.prepare, dag, like, outputs, batched, wrt, cotangents, transport),
        inputs=planning.item_signature(dag, like, batched))
    made = program.value
    spec = made.plan.spec
    try:
        computed, failed = sweep.sweep(made, input_values(spec, xs), cotangents, chunk_size,
                                       client, local, progress, errors, store=store, dag=dag)
    except sweep.Interrupted as e:  # Ctrl-C: what is saved, without daskdag's frames
        raise KeyboardInterrupt(str(e)) from None
    info = CallInfo("sweep_grads", "rev", len(made.plan.outputs), prepared=why is None, why=why,
                    where=where_in_words(client, local))
    return _results(spec, outputs, computed, failed, info)


def _results(spec: Spec, outputs: str | Sequence[str], computed: dict[str, Any],
             failed: Mapping[int, NodeError] | None = None, info: CallInfo | None = None
             ) -> Result | dict[str, Result]:
    """``{output: Result}`` (one ``Result`` for a single name) from ``{output: (value, {input:
    grad})}``; with one free input, its gradient alone."""
    results = {o: Result(v, g[spec.inputs[0]] if one_input(spec, g) else g, failed or {}, info)
               for o, (v, g) in computed.items()}
    return results[outputs] if isinstance(outputs, str) else results


