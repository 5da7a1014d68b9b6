"""Where a sweep's chunks run: threads of this process, or a ``distributed`` cluster.

An engine takes chunks (a :class:`~daskdag._sweep.Sweep` and each chunk's ``(start, stop)``),
waits for some chunk to finish, gives a finished chunk's results (``{output: (value, {input:
grad})}`` over its items, or raises its :class:`~daskdag.NodeError`), lets go of it, and on
:meth:`close` stops everything it started: queued chunks never start, running ones stop at
their next item (:mod:`daskdag._progress`), and on a cluster every future it made is released,
whatever way the sweep ended.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid

import cloudpickle
import dask
from dask.base import tokenize
import distributed
import jax
import numpy as np
from dask.task_spec import DataNode, Task, TaskRef

from . import _progress as progress
from ._cluster import workers
from ._errors import ClusterError
from ._shipping import pack_for, unpack

WAIT = 0.2  # seconds a wait returns after at the latest, to refresh the progress bar


class Threads:
    """Each chunk synchronously on one of ``in_flight`` threads of this process."""

    def __init__(self, in_flight: int, bar: progress.Progress | None):
        self.pool = concurrent.futures.ThreadPoolExecutor(in_flight, thread_name_prefix="daskdag-sweep")
        self.stop, self.bar, self.shared = threading.Event(), bar, {}

    def submit(self, sweep, chunks: list[tuple[tuple[int, int], int]]) -> list:
        """``chunks``: ``[((start, stop), steps)]``; returns a future for each."""
        return [self._submit(sweep, chunk, steps) for chunk, steps in chunks]

    def _submit(self, sweep, chunk: tuple[int, int], steps: int):
        graph = sweep.chunk(*chunk)
        report = None if self.bar is None else (lambda f: self.bar.report(chunk, f))

        def job():
            with progress.ChunkRun(steps, self.stop.is_set, report):
                return dask.compute(graph, scheduler="sync")[0]

        return self.pool.submit(job)

    def wait_any(self, futures) -> set:
        return concurrent.futures.wait(futures, WAIT, return_when="FIRST_COMPLETED").done

    def result(self, future):
        return future.result()

    def release(self, future):
        pass

    def close(self):
        self.stop.set()  # running chunks stop at their next item; this waits for that
        self.pool.shutdown(wait=True, cancel_futures=True)


class Cluster:
    """Chunks as tasks of a ``distributed`` cluster; shared inputs placed on it once.

    ``pin``: each chunk runs as one task on one worker (the one with the fewest chunks in
    flight; loosely, so the worker's death can still move it). Left to itself the scheduler
    split chunks over workers and shipped pullbacks and cotangents between them (a third of the
    2-worker sweep benchmark's time), and a chunk's ~25 tasks each cost distributed's per-task
    overhead. Chunks whose nodes need resources stay task graphs, which the scheduler places
    node by node (their bar advances per chunk, and they stop at the next task, not item).

    A pinned chunk's items go from this process straight to its worker (``Client.scatter``),
    and its results come straight back as NumPy frames (``Client.gather``): neither passes
    through the scheduler, whose one thread would otherwise unpickle and forward every byte
    (``Client(direct_to_workers=False)`` or distributed's ``client.direct-to-workers: False``
    routes them through it, for clients that cannot reach the workers). Scattered items die
    with their worker, and with them the chunk's task (distributed cancels it); such a chunk
    is sent again, items and all, up to :data:`RESENDS` times.

    A pinned chunk's task carries no graph: every chunk of a sweep has the same one but for its
    items, so the sweep's chunk graph is built and pickled once (:func:`chunk_graph`), placed
    on the cluster as the shared inputs are, and each chunk's task binds its own items into a
    copy of it (:func:`_run_chunk`). Building, tokenizing and pickling it for each chunk cost
    this process ~12 ms a chunk, on a 2-core machine time taken from the workers.
    """

    def __init__(self, client, shared: dict, pin: bool, bar: progress.Progress | None, place,
                 found: dict | None = None):
        self.client, self.pin, self.bar = client, pin, bar
        self.place = place  # keeps a value on the cluster (daskdag._resident.placing)
        self.chunks: set[_Chunk] = set()  # every chunk not released yet
        self.id = uuid.uuid4().hex
        self.graph: tuple | None = None  # (sweep, future of its chunk graph on the cluster)
        self.found: dict = found or {}  # the workers as last listed (_workers), and when
        self.listed = time.monotonic() if found else -float("inf")
        self.listening = False
        self.direct = client.direct_to_workers is not False
        self.shared = {name: place_shared(place, name, value) for name, value in shared.items()}
        if bar is not None:
            progress.listen(client, self.id, bar.report)
            self.listening = True

    def submit(self, sweep, chunks: list[tuple[tuple[int, int], int]]) -> list[_Chunk]:
        """``chunks``: ``[((start, stop), steps)]``; returns a :class:`_Chunk` for each."""
        sent = [_Chunk(sweep, chunk, steps) for chunk, steps in chunks]
        self.chunks.update(sent)
        self._send(sent)
        return sent

    def _send(self, sent: list[_Chunk]):
        """Each chunk's items to a worker, then its task, pinned there; in waves of one chunk per
        worker, each wave's items sent at once. (One chunk after another, the later chunks'
        workers sat idle while this process sent the earlier ones' items; all at once, every
        worker waited for the last.)"""
        found = self._workers() if self.pin else {}
        if not found:  # task graphs, or no worker yet (an adaptive cluster): the scheduler places it
            for c in sent:
                c.future = self.client.compute(c.sweep.chunk(*c.chunk))
            return
        waves: list[list[_Chunk]] = []
        for c in sent:
            c.worker = self._least_busy(found)
            wave = sum(1 for other in sent if other.worker == c.worker) - 1
            if wave == len(waves):
                waves.append([])
            waves[wave].append(c)
        shared = {f.key: f for f in self.shared.values()}
        for wave in waves:
            found = self._scatter(wave, found)
            graph = self._graph(wave[0].sweep)
            for c in wave:
                report = None if self.bar is None else [self.id, *c.chunk]
                c.future = self.client.submit(_run_chunk, graph, shared, c.items, c.steps, report,
                                              pure=False, workers=[c.worker],
                                              allow_other_workers=True)

    def _scatter(self, chunks: list[_Chunk], found: dict) -> dict:
        """Each chunk's items straight to its worker, all chunks' at once; a chunk whose worker
        left since the scheduler listed it goes to another, up to :data:`SCATTER_TRIES` times.
        Returns the workers as last listed."""
        # Unhashed: the items travel under keys of their own, so no one asks for their token.
        packed = {c: {name: pack_for(f"input {name!r}", value, remote=True, hashed=False)
                      for name, value in c.sweep.items(*c.chunk).items()} for c in chunks}
        failed: set = set()
        for attempt in range(SCATTER_TRIES):
            keys = {c: {n: f"daskdag-items-{n}-{uuid.uuid4().hex}" for n in packed[c]}
                    for c in chunks}
            scattered = self.client.sync(_gathered, [self.client.scatter(
                {keys[c][n]: p for n, p in packed[c].items()}, workers=[c.worker],
                direct=self.direct, hash=False, timeout=SCATTER_TIMEOUT, asynchronous=True)
                for c in chunks])
            lost = []
            for c, got in zip(chunks, scattered):
                if isinstance(got, (OSError, TimeoutError)):  # its worker left
                    failed.add(c.worker)
                    lost.append((c, got))
                elif isinstance(got, BaseException):
                    raise got
                else:  # under the keys the chunk graph names them by
                    c.items = {item_key(n): got[k] for n, k in keys[c].items()}
            if not lost:
                return found
            if attempt == SCATTER_TRIES - 1:
                raise lost[0][1]
            found = self._workers(fresh=True) or found
            chunks = [c for c, _ in lost]
            for c in chunks:
                c.worker = None
                c.worker = self._least_busy(found, failed)
        return found

    def _least_busy(self, found: dict, failed: set = frozenset()) -> str:
        """Of the workers ``found``, running (scatter waits for a paused one) and not among
        ``failed``, the one with the fewest chunks."""
        running = [a for a, w in found.items()
                   if w.get("status", "running") == "running" and a not in failed]
        return min(running or set(found) - failed or found,
                   key=lambda w: sum(1 for other in self.chunks if other.worker == w))

    def _workers(self, fresh: bool = False) -> dict:
        """The cluster's workers (:func:`daskdag._cluster.workers`), as the scheduler listed them
        at most :data:`LIST_EVERY` seconds ago unless ``fresh``. Asking costs this thread ~3 ms,
        a tenth of what a chunk cost it; a worker that left since fails the scatter, which then
        asks again, and a chunk lost with its worker asks again before it is resent. An empty
        list is not kept: with no worker yet (an adaptive cluster) each chunk asks again."""
        now = time.monotonic()
        if fresh or not self.found or now - self.listed > LIST_EVERY:
            self.found, self.listed = workers(self.client), now
        return self.found

    def _graph(self, sweep) -> distributed.Future:
        """The future of ``sweep``'s chunk graph on the cluster (:func:`chunk_graph`), placed
        when its first chunk is sent, as the shared inputs are (:func:`place_shared`): under a
        content key, so a later sweep of the same DAG and shared inputs finds it there."""
        if self.graph is None or self.graph[0] is not sweep:
            refs = {n: TaskRef(f.key) for n, f in self.shared.items()}
            tasks, key = chunk_graph(sweep, refs)
            # A task whose result is the graph: computed again if its holder dies, and fetched,
            # already unpickled, by the other workers.
            self.graph = (sweep, self.place(f"daskdag-chunk-graph-{tokenize(key)}",
                                            cloudpickle.loads, cloudpickle.dumps((tasks, key))))
        return self.graph[1]

    def wait_any(self, chunks) -> set:
        """The chunks among ``chunks`` that finished or failed; those lost meanwhile (their
        task cancelled with a worker that held their items) are sent again."""
        try:
            with self.client.as_current():
                distributed.wait([c.future for c in chunks], timeout=WAIT, return_when="FIRST_COMPLETED")
        except TimeoutError:
            return set()
        except distributed.CancelledError:  # (wait raises it for any cancelled future)
            pass
        done = set()
        for c in chunks:
            if c.future.cancelled():
                self._resend(c)
            elif c.future.status in ("finished", "error"):  # ("lost": being computed again)
                done.add(c)
        return done

    def result(self, chunk: _Chunk):
        """The chunk's results, straight from its worker; raises what the chunk raised."""
        while True:
            try:
                return self.client.gather(chunk.future, direct=self.direct)
            except distributed.CancelledError:  # lost with its worker since it finished
                self._resend(chunk)

    def _resend(self, chunk: _Chunk):
        chunk.resent += 1
        if chunk.resent > RESENDS:
            raise ClusterError(f"items {chunk.chunk[0]} to {chunk.chunk[1] - 1} of the sweep were "
                               f"lost {chunk.resent} times, with the workers that held them, or "
                               f"their task was cancelled by someone else")
        self._let_go(chunk)
        self.listed = -float("inf")  # a worker left, most likely: list them anew
        self._send([chunk])

    def release(self, chunk: _Chunk):
        self.chunks.discard(chunk)
        self._let_go(chunk)

    def _let_go(self, chunk: _Chunk):
        for fut in (chunk.future, *chunk.items.values()):
            if fut is not None:
                fut.release()
        chunk.future, chunk.items, chunk.worker = None, {}, None

    def close(self):
        """Cancel and let go of every chunk. (The shared inputs and the chunk graph are
        ``place``'s, :func:`daskdag._resident.placing`.)"""
        held = [f for c in self.chunks for f in (c.future, *c.items.values()) if f is not None]
        self.graph = None
        self.chunks.clear()
        if self.listening:
            self.listening = False
            progress.unlisten(self.client, self.id)
        if held:
            try:  # cancel stops chunks still running (each at its next item) and queued ones
                self.client.cancel(held)
            except Exception:  # a client already closed has nothing left to cancel
                pass
        for fut in held:  # release: a frame or error still holding a future keeps nothing alive
            fut.release()


RESENDS = 3  # times a chunk lost with a worker is sent again before the sweep fails
SCATTER_TRIES = 3  # workers a chunk's items are offered to, each time the worker left meanwhile
SCATTER_TIMEOUT = 10  # seconds scatter waits for its worker (it waits while the worker is away)
LIST_EVERY = WAIT  # seconds a list of the workers is used for before the scheduler is asked again


async def _gathered(scatters: list) -> list:
    """The results of the coroutines ``scatters``, run together; an exception in place of each
    result that raised."""
    return await asyncio.gather(*scatters, return_exceptions=True)


class _Chunk:
    """A chunk on the cluster: its items (``start, stop``), its task's future, the futures of
    its scattered items and the worker they went to, and how often it was sent again."""

    __slots__ = ("sweep", "chunk", "steps", "future", "items", "worker", "resent")

    def __init__(self, sweep, chunk: tuple[int, int], steps: int):
        self.sweep, self.chunk, self.steps = sweep, chunk, steps
        self.future, self.items, self.worker, self.resent = None, {}, None, 0


def place_shared(place, name: str, value) -> distributed.Future:
    """Put the shared input ``name`` on the cluster for every chunk to use, with ``place``
    (:func:`daskdag._resident.placing`): under its content key, which a later sweep or
    ``compute_grads`` call with the same value finds there, and as a task whose result is the
    value, so it survives the loss of its worker, where a scattered value would fail every
    chunk needing it. The value travels packed, as every input does (:mod:`daskdag._shipping`).
    """
    packed = pack_for(f"input {name!r}", value, remote=True)
    return place(f"input-{name}-{tokenize(packed)}", unpack, packed)


def item_key(name: str) -> str:
    """The key under which a chunk graph (:func:`chunk_graph`) refers to input ``name``'s items."""
    return f"daskdag-items-{name}"


def chunk_graph(sweep, shared: dict) -> tuple[dict, str]:
    """The graph of every pinned chunk of ``sweep``: ``(tasks, key of the results)``. It refers
    to the chunk's items under :func:`item_key`, and to the shared inputs by ``shared``,
    ``{input: TaskRef}`` (plain references: a ``Future`` in it would start a client wherever it
    is unpickled); neither has a task in it, :func:`_run_chunk` adds them as data. Nothing in it
    depends on which items a chunk holds, or how many (:meth:`daskdag._sweep.Sweep.graph`)."""
    items = {n: TaskRef(item_key(n)) for n in sweep.carried()}
    results = sweep.graph({**shared, **items})
    flat = [d for value, grads in results.values() for d in (value, *grads.values())]
    tasks = dict(flat[0].__dask_graph__())  # (one graph: every result is a key of it)
    shape = [(o, list(grads)) for o, (_, grads) in results.items()]
    # A content key, as the results' keys are. (dask.delayed of the results took ~4 ms.)
    key = f"daskdag-chunk-results-{tokenize([d.key for d in flat], shape)}"
    tasks[key] = Task(key, _assemble, shape, *(TaskRef(d.key) for d in flat))
    return tasks, key


def _assemble(shape: list, *flat):
    """``{output: (value, {input: grad})}`` from the results ``flat`` in :func:`chunk_graph`'s
    order, ``shape`` its ``[(output, [input])]``."""
    it = iter(flat)
    return {o: (next(it), {i: next(it) for i in inputs}) for o, inputs in shape}


def _run_chunk(graph: tuple[dict, str], shared: dict, items: dict, steps: int, report: list | None):
    """A whole chunk as one task, in one worker: the sweep's chunk graph (:func:`chunk_graph`;
    unpickled once on the worker that made it, copied to others as an object) run by Dask's
    synchronous scheduler, with the shared inputs and the chunk's packed items (``{item_key:
    Packed}``), which distributed fetched for this task, as data. Returns the results with
    NumPy leaves: distributed sends NumPy arrays as zero-copy frames, and the client stacks
    them into NumPy arrays anyway."""
    tasks, key = graph
    tasks = dict(tasks)  # a copy: the worker's one graph serves all its chunks, maybe at once
    for k, value in [*shared.items(), *((k, unpack(v)) for k, v in items.items())]:
        tasks[k] = DataNode(k, value)
    with progress.worker_chunk(steps, report):
        computed = dask.get(tasks, key)
    return jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, computed)
