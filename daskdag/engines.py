"""Where a sweep's chunks run: threads of this process, or a ``distributed`` cluster.

An engine submits a chunk's graph, waits for some chunk to finish, lets go of a finished one, and
on :meth:`close` stops everything it started: queued chunks never start, and on a cluster every
future it made is cancelled and released, whatever way the sweep ended.
"""

from __future__ import annotations

import concurrent.futures
import uuid
import warnings

import cloudpickle
import dask
import distributed

from .cluster import workers


class Threads:
    """Each chunk synchronously on one of ``in_flight`` threads of this process."""

    def __init__(self, in_flight: int):
        self.pool = concurrent.futures.ThreadPoolExecutor(in_flight, thread_name_prefix="daskdag-sweep")
        self.shared = {}

    def submit(self, graph):
        return self.pool.submit(lambda: dask.compute(graph, scheduler="sync")[0])

    def wait_any(self, futures) -> set:
        return concurrent.futures.wait(futures, return_when="FIRST_COMPLETED").done

    def release(self, future):
        pass

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)


class Cluster:
    """Chunks as tasks of a ``distributed`` cluster; shared inputs placed on it once.

    ``pin``: each chunk runs as one task on one worker (the one with the fewest chunks in
    flight; loosely, so the worker's death can still move it). Left to itself the scheduler
    split chunks over workers and shipped pullbacks and cotangents between them (a third of the
    2-worker sweep benchmark's time), and a chunk's ~25 tasks each cost distributed's per-task
    overhead. Chunks whose nodes need resources stay task graphs, which the scheduler places
    node by node.
    """

    def __init__(self, client, shared: dict, pin: bool):
        self.client, self.pin = client, pin
        self.futures: dict = {}  # every chunk future not released yet -> its worker when pinned
        self.shared: dict = {}
        try:
            for name, value in shared.items():
                self.shared[name] = place_shared(client, name, value)
        except BaseException:
            self.close()
            raise

    def submit(self, graph):
        addresses = list(workers(self.client)) if self.pin else []
        if not addresses:  # task graphs, or no worker yet (an adaptive cluster): the scheduler places it
            fut = self.client.compute(graph)
            self.futures[fut] = None
            return fut
        worker = min(addresses, key=lambda w: sum(1 for v in self.futures.values() if v == w))
        whole = dask.delayed(graph)
        tasks = cloudpickle.dumps(dict(whole.__dask_graph__()))
        fut = self.client.submit(_run_chunk, tasks, whole.key, {f.key: f for f in self.shared.values()},
                                 pure=False, workers=[worker], allow_other_workers=True)
        self.futures[fut] = worker
        return fut

    def wait_any(self, futures) -> set:
        with self.client.as_current():
            return distributed.wait(futures, return_when="FIRST_COMPLETED").done

    def release(self, future):
        self.futures.pop(future, None)
        future.release()

    def close(self):
        held = [*self.futures, *self.shared.values()]
        self.futures.clear()
        if held:
            try:  # cancel stops queued chunks and drops the running ones' results
                self.client.cancel(held)
            except Exception:  # a client already closed has nothing left to cancel
                pass
        for fut in held:  # release: a frame or error still holding a future keeps nothing alive
            fut.release()


def place_shared(client, name: str, value) -> distributed.Future:
    """Put the shared input ``name`` on the cluster, once per sweep, for every chunk to use.

    It goes as a task whose result is ``value``, not ``client.scatter``: the scheduler keeps a
    task's recipe (here the value itself), so when the worker holding the result dies it runs
    the task again on another, where a scattered value is lost with its only holder and every
    chunk needing it fails. The key is this call's own, which no other sweep's release can take.
    """
    with warnings.catch_warnings():  # sending the value in the graph, once, is the point
        warnings.filterwarnings("ignore", message="Sending large graph")
        return client.submit(_value, value, key=f"shared-{name}-{uuid.uuid4().hex}")


def _value(value):
    return value


def _run_chunk(tasks: bytes, key, shared: dict):
    """A whole chunk as one task, in one worker: its graph run by Dask's synchronous scheduler,
    with the shared inputs, which distributed fetched for this task, as data."""
    graph = cloudpickle.loads(tasks)
    for k, value in shared.items():
        graph.update(dask.delayed(value, name=k, traverse=False).__dask_graph__())
    return dask.get(graph, key)
