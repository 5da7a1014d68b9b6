"""Where a sweep's chunks run: threads of this process, or a ``distributed`` cluster (this
process's devices: :mod:`daskdag.sweeps.devices`). An engine takes chunks (``submit``), waits for
some (``wait_any``), gives a finished chunk's :class:`Done` or raises its error (``result``),
lets go of it (``release``), and on ``close``, however the sweep ended, stops all it started.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
import uuid
import warnings
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import cloudpickle
import dask
import jax
from dask.base import tokenize
from dask.callbacks import Callback
from dask.task_spec import DataNode, Task, TaskRef

from daskdag.errors import ClusterError
from daskdag.graph.assembly import key
from daskdag.model.spec import as_numpy
from daskdag.running.cluster import Watch, describe, unreachable, workers
from daskdag.running.compute import Arrivals
from daskdag.running.local import Schedule
from daskdag.sweeps import progress
from daskdag.transport.packing import unpack
from daskdag.transport.protocol import travels, tree_size
from daskdag.transport.transports import CLUSTER

if TYPE_CHECKING:
    import distributed

WAIT = 0.2  # seconds a wait returns after at the latest, to refresh the progress bar
RESENDS = 3  # times a chunk lost with a worker is sent again before the sweep fails
LIST_EVERY = 1.0  # seconds a list of the workers serves before the scheduler is asked again


@travels(tree_size)
class Done:
    """A finished chunk: ``computed``, ``{output: (value, {input: grad})}`` over its items
    (None when every item failed); ``failed``, ``{index in the chunk: NodeError}``; ``seconds``
    it ran, where known. A pytree of ``computed``; unpacks as its three fields."""

    __slots__ = ("computed", "failed", "seconds")

    def __init__(self, computed: dict | None, failed: dict, seconds: float | None = None):
        self.computed, self.failed, self.seconds = computed, failed, seconds

    def __iter__(self):
        return iter((self.computed, self.failed, self.seconds))

    def __reduce__(self):
        return Done, (self.computed, self.failed, self.seconds)


jax.tree_util.register_pytree_node(Done, lambda d: ((d.computed,), (d.failed, d.seconds)),
                                   lambda rest, results: Done(results[0], *rest))


def run_chunk(run: progress.ChunkRun, compute) -> Done:
    """``compute()``, a chunk's graph run in this thread under ``run``, which keeps its items'
    failures; a chunk with no item left stops, whatever its last node raised."""
    started = time.monotonic()
    with run:
        try:
            computed = compute()
        except Exception:
            if not run.nothing_left():
                raise
            computed = None
    return Done(computed, run.failed, time.monotonic() - started)


class InProcess:
    """What the engines of this process share: each chunk's values bound into the sweep's chunk
    graph, made once (:func:`kept_chunk_graph`), and run in a thread of it (:meth:`_run`),
    stopping at its next item once ``stop`` is set; nothing to release."""

    def __init__(self, bar: progress.Progress | None):
        self.bar, self.stop = bar, threading.Event()

    def submit(self, sweep, chunks: list[tuple[tuple[int, int], int]]) -> list:
        """``chunks``: ``[((start, stop), steps)]``; returns a future for each."""
        return [self._submit(sweep, chunk, steps) for chunk, steps in chunks]

    def _submit(self, sweep, chunk: tuple[int, int], steps: int):
        raise NotImplementedError

    def _run(self, chunk: tuple[int, int], steps: int, graph: ChunkGraph, values: dict
             ) -> Done:
        """The chunk run in this thread: ``graph`` (:func:`kept_chunk_graph`) with its slots'
        ``values`` (:meth:`ChunkGraph.values`), by Dask's synchronous scheduler where a Dask
        callback watches, else in order by the graph's :class:`~daskdag.running.local.Schedule`."""
        bar = self.bar
        report = None if bar is None else (lambda f: bar.report(chunk, f))
        if Callback.active:
            compute = partial(dask.get, bound(graph.tasks, values, {}), graph.key)
        else:
            compute = partial(graph.run, values)
        return run_chunk(progress.ChunkRun(chunk[1] - chunk[0], steps, self.stop.is_set, report),
                         compute)

    def wait_any(self, futures) -> set:
        return concurrent.futures.wait(futures, WAIT, return_when="FIRST_COMPLETED").done

    def result(self, future):
        return future.result()

    def release(self, future):
        pass


class Threads(InProcess):
    """Each chunk synchronously on one of ``in_flight`` threads of this process: a pool kept
    for the sweeps of the process (:func:`sweep_pool`), or the sweep's own where it runs
    inside a chunk of another; ``here``: in the calling thread, as it is submitted (Dask's
    ``"sync"`` scheduler, for a debugger)."""

    def __init__(self, in_flight: int, bar: progress.Progress | None, here: bool = False):
        super().__init__(bar)
        # A sweep inside a chunk would wait on the pool that chunk holds: it has its own.
        inner = threading.current_thread().name.startswith(POOL_PREFIX)
        self.own = here or inner
        self.pool: Any = (Here() if here else
                          concurrent.futures.ThreadPoolExecutor(
                              in_flight, thread_name_prefix=POOL_PREFIX) if inner else
                          sweep_pool(in_flight))
        self.futures: list[concurrent.futures.Future] = []
        self.shared: dict = {}

    def _submit(self, sweep, chunk: tuple[int, int], steps: int):
        graph = kept_chunk_graph(sweep)
        future = self.pool.submit(self._run, chunk, steps, graph,
                                  graph.values(sweep, sweep.items(*chunk)))
        self.futures.append(future)
        return future

    def close(self):
        self.stop.set()  # running chunks stop at their next item; this waits for that
        if self.own:
            self.pool.shutdown(wait=True, cancel_futures=True)
            return
        for future in self.futures:
            future.cancel()
        concurrent.futures.wait(self.futures)


POOL_PREFIX = "daskdag-sweep"
_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def sweep_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of ``threads`` threads kept for this process's sweeps (starting a thread costs
    as much as a small chunk's work); the sweeps that run at once share it."""
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = concurrent.futures.ThreadPoolExecutor(
                threads, thread_name_prefix=POOL_PREFIX)
        return pool


class Here:
    """An executor that runs each job in the calling thread as it is submitted, its result or
    exception in a finished future (a ``KeyboardInterrupt`` raises at once)."""

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:
            future.set_exception(e)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


class Cluster:
    """Chunks as tasks of a ``distributed`` cluster; shared inputs placed on it once. ``pin``:
    each chunk is one task (:func:`_run_chunk`) with its items inside, so the scheduler can rerun
    it elsewhere when its worker dies, sent to the worker with the fewest chunks; else (nodes
    that need resources) chunks are task graphs. A chunk whose worker left while it waited, or
    whose task was lost, is sent again, up to :data:`RESENDS` times."""

    def __init__(self, client, shared: dict, pin: bool, bar: progress.Progress | None, place,
                 found: dict | None = None, plan=None):
        self.client, self.pin, self.bar = client, pin, bar
        self.place = place  # keeps a value on the cluster (daskdag.running.resident.placing)
        self.chunks: set[_Chunk] = set()  # every chunk not released yet
        self.id = uuid.uuid4().hex
        self.graph: tuple | None = None  # (sweep, future of its chunk graph on the cluster)
        self.found: dict = found or {}  # the workers as last listed, and when
        self.listed = time.monotonic() if found else -float("inf")
        self.listening = contextlib.ExitStack()  # the progress bar's events
        self.direct = client.direct_to_workers is not False
        self.watch = Watch(client, plan)
        self.arrivals = Arrivals()  # told by the chunks' futures when they are done
        self.shared = {name: place_shared(place, name, value) for name, value in shared.items()}
        if bar is not None:
            self.listening.enter_context(progress.listen(client, self.id, bar.report))

    def submit(self, sweep, chunks: list[tuple[tuple[int, int], int]]) -> list[_Chunk]:
        """``chunks``: ``[((start, stop), steps)]``; returns a :class:`_Chunk` for each."""
        sent = [_Chunk(sweep, chunk, steps) for chunk, steps in chunks]
        self.chunks.update(sent)
        self._send(sent)
        return sent

    def _send(self, sent: list[_Chunk]):
        try:
            found = self._workers() if self.pin else {}
        except (OSError, TimeoutError) as e:
            raise self._scheduler_gone(e) from e
        if not found:  # task graphs, or no worker yet: the scheduler places them
            for c in sent:
                graph = c.sweep.graph(c.sweep.items(*c.chunk))  # the items inside it
                c.future, c.pinned = self.client.compute(graph), False
                self.arrivals.add(c.future)
            return
        shared = {f.key: f for f in self.shared.values()}
        with warnings.catch_warnings():  # items travel in their tasks, on purpose
            warnings.filterwarnings("ignore", message="Sending large graph")
            for c in sent:
                c.worker, c.cohort = self._least_busy(found), frozenset(found)
                graph = self._graph(c.sweep)
                # Unhashed: no one asks for the token of a chunk's items.
                items = {n: CLUSTER.pack(f"input {n!r}", v, hashed=False)
                         for n, v in c.sweep.items(*c.chunk).items()}
                report = None if self.bar is None else [self.id, *c.chunk]
                c.future = self.client.submit(_run_chunk, graph, shared, items, c.steps, report,
                                              c.chunk[1] - c.chunk[0], pure=False,
                                              workers=[c.worker], allow_other_workers=True)
                c.pinned = True
                self.arrivals.add(c.future)

    def _least_busy(self, found: dict) -> str:
        """Of the workers ``found`` (running ones first), the one with the fewest chunks."""
        running = [a for a, w in found.items() if w.get("status", "running") == "running"]
        return min(running or found, key=lambda w: sum(c.worker == w for c in self.chunks))

    def _workers(self, fresh: bool = False) -> dict:
        """The cluster's workers, as listed at most :data:`LIST_EVERY` seconds ago unless
        ``fresh`` (each list costs the scheduler's time); an empty list is not kept."""
        now = time.monotonic()
        if fresh or not self.found or now - self.listed > LIST_EVERY:
            self.found, self.listed = workers(self.client, timeout=self.watch.ask), now
        return self.found

    def _graph(self, sweep) -> distributed.Future:
        """The future of ``sweep``'s chunk graph on the cluster, placed as the shared inputs are
        (:func:`place_shared`), so a later sweep of the same DAG and shared inputs finds it."""
        if self.graph is None or self.graph[0] is not sweep:
            refs = {n: TaskRef(f.key) for n, f in self.shared.items()}
            tasks, results = chunk_graph(sweep, refs)
            # A task whose result is the graph: recomputed if its holder dies, and fetched,
            # unpickled, by the other workers.
            self.graph = (sweep, self.place(key("sweep", "graph", tokenize(results)),
                                            cloudpickle.loads, cloudpickle.dumps((tasks, results))))
        return self.graph[1]

    def wait_any(self, chunks) -> set:
        """The chunks among ``chunks`` that finished or failed; those lost meanwhile are sent
        again. Every chunk's state is read each time: a future whose result was lost with its
        worker finishes again with no callback."""
        if not self.arrivals.any(WAIT):
            self._stranded(chunks)
        done = set()
        for c in chunks:
            if c.future.cancelled():
                self._resend(c)
            elif c.future.status in ("finished", "error"):  # "lost": being computed again
                done.add(c)
        return done

    def _stranded(self, chunks) -> None:
        """Send again the pinned chunks stranded by the loss of every worker there when they
        were sent (distributed then waits for the named worker forever). Raises a
        :class:`~daskdag.ClusterError` once no worker was there for ``daskdag.worker-wait``."""
        found, failed = None, None
        try:
            found = self._workers()
        except (OSError, TimeoutError) as e:
            failed = e
        self.watch.check(found, failed)
        if found:
            for c in chunks:
                if c.worker is not None and not c.cohort & found.keys() \
                        and c.future.status == "pending":
                    self._resend(c)

    def result(self, chunk: _Chunk) -> Done:
        """The chunk's results, straight from its worker; raises what the chunk raised, or
        :class:`Lost` for a chunk of several items whose workers kept dying under it."""
        import distributed  # loaded already: this chunk went to a cluster
        while True:
            try:
                out = self.client.gather(chunk.future, direct=self.direct)
                return out if chunk.pinned else Done(out, {})
            except distributed.CancelledError:  # lost with its worker since it finished
                self._resend(chunk)
            except distributed.KilledWorker as e:  # its workers died while it ran, too often
                if chunk.chunk[1] - chunk.chunk[0] > 1:  # smaller pieces stand a better chance
                    raise Lost(*chunk.chunk) from e
                self._resend(chunk)
            except (OSError, TimeoutError) as e:  # a connection broke while gathering it
                try:
                    self._workers(fresh=True)
                except (OSError, TimeoutError) as gone:  # the scheduler's
                    raise self._scheduler_gone(gone) from e
                self._resend(chunk)  # a worker's, with its results: computed again

    def _scheduler_gone(self, e: Exception) -> ClusterError:
        """The error of a sweep whose scheduler cannot be reached (``e``)."""
        return ClusterError(
            f"{describe(self.client)}: {unreachable(e)}, so the sweep cannot go on: it stops "
            f"here. Start the cluster again; a sweep with a store= resumes from it")

    def _resend(self, chunk: _Chunk):
        chunk.resent += 1
        if chunk.resent > RESENDS:
            start, stop = chunk.chunk
            what = f"item {start} of the sweep was" if stop - start == 1 else \
                f"items {start} to {stop - 1} of the sweep were"
            raise ClusterError(f"{what} lost {chunk.resent} times, with the workers that ran "
                               f"them (killed, out of memory?), or their task was cancelled by "
                               f"someone else")
        self._let_go(chunk, cancel=True)
        self.listed = -float("inf")  # a worker left, most likely: list them anew
        self._send([chunk])

    def release(self, chunk: _Chunk):
        self.chunks.discard(chunk)
        self._let_go(chunk)

    def _let_go(self, chunk: _Chunk, cancel: bool = False):
        if chunk.future is not None:
            if cancel:  # it may still be queued or running on a worker that lives
                self.client.cancel([chunk.future])
            chunk.future.release()
        chunk.future, chunk.worker = None, None

    def close(self):
        """Cancel and let go of every chunk (the shared inputs and chunk graph are ``place``'s)."""
        held = [c.future for c in self.chunks if c.future is not None]
        self.graph = None
        self.chunks.clear()
        self.listening.close()
        with contextlib.suppress(Exception):  # (a client already closed: nothing to cancel)
            if held:  # stops chunks still running (each at its next item) and queued ones
                self.client.cancel(held)
        for fut in held:  # so that a frame or error still holding a future keeps nothing alive
            fut.release()


class Lost(Exception):
    """A chunk of several items lost with the workers that ran it (``KilledWorker``): the
    sweep runs its items again one by one."""


class _Chunk:
    """A chunk on the cluster: its items, its task's future, the worker it was sent to, the
    workers there then, and how often it was sent again."""

    __slots__ = ("sweep", "chunk", "steps", "future", "worker", "cohort", "resent", "pinned")

    def __init__(self, sweep, chunk: tuple[int, int], steps: int):
        self.sweep, self.chunk, self.steps = sweep, chunk, steps
        self.future: distributed.Future | None = None
        self.worker: str | None = None
        self.pinned = False  # its task is _run_chunk, not a task graph
        self.resent = 0
        self.cohort: frozenset = frozenset()


def place_shared(place, name: str, value) -> distributed.Future:
    """Put the shared input ``name`` on the cluster with ``place``, under its content key (a
    later sweep or call with the same value finds it), as a task whose result is the value, so
    that it survives the loss of its worker."""
    packed = CLUSTER.pack(f"input {name!r}", value)
    return place(key("input", name, tokenize(packed)), unpack, packed)


def item_key(name: str) -> str:
    """The key under which a chunk graph refers to input ``name``'s items."""
    return f"daskdag-items-{name}"


def bound(tasks: dict, shared: dict, items: dict) -> dict:
    """A copy of a chunk graph's ``tasks`` (one graph serves every chunk) with, as data, the
    shared inputs' values by task key and the chunk's ``items`` by input."""
    data = {**shared, **{item_key(n): v for n, v in items.items()}}
    return {**tasks, **{k: DataNode(k, v) for k, v in data.items()}}


class ChunkGraph:
    """A sweep's chunk graph made in this process, whose slots a chunk fills (:meth:`values`):
    its shared inputs (``shared``, their names), its outputs' cotangents and its items;
    ``key``: its results' task; ``run``: it run in order (by its
    :class:`~daskdag.running.local.Schedule`)."""

    def __init__(self, tasks: dict, key: str, shared: tuple[str, ...]):
        self.tasks, self.key, self.shared = tasks, key, shared
        self._schedule = Schedule(tasks, [key])

    def values(self, sweep, items: dict) -> dict:
        """The slots' values for a chunk of ``sweep`` whose carried inputs are ``items``."""
        return {**{shared_key(n): sweep.values[n] for n in self.shared},
                **{cotangent_key(o): ct for o, ct in sweep.cotangents.items()},
                **{item_key(n): v for n, v in items.items()}}

    def run(self, values: dict) -> Any:
        return self._schedule.run(values)[0]


def kept_chunk_graph(sweep) -> ChunkGraph:
    """``sweep``'s chunk graph with its shared inputs and cotangents as slots, made once per
    preparation and plan (:meth:`~daskdag.sweeps.planning.Sweep.per_plan`)."""
    shared = tuple(sorted(i for i in sweep.values if sweep.shared(i)))

    def make() -> ChunkGraph:
        slotted = replace(sweep, cotangents={o: TaskRef(cotangent_key(o))
                                             for o in sweep.cotangents})
        return ChunkGraph(*chunk_graph(slotted, {n: TaskRef(shared_key(n)) for n in shared}),
                          shared)

    return sweep.per_plan((shared, tuple(sweep.cotangents), tuple(sorted(sweep.carried()))), make)


def shared_key(name: str) -> str:
    """The key under which a chunk graph made here refers to shared input ``name``."""
    return f"daskdag-shared-{name}"


def cotangent_key(output: str) -> str:
    """The key under which a chunk graph made here refers to ``output``'s cotangent."""
    return f"daskdag-cotangent-{output}"


def chunk_graph(sweep, shared: dict) -> tuple[dict, str]:
    """The graph of every pinned chunk of ``sweep``: ``(tasks, key of the results)``. It refers
    to the chunk's items under :func:`item_key`, and to the shared inputs by ``shared``,
    ``{input: TaskRef}`` (a ``Future`` would start a client wherever it is unpickled); the
    task running it adds both as data."""
    items = {n: TaskRef(item_key(n)) for n in sweep.carried()}
    results = sweep.graph({**shared, **items})
    flat = [d for value, grads in results.values() for d in (value, *grads.values())]
    tasks = dict(flat[0].__dask_graph__())  # (one graph: every result is a key of it)
    shape = [(o, list(grads)) for o, (_, grads) in results.items()]
    # A content key, as the results' are.
    done = key("sweep", "results", tokenize([d.key for d in flat], shape))
    tasks[done] = Task(done, _assemble, shape, *(TaskRef(d.key) for d in flat))
    return tasks, done


def _assemble(shape: list, *flat):
    """``{output: (value, {input: grad})}`` from ``flat`` results, ``shape``
    ``[(output, [input])]``."""
    it = iter(flat)
    return {o: (next(it), {i: next(it) for i in inputs}) for o, inputs in shape}


def _run_chunk(graph: tuple[dict, str], shared: dict, items: dict, steps: int,
               report: list | None, count: int) -> Done:
    """A whole chunk of ``count`` items as one task on a worker: the sweep's chunk graph run by
    Dask's synchronous scheduler, the shared inputs and the chunk's packed items as data. Its
    :class:`Done` has NumPy leaves, which distributed sends as zero-copy frames."""
    tasks = bound(graph[0], shared, {n: unpack(v) for n, v in items.items()})
    done = run_chunk(progress.worker_chunk(count, steps, report), lambda: dask.get(tasks, graph[1]))
    return as_numpy(done)
