"""Shared by the scenarios: timing methods interleaved, the machine's description, and the
``distributed`` clusters, whose worker processes use one XLA thread each.

XLA's CPU client sizes its intra-op thread pool by the CPUs its process may run on. Two worker
processes on two cores, each with a pool as wide as the machine, would fight over the cores, so
each worker pins itself to one core (worker ``i`` to core ``i mod cpu_count``) before it first
touches JAX. ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`` (passed with ``LocalCluster(env=)``)
does not do this in jaxlib 0.10: a worker's 1024x1024 matmul loop used 1.5 CPU-seconds per
second with it as without it, and 1.0 pinned. ``intra_op_parallelism_threads`` is a TensorFlow
option, not an XLA flag. So XLA_FLAGS is left unset.

This file is also the workers' preload module: distributed imports it in each worker process
and calls :func:`dask_setup` there at start-up, before any task runs. ``cluster(pin=False)``
leaves the workers unpinned, each XLA as wide as the machine: faster when the scheduler keeps
only one worker busy at a time, slower when both compute at once.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import dask
import distributed
import jax
import jax.numpy as jnp
import numpy as np

import daskdag
from daskdag.cluster import workers as live_workers

N_WORKERS = 2


def dask_setup(worker) -> None:
    """Pin every thread of this worker process to one core; threads made later inherit it."""
    cpu = int(worker.name) % os.cpu_count()
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cpu})


# --- Timing -------------------------------------------------------------------------------------

def timed(fn: Callable, *args) -> tuple[float, object]:
    """Wall seconds of ``fn(*args)`` and its result, waited for (eager JAX dispatches
    asynchronously)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out


def interleaved(methods: dict[str, Callable[[], object]], reps: int, label: str = ""
                ) -> dict[str, list[float]]:
    """Seconds per call of each method, round-robin, each repetition starting at the next method,
    so that a drift of the machine spreads over all of them."""
    times = {name: [] for name in methods}
    names = list(methods)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            times[name].append(timed(methods[name])[0])
        print(f"  {label}rep {rep + 1}/{reps}: " + ", ".join(
            f"{n} {times[n][-1] * 1e3:.1f} ms" for n in names), flush=True)
    return times


def case(name: str, params: dict, times: dict[str, list[float]], ratios: dict[str, tuple[str, str]],
         **extra) -> dict:
    """One comparison for the report: each method's times and median, and ``ratios``
    ``{label: (numerator method, denominator method)}`` of medians, all from the same run."""
    med = {m: statistics.median(t) for m, t in times.items()}
    return {"case": name, "params": params,
            "methods": {m: {"times_s": t, "median_s": med[m]} for m, t in times.items()},
            "ratios": {label: med[a] / med[b] for label, (a, b) in ratios.items()
                       if a in med and b in med},
            **extra}


def worst_difference(got, ref) -> float:
    """Largest ``|got - ref|`` over matching leaves, each relative to its reference's largest
    entry."""
    return max(float(np.max(np.abs(np.asarray(g) - np.asarray(r))) / max(np.max(np.abs(r)), 1e-30))
               for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))


# --- Clusters -----------------------------------------------------------------------------------

def worker_environment() -> dict:
    """Dask config for the workers' environment: without ``MALLOC_TRIM_THRESHOLD_``, which
    distributed's nanny sets to 65536 (None unsets a variable there). It turns off glibc's
    adaptive mmap threshold, so large temporaries are mmapped and faulted in afresh: a 32-item
    sweep chunk took 1.8 times as long in a worker with it as without it."""
    return {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}


@contextmanager
def clusters(worker_counts: tuple[int, ...]) -> Iterator[dict[str, distributed.Client]]:
    """``{"1w": client, "2w": client, ...}``: a :func:`cluster` per worker count, all up at once,
    their workers started without ``MALLOC_TRIM_THRESHOLD_``."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(dask.config.set(worker_environment()))
        yield {f"{n}w": stack.enter_context(cluster(n_workers=n)) for n in worker_counts}


@contextmanager
def cluster(n_workers: int = N_WORKERS, pin: bool = True) -> Iterator[distributed.Client]:
    """A client of a process ``LocalCluster`` of ``n_workers`` single-threaded workers, each
    pinned to one core unless ``pin`` is false.

    The client is not made the default one, so daskdag calls without ``client=`` keep using
    Dask's threaded scheduler.
    """
    preload = [__file__] if pin else []
    with distributed.LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                                  dashboard_address=":0", preload=preload) as local, \
            distributed.Client(local, set_as_default=False) as client:
        client.wait_for_workers(n_workers, timeout=120)
        yield client


def workers(client) -> list[str]:
    """Worker addresses, ordered by worker name."""
    info = live_workers(client)
    return sorted(info, key=lambda addr: int(info[addr]["name"]))


def _probe(size: int = 1024, reps: int = 5) -> dict:
    """This process's CPU affinity and the CPU-seconds per second of a JAX matmul loop."""
    a = jnp.ones((size, size), jnp.float32)
    jax.block_until_ready(a @ a)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(reps):
        jax.block_until_ready(jnp.tanh(a @ a))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"cpus": sorted(os.sched_getaffinity(0)), "matmul_cpu_per_wall": round(cpu / wall, 2)}


def describe(client, pin: bool = True) -> dict:
    """What the JSON records about the cluster, including each worker's CPU affinity and the
    CPU-seconds per second of its XLA (near 1 when pinned; probed one worker at a time, as two
    at once would share the cores anyway)."""
    probes = {addr: client.run(_probe, workers=[addr])[addr] for addr in workers(client)}
    return {
        "kind": f"distributed.LocalCluster(n_workers={len(probes)}, threads_per_worker=1, "
                f"processes=True)",
        "xla_threads_per_worker": "1: each worker process pinned to one core (os.sched_setaffinity "
                                  "in a preload); XLA_FLAGS unset" if pin else
                                  "all cores: workers unpinned; XLA_FLAGS unset",
        "workers": probes,
    }


def machine() -> dict:
    """The machine and package versions, for the JSON."""
    try:
        import torch
        torch_version = f"{torch.__version__} ({torch.get_num_threads()} threads)"
    except ImportError:
        torch_version = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),  # XLA's CPU thread pool and Dask's threaded scheduler size
        "load_average_at_start": os.getloadavg(),
        "jax": jax.__version__,
        "jax_devices": [str(d) for d in jax.devices()],
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "daskdag": daskdag.__version__,
        "torch": torch_version,
        "matplotlib": _version("matplotlib"),
        "xla_flags": os.environ.get("XLA_FLAGS"),
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None
