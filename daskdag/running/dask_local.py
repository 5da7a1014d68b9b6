"""What daskdag reads of Dask's threaded scheduler (``dask.local``) that Dask does not document,
in one place, so that a Dask release that changes it fails ``tests/test_internal_dask_local.py``
rather than silently changing how local calls run.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any


def batch_tasks(args: tuple) -> list[tuple[Any, Any]]:
    """``(key, task)`` of each task of the batch that ``dask.local`` submitted with ``args``
    (the arguments after the function)."""
    return [(key, task) for key, (task, _), *_ in args[0]]


def running(state: dict) -> int:
    """How many tasks run now, by the threaded scheduler's ``state``."""
    return len(state["running"])


def threads_of(pool: ThreadPoolExecutor) -> int:
    """The number of threads ``pool`` runs at most."""
    return pool._max_workers
