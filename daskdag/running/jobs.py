"""A call prepared, and run: now (the eager functions), or later as a Dask collection (the lazy
ones). The same for :func:`daskdag.compute_grads`, :func:`~daskdag.jacobian`,
:func:`~daskdag.compute_jvps` and :func:`~daskdag.check_grads`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

from daskdag.cancel import Stop
from daskdag.model.plan import Plan
from daskdag.running import cluster, log, resident
from daskdag.running.compute import compute
from daskdag.running.lazy import Call


@dataclass(frozen=True)
class Job:
    """A call prepared: its ``plan``; ``make(place, stop)``, which builds its graph
    (``{output: (value, {name: grad})}`` of ``Delayed``; ``place`` keeps values on a cluster,
    :mod:`daskdag.running.resident`, ``stop`` a local call's stop signal); ``finish``, its
    result from that graph computed; ``kind``, its name in the log."""

    plan: Plan
    make: Callable[[Any, Any], dict]
    finish: Callable[[dict], Any]
    kind: str = "compute_grads"


def run(job: Job, client, local: str | None, progress: bool):
    """The job computed now: on a cluster, checked first, and what it keeps placed once
    (:mod:`daskdag.running.resident`); else on this process's ``local`` scheduler."""
    if client is not None:  # before anything is built or sent
        cluster.check(client, job.plan)
    kept = resident.of(client) if client is not None else None
    stop = Stop() if client is None else None
    before = kept.sent if kept else 0
    with kept.keeping(client) if kept else contextlib.nullcontext() as place:
        graph = job.make(place, stop)
        log.submitted(job.kind, job.plan, graph, log.where(client, local),
                      kept.sent - before if kept else None)
        return job.finish(compute(graph, client, progress, stop, local, job.plan))


def as_collection(job: Job) -> Call:
    """The job as a Dask collection, computed when Dask computes it."""
    return Call.of(job.plan, job.make(None, None), job.finish)
