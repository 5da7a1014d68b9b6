"""What daskdag reads of Dask's threaded scheduler that Dask does not document, in one place
(checked by ``tests/test_internal_dask_local.py``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any


def batch_tasks(args: tuple) -> list[tuple[Any, Any]]:
    """``(key, task)`` of each task of the batch ``dask.local`` submitted with ``args``."""
    return [(key, task) for key, (task, _), *_ in args[0]]


def running(state: dict) -> int:
    """How many tasks run now, by the threaded scheduler's ``state``."""
    return len(state["running"])


def threads_of(pool: ThreadPoolExecutor) -> int:
    """The number of threads ``pool`` runs at most."""
    return pool._max_workers
