"""A call of a compiled program, run now (the eager functions) or later as a Dask collection
(the lazy ones). Each kind of call is a :class:`Kind`, which compiles its
:class:`~daskdag.running.programs.Program` and makes a :class:`Job` of it for each call."""

from __future__ import annotations

import contextlib
import logging
import time
from functools import partial
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import dask

from daskdag.cancel import Stop
from daskdag.errors import DAGError
from daskdag.model import implicit
from daskdag.model.plan import Plan
from daskdag.running import cluster, resident
from daskdag.running import workers as worker_setup
from daskdag.running.compute import compute, log_submitted, log_whole, logger
from daskdag.running.lazy import Call
from daskdag.running.programs import Held, Program, active_client, in_words, one_program_here
from daskdag.transport import transports
from daskdag.transport.scope import loads
from daskdag.transport.transports import Transport


@dataclass(frozen=True)
class CallInfo:
    """How a call was computed: ``Result.info`` (the same for each output of one call).

    Attributes:
        call: the function called: ``"compute_grads"``, ``"jacobian"``, ``"compute_jvps"``,
            ``"compute_hvps"``, or a sweep: ``"sweep_grads"``, ``"sweep_jacobians"``...
        mode: ``"rev"``: cotangents pulled back from the outputs (gradients; a Jacobian's rows);
            ``"fwd"``: tangents pushed forward from the inputs (JVPs; a Jacobian's columns);
            ``"rev-over-fwd"``: Hessian-vector products.
        passes: how many cotangents (reverse) or tangents (forward) went through the DAG: one
            per output for gradients, per row or column of a Jacobian (per colour when
            sparse), per direction for JVPs.
        colours: the colours of a sparse Jacobian's rows or columns, summed over its outputs
            (each colour is one pass); None for a dense one.
        sparsity: where a sparse Jacobian's pattern came from: ``"given"``, ``"detected"``
            (read off the nodes' jaxprs: it holds at every point, and later calls reuse it),
            ``"probed"`` (some node could not be traced, so its pattern was probed at this
            point and near it; detected again at every call); None when dense.
        prepared: an earlier call's preparation served this call (checks, plan, packed
            functions, mode, pattern, colours: see "Repeated calls" in the guides); False
            when this call made its own.
        why: why this call made its own preparation (``"first call"``, ``"node 'h': its
            function changed ..."``, ``"the inputs' structure, shapes or dtypes changed"``...);
            None when one was reused.
        where: where it ran: this process's threads, a cluster, or a lazy call's Dask.
        reused: the nodes whose values this call took from the call before, their inputs the
            same (``daskdag.reuse``; see "Repeated calls" in the guides); empty when none.
        mode_why: why a Jacobian took its ``mode``: asked for; or, with ``mode="auto"``, the passes
            each mode takes (``"fewer passes: 2 passes forward (input elements) against 6 reverse
            (output elements)"``, ``"forward on a tie: ..."``), or the only mode every node can take
            (``"the only mode that can serve this call: forward mode cannot: node 'f' calls a
            jax.custom_vjp function ..."``). None for the other calls, which have one mode each.
        solves: the solves of implicit nodes ([`Implicit`][daskdag.Implicit], a
            [`coupled`][daskdag.coupled] group's node) that a call (not a sweep) ran, here
            or on a cluster's workers: ``{node: [{"iterations": n, "residual": norm}, ...]}``,
            one entry per solve (``iterations`` None for the user's own solver); none for
            a node whose value was reused. It may miss a solve that ran inside a compiled
            program of the whole call, or whose program called back from a thread of its
            own (JAX's callbacks on some accelerators).
        chunks: a sweep over arrays in memory: how many chunks its items were computed in
            (reruns of a failed chunk's items one by one each count; pieces a store held
            already do not); None for other calls.
    """

    call: str
    mode: str
    passes: int
    colours: int | None = None
    sparsity: str | None = None
    prepared: bool = False
    why: str | None = None
    where: str = ""
    mode_why: str | None = None
    reused: tuple[str, ...] = ()
    solves: dict = field(default_factory=dict, compare=False)
    chunks: int | None = field(default=None, compare=False)

    def __repr__(self) -> str:
        parts = [self.call, self.mode, f"{self.passes} pass{'es' if self.passes != 1 else ''}"]
        if self.sparsity is not None:
            parts.append(f"{self.colours} colours, pattern {self.sparsity}")
        parts.append("prepared before" if self.prepared else f"prepared now ({self.why})")
        if self.where:
            parts.append(self.where)
        if self.reused:
            parts.append(f"reused {', '.join(self.reused)}")
        if self.solves:
            parts.append("solves " + ", ".join(
                f"{n}: {len(s)} ({max((e['iterations'] or 0) for e in s)} iterations at most)"
                for n, s in self.solves.items()))
        return f"CallInfo({', '.join(parts)})"


class Job:
    """A call prepared, which :func:`run` computes now and :func:`as_collection` makes a Dask
    collection: its ``plan``; ``kind``, its name in the log; ``keep``, what a lazy call keeps
    alive (the DAG's entries, whose functions a preparation holds only weakly:
    :mod:`daskdag.transport.weak`); ``solves``, where the solves of its implicit nodes are
    recorded (its :attr:`CallInfo.solves`). :meth:`graph` and :meth:`finish` are every job's;
    the others, a compiled call's (:class:`~daskdag.running.passes.CompiledJob`), say what
    else it can do."""

    plan: Plan
    kind: str
    keep: Any = None
    solves: dict | None = None
    #: On a cluster, whether a call runs spread or in one task (:meth:`in_one_task`); None:
    #: it always spreads.
    spreading: Spreading | None = None

    def graph(self, place: Any, stop: Any) -> Any:
        """Its graph, as :func:`~daskdag.running.compute.compute` takes it; ``place`` keeps
        values on a cluster (:mod:`daskdag.running.resident`), ``stop`` is a local call's stop
        signal."""
        raise NotImplementedError

    def finish(self, computed: dict) -> Any:
        """Its result, from its graph computed."""
        raise NotImplementedError

    def ahead(self, client: Any, local: str | None, progress: bool) -> Job:
        """The job a call now runs: this, or, where it first computes the nodes kept between
        calls (:mod:`daskdag.running.reuse`), the rest's. Lazy and durable calls skip it."""
        return self

    def directly(self) -> Any:
        """Its result from one program run in this process (:mod:`daskdag.graph.whole`), or
        None where it has none or cannot run this call (its graph runs)."""
        return None

    def in_one_task(self, place: Any) -> Any:
        """On a cluster, the call as one task (where :attr:`spreading` says so)."""
        raise NotImplementedError

    def stored(self, place: Any, stop: Any, keep: Any) -> dict:
        """A durable call's graph (:mod:`daskdag.durable.calls`): each stage's forward task kept
        by ``keep`` (a :class:`~daskdag.graph.assembly.Keeper`) or read back from it."""
        raise TypeError(f"{self.kind} cannot keep its stages")

    def later(self) -> tuple[dict, Callable[[dict], Any]]:
        """The call as a Dask collection's graph and its finish, which travels to where Dask
        finishes it (it holds nothing of the user's code)."""
        raise NotImplementedError


@dataclass(frozen=True)
class GraphJob(Job):
    """A job whose graph ``make(place, stop)`` gives, its result that graph computed."""

    plan: Plan
    make: Callable[[Any, Any], dict]
    kind: str

    def graph(self, place: Any, stop: Any) -> Any:
        return self.make(place, stop)

    def finish(self, computed: dict) -> Any:
        return computed


class Kind(Protocol):
    """What :func:`call` and :func:`lazy` need of a kind of call: its ``dag``, :meth:`compile`
    and :meth:`job`, as :class:`~daskdag.running.passes.Derivative` gives them."""

    @property
    def dag(self) -> Mapping[str, Any]:
        ...

    def compile(self, x: Any, data: tuple, transport: Transport) -> tuple[Program, str | None]:
        ...

    def job(self, program: Program, x: Any, data: tuple, why: str | None, where: str) -> Job:
        ...

    def entry(self, program: Program, x: Any, where: str, shape: Callable[[Any], Any]) -> Any:
        ...


def not_on_processes(what: str) -> str:
    """Why ``what`` does not run on Dask's multiprocessing scheduler."""
    return (f"{what} cannot run on Dask's multiprocessing scheduler (scheduler 'processes', "
            f"given as scheduler= or set in dask.config): give scheduler='threads' or 'sync', "
            f"or a distributed client (a LocalCluster runs worker processes)")


#: A lazy call's CallInfo.where.
LAZY = "lazy (where Dask computes it)"


def call(kind: Kind, x: Any, *data: Any, client, local: str | None, progress: bool,
         held: Held | None = None) -> Any:
    """A call of ``kind`` computed now (:func:`run`): on ``client``, else on Dask's ``local``
    scheduler; on its multiprocessing scheduler, as its lazy call (:func:`computed`).
    ``held``: a prepared function's programs, which serve it (else the eager calls' cache);
    one that runs as one program here is run so, and its entry held for the next calls."""
    if local == "processes":
        program, why = kind.compile(x, data, transport=transports.for_call(None, lazy=True))
        return on_processes(as_collection(kind.job(program, x, data, why=why,
                                                   where=in_words(None, local))), progress)
    transport, where = transports.for_call(client), in_words(client, local)
    if held is None:
        program, why = kind.compile(x, data, transport=transport)
    else:
        program, why, key = held.program(kind, x, data, transport)
        if why is None and not data and local == "threads" and key is not None and \
                key not in held.entries and one_program_here(client, local, progress):
            entry = kind.entry(program, x, where, held.shape)
            if entry is not None:
                held.hold_entry(key, entry)
    return run(kind.job(program, x, data, why=why, where=where), client, local, progress)


def on_processes(collection: Any, progress: bool) -> Any:
    """``collection`` (a Dask collection, or what ``dask.compute`` takes: a lazy call, a
    sweep's dask arrays) computed by Dask's multiprocessing scheduler (``"processes"``), under
    Dask's progress bar where ``progress``; its child processes run JAX on their CPU
    (:func:`children`)."""
    from dask.diagnostics import ProgressBar  # (only for a bar: its import is slow)
    with ProgressBar() if progress else contextlib.nullcontext():
        return dask.compute(collection, scheduler="processes", **children())[0]


def children() -> dict:
    """``dask.compute``'s options for the multiprocessing scheduler: its tasks and results taken
    in with every dtype kept (:func:`daskdag.transport.scope.loads`), unless Dask's
    ``func_loads`` names another; and an ``initializer`` that runs JAX on the child processes'
    CPU, then the user's ``multiprocessing.initializer``
    (:func:`daskdag.running.workers.child_on_cpu`), except where ``daskdag.worker-platform`` is
    ``any`` or the user gave Dask a ``pool`` of their own."""
    options = {} if dask.config.get("func_loads", None) is not None else {"func_loads": loads}
    if cluster.worker_platform() == "any" or dask.config.get("pool", None) is not None:
        return options
    if dask.config.get("multiprocessing.context", "spawn") == "fork":
        import jax
        if jax.default_backend() != "cpu":  # (a forked child has this process's JAX backend)
            raise DAGError(
                f"Dask's multiprocessing scheduler under multiprocessing.context 'fork' copies "
                f"this process's JAX, which runs on {jax.default_backend()!r}, into each child "
                f"process: set multiprocessing.context to 'spawn' (Dask's default) or "
                f"'forkserver', whose children run JAX on their CPU")
    return {**options, "initializer": partial(
        worker_setup.child_on_cpu, dask.config.get("multiprocessing.initializer", None))}


def lazy(kind: Kind, x: Any, *data: Any) -> Call:
    """A call of ``kind`` as a Dask collection (:func:`as_collection`)."""
    program, why = kind.compile(x, data, transport=transports.for_call(active_client(),
                                                                        lazy=True))
    return as_collection(kind.job(program, x, data, why=why, where=LAZY))


def run(job: Job, client, local: str | None, progress: bool, keep: Any = None):
    """The job computed now: on a cluster, checked first, and what it keeps placed once
    (:mod:`daskdag.running.resident`); else on this process's ``local`` scheduler, as one
    program where it has one (:meth:`Job.directly`) and nothing watches the graph's tasks.
    ``keep``: where a durable call keeps its stages (:meth:`Job.stored`): its graph then runs
    spread, a task per stage, and :meth:`Job.ahead` is not run."""
    if local == "processes":
        raise DAGError(not_on_processes(job.kind if keep is None else f"{job.kind} with store="))
    with implicit.recording(job.solves):  # (on a cluster, what its workers tell: compute)
        return _run(job, client, local, progress, keep)


def _run(job: Job, client, local: str | None, progress: bool, keep: Any) -> Any:
    if keep is None:
        job = job.ahead(client, local, progress)
        if one_program_here(client, local, progress):
            # (a progress bar, or another Dask callback, watches the graph's tasks: it runs)
            result = job.directly()
            if result is not None:
                if logger.isEnabledFor(logging.INFO):
                    log_whole(job.kind, job.plan, in_words(client, local))
                return result
    if client is not None:  # before anything is built or sent
        cluster.check(client, job.plan)
    kept = resident.of(client) if client is not None else None
    stop = Stop() if client is None else None
    before = kept.sent if kept else 0
    spreading = job.spreading if keep is None and not progress else None
    whole = spreading is not None and spreading.whole()
    start = time.perf_counter()
    with kept.keeping(client) if kept else contextlib.nullcontext() as place:
        graph = (job.in_one_task(place) if whole else job.graph(place, stop) if keep is None
                 else job.stored(place, stop, keep))
        log_submitted(job.kind, job.plan, graph, in_words(client, local),
                      kept.sent - before if kept else None)
        computed = compute(graph, client, progress, stop, local, job.plan)
    if spreading is not None:
        spreading.record(whole, time.perf_counter() - start)
    return job.finish(computed)


class Spreading:
    """Whether a program's calls on a cluster run spread over the workers, a task per stage, or
    whole in one task (:class:`~daskdag.running.local.GraphInOneTask`), as the calls measure:
    spreading pays where stages run side by side or are long, and costs a scheduler round trip
    per task where they are short. The first :data:`FIRST` calls spread; when one took less
    than :data:`TRY_WHOLE`, the next two run in one task (the first warms its worker up); then
    the faster way runs (by the shortest of its last :data:`SAMPLES` calls), the other once
    every :data:`RECHECK` calls; after a call in one task longer than :data:`TRY_WHOLE`, the
    calls spread, trying one task again at the next recheck."""

    FIRST = 4
    TRY_WHOLE = 0.25  # seconds
    SAMPLES = 3
    RECHECK = 256

    def __init__(self) -> None:
        self.took: dict[bool, deque] = {False: deque(maxlen=self.SAMPLES),
                                        True: deque(maxlen=self.SAMPLES)}
        self.calls = 0

    def whole(self) -> bool:
        """Whether this call runs in one task."""
        self.calls += 1
        spread, whole = self.took[False], self.took[True]
        if self.calls <= self.FIRST or not spread:
            return False
        if len(whole) < 2:  # (the first call in one task warms its worker up)
            return min(spread) < self.TRY_WHOLE
        recheck = self.calls % self.RECHECK == 0
        if whole[-1] > self.TRY_WHOLE:
            return recheck
        return (min(whole) < min(spread)) != recheck

    def record(self, whole: bool, seconds: float) -> None:
        """A call ran (``whole``: in one task) and took ``seconds``."""
        self.took[whole].append(seconds)


def as_collection(job: Job) -> Call:
    """The job as a Dask collection, computed when Dask computes it."""
    graph, finish = job.later()
    return Call.of(job.plan, graph, finish, job.keep)
