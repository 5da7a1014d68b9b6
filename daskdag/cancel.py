"""Stopping a call that no one waits for any more: between two nodes of a stage, or two items
of a sweep's chunk, a running task asks :func:`dropped` and raises :class:`Cancelled`; which
task a worker's thread runs (:func:`current_task`).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable


class Cancelled(Exception):
    """Raised between two items of a chunk, or two nodes of a stage, that no one waits for."""


class Stop:
    """A local call's stop signal (a ``threading.Event``), which its stages watch. It pickles as
    a fresh one: in another process (Dask's ``processes`` scheduler) no one sets it."""

    def __init__(self):
        self.event = threading.Event()
        self.set, self.is_set = self.event.set, self.event.is_set

    def __reduce__(self):
        return Stop, ()


def check(dropped: Callable[[], bool] | None, node: str) -> None:
    """:class:`Cancelled` before ``node`` runs, when ``dropped()`` says no one waits any more."""
    if dropped is not None and dropped():
        raise Cancelled(f"the call no longer waits for node {node!r}")


def dropped(stop: Stop | None = None) -> Callable[[], bool]:
    """For the task this thread runs: whether no one waits for it any more. On a ``distributed``
    worker, once the worker dropped the task (its client cancelled or released it); elsewhere,
    once ``stop`` is set (Ctrl-C, or a failed node, on Dask's local threads)."""
    task = current_task()
    if task is None:
        return stop.is_set if stop is not None else (lambda: False)
    worker, key = task

    def cancelled() -> bool:
        found = worker.state.tasks.get(key)
        return found is None or found.state == "cancelled"

    return cancelled


def current_task() -> tuple[Any, Any] | None:
    """``(worker, key)`` of the ``distributed`` task this thread runs; None in any other thread
    (not a worker's, or a worker's that runs no task)."""
    module = sys.modules.get("distributed")  # (not imported: not a worker)
    if module is None:
        return None
    try:
        worker = module.get_worker()
        return worker, worker.get_current_task()
    except (ValueError, KeyError):  # no worker here; a worker's thread that runs no task
        return None
