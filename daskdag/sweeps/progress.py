"""What a running sweep chunk tells the sweep (how far it got, which items failed) and asks it
(was it cancelled?), and the bar over items. A failed item's error is kept without stack frames
(:func:`detached`) and picklable (:func:`picklable`), to come back from a worker and into a store.

Between two items a chunk calls :func:`checkpoint`, which counts the step and raises
:class:`Cancelled` once the sweep stopped waiting for the chunk, so Ctrl-C does not wait for
whole chunks. On the client, :class:`Progress` draws Dask's text bar over items; chunks on a
cluster report through distributed's event log.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
import traceback
from typing import Callable

from tqdm.std import tqdm

from daskdag.cancel import Cancelled, dropped
from daskdag.errors import NodeError
from daskdag.running.compute import listening

TOPIC = "daskdag-sweep-progress"  # one topic: the scheduler keeps a bounded log per topic
REPORT_EVERY = 0.2  # seconds between a worker's reports for one chunk
# Dask's text bar (40 wide, "#"), with the count of items
BAR = {"bar_format": "[{bar:40}] | {percentage:3.0f}% Completed | {n_fmt}/{total_fmt} items | "
                     "{elapsed_s:.2f} s",
       "ascii": " #"}

_running = threading.local()  # .chunk: the ChunkRun of the chunk this thread runs, if any


class ChunkRun:
    """One chunk of ``items`` items being run in this thread: ``steps`` item steps in all;
    ``report(fraction)`` hears how far it got, at most every ``every`` seconds. ``failed``:
    ``{index in the chunk: NodeError}`` of its items that failed so far."""

    def __init__(self, items: int, steps: int, cancelled: Callable[[], bool],
                 report: Callable[[float], None] | None = None, every: float = 0.0):
        self.steps, self.cancelled, self.report, self.every = steps, cancelled, report, every
        self.done, self.last, self.items = 0, time.monotonic(), items
        self.failed: dict[int, NodeError] = {}

    def nothing_left(self) -> bool:
        """Every item of the chunk failed."""
        return len(self.failed) >= self.items

    def __enter__(self):
        self.outer, _running.chunk = getattr(_running, "chunk", None), self
        return self

    def __exit__(self, *exc):
        _running.chunk = self.outer

    def step(self):
        if self.cancelled():
            raise Cancelled("the sweep no longer waits for this chunk")
        self.done += 1
        if self.report is not None and self.steps and time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            self.report(min(1.0, self.done / self.steps))


def checkpoint():
    """Between two items of a chunk: count the step, stop if the sweep was cancelled."""
    chunk = getattr(_running, "chunk", None)
    if chunk is not None:
        chunk.step()


def fail(index: int, error: NodeError) -> bool:
    """Item ``index`` of the chunk this thread runs failed with ``error``: kept with the chunk
    (without stack frames, picklable). False where no chunk runs in this thread (a chunk of
    task graphs): the caller raises ``error``."""
    chunk = getattr(_running, "chunk", None)
    if chunk is None:
        return False
    chunk.failed.setdefault(index, picklable(detached(error, None)))
    return True


def failed_already(index: int) -> bool:
    """Whether item ``index`` of the chunk this thread runs has failed already."""
    chunk = getattr(_running, "chunk", None)
    return chunk is not None and index in chunk.failed


def detached(e: NodeError, item: int | None) -> NodeError:
    """``e`` for ``item``, holding no stack frames: a traceback holds every local of the calls
    it came through (from a cluster, this sweep's own frames: its futures and arrays), which a
    kept error would keep alive. The original's traceback stays, as text in a note."""
    todo: list[BaseException | None]
    seen, todo = set(), [e.original]
    while todo:  # the original and the exceptions chained to it
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if x.__traceback__ is not None:
            x.add_note("Raised at (traceback kept as text):\n"
                       + "".join(traceback.format_tb(x.__traceback__)).rstrip())
            x.__traceback__ = None
        todo += [x.__cause__, x.__context__]
    return NodeError(e.node, e.phase, e.original, item=item)


def picklable(e: NodeError) -> NodeError:
    """``e``, or where what it holds cannot be pickled, the same error with its original
    exception's text alone."""
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return NodeError(e.node, e.phase, RuntimeError(f"{type(e.original).__name__}: "
                                                       f"{e.original}"), item=e.item)


class NothingLeft(Exception):
    """Raised by a node over a chunk whose items all failed before it: the chunk stops, and its
    result is its failures."""


# -- in a distributed worker ---------------------------------------------------------------------

def worker_chunk(items: int, steps: int, report: list | None) -> ChunkRun:
    """The :class:`ChunkRun` of the task this worker thread runs: cancelled once the worker
    dropped the task; ``report``, ``[sweep id, start, stop]``, goes with each fraction done to
    :data:`TOPIC`."""
    import distributed

    worker = distributed.get_worker()
    send = None if report is None else (lambda f: worker.log_event(TOPIC, [*report, f]))
    return ChunkRun(items, steps, dropped(), send, REPORT_EVERY)


# -- in the client --------------------------------------------------------------------------------

class Progress:
    """The bar over a sweep's ``total`` items: finished chunks count whole, running ones by the
    fraction of their item steps done. Reports of a chunk no longer open are ignored, so the
    final count is the exact number of items finished."""

    def __init__(self, total: int):
        self.bar = tqdm(total=total, unit="item", **BAR)
        self.done = 0
        self.partial: dict[tuple[int, int], float] = {}  # open chunk -> items done in it
        self.lock = threading.Lock()

    def open(self, chunk: tuple[int, int]):
        with self.lock:
            self.partial[chunk] = 0.0

    def report(self, chunk: tuple[int, int], fraction: float):
        """From any thread: the chunk got through ``fraction`` of its item steps."""
        with self.lock:
            if chunk in self.partial:
                self.partial[chunk] = fraction * (chunk[1] - chunk[0])

    def already(self, items: int):
        """``items`` were done before the sweep started (a resumed sweep's), shown at once."""
        with self.lock:
            self.done += items
        self.refresh()
        self.bar.refresh()

    def close_chunk(self, chunk: tuple[int, int], finished: int):
        """The chunk is no longer running; ``finished`` of its items count as done."""
        with self.lock:
            self.partial.pop(chunk, None)
            self.done += finished
        self.refresh()

    def settle(self, items: int):
        """The bar at ``items`` done, what a store holds (a sweep stopped)."""
        with self.lock:
            self.done, self.partial = items, {}
            self.bar.n = items
        self.bar.refresh()

    def refresh(self):
        with self.lock:
            target = self.done + int(sum(self.partial.values()))
        if target > self.bar.n:  # never backwards: a chunk that failed drops its share
            self.bar.update(target - self.bar.n)

    def close(self):
        self.bar.close()


def listen(client, sweep_id: str, report: Callable) -> contextlib.AbstractContextManager:
    """Within it, sweep ``sweep_id``'s :data:`TOPIC` events go to ``report(chunk, fraction)``."""
    def heard(message: list) -> None:
        if message[0] == sweep_id:
            report((message[1], message[2]), message[3])

    return listening(client, TOPIC, heard)
