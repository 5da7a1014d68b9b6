"""Where a sweep's chunks run: threads of this process, or a ``distributed`` cluster.

An engine submits a chunk's graph, waits for some chunk to finish, lets go of a finished one, and
on :meth:`close` stops everything it started: queued chunks never start, running ones stop at
their next item (:mod:`daskdag.progress`), and on a cluster every future it made is released,
whatever way the sweep ended.
"""

from __future__ import annotations

import concurrent.futures
import threading
import uuid

import cloudpickle
import dask
import distributed

from . import progress
from .cluster import workers
from .resident import keep
from .shipping import pack_for, unpack

WAIT = 0.2  # seconds a wait returns after at the latest, to refresh the progress bar


class Threads:
    """Each chunk synchronously on one of ``in_flight`` threads of this process."""

    def __init__(self, in_flight: int, bar: progress.Progress | None):
        self.pool = concurrent.futures.ThreadPoolExecutor(in_flight, thread_name_prefix="daskdag-sweep")
        self.stop, self.bar, self.shared = threading.Event(), bar, {}

    def submit(self, graph, chunk: tuple[int, int], steps: int):
        report = None if self.bar is None else (lambda f: self.bar.report(chunk, f))

        def job():
            with progress.ChunkRun(steps, self.stop.is_set, report):
                return dask.compute(graph, scheduler="sync")[0]

        return self.pool.submit(job)

    def wait_any(self, futures) -> set:
        return concurrent.futures.wait(futures, WAIT, return_when="FIRST_COMPLETED").done

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
    """

    def __init__(self, client, shared: dict, pin: bool, bar: progress.Progress | None):
        self.client, self.pin, self.bar = client, pin, bar
        self.futures: dict = {}  # every chunk future not released yet -> its worker when pinned
        self.id = uuid.uuid4().hex
        self.shared: dict = {}
        self.listening = False
        try:
            for name, value in shared.items():
                self.shared[name] = place_shared(client, name, value)
            if bar is not None:
                progress.listen(client, self.id, bar.report)
                self.listening = True
        except BaseException:
            self.close()
            raise

    def submit(self, graph, chunk: tuple[int, int], steps: int):
        addresses = list(workers(self.client)) if self.pin else []
        if not addresses:  # task graphs, or no worker yet (an adaptive cluster): the scheduler places it
            fut = self.client.compute(graph)
            self.futures[fut] = None
            return fut
        worker = min(addresses, key=lambda w: sum(1 for v in self.futures.values() if v == w))
        whole = dask.delayed(graph)
        tasks = cloudpickle.dumps(dict(whole.__dask_graph__()))
        report = None if self.bar is None else [self.id, *chunk]
        fut = self.client.submit(_run_chunk, tasks, whole.key, {f.key: f for f in self.shared.values()},
                                 steps, report, pure=False, workers=[worker], allow_other_workers=True)
        self.futures[fut] = worker
        return fut

    def wait_any(self, futures) -> set:
        try:
            with self.client.as_current():
                return distributed.wait(futures, timeout=WAIT, return_when="FIRST_COMPLETED").done
        except TimeoutError:
            return set()

    def release(self, future):
        self.futures.pop(future, None)
        future.release()

    def close(self):
        held = [*self.futures, *self.shared.values()]
        self.futures.clear()
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


def place_shared(client, name: str, value) -> distributed.Future:
    """Put the shared input ``name`` on the cluster, once per sweep, for every chunk to use.

    It goes as a task whose result is the value (:func:`daskdag.resident.keep`), so it survives
    the loss of its worker, where a scattered value would fail every chunk needing it. The key
    is this call's own, which no other sweep's release can take. The value travels packed, as
    every input does (:mod:`daskdag.shipping`).
    """
    packed = pack_for(f"input {name!r}", value, remote=True)
    return keep(client, f"shared-{name}-{uuid.uuid4().hex}", unpack, packed)


def _run_chunk(tasks: bytes, key, shared: dict, steps: int, report: list | None):
    """A whole chunk as one task, in one worker: its graph run by Dask's synchronous scheduler,
    with the shared inputs, which distributed fetched for this task, as data."""
    graph = cloudpickle.loads(tasks)
    for k, value in shared.items():
        graph.update(dask.delayed(value, name=k, traverse=False).__dask_graph__())
    with progress.worker_chunk(steps, report):
        return dask.get(graph, key)
