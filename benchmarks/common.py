"""Shared by the scenarios: timing methods interleaved, the machine's description, the bytes a
call sends to a cluster, and the ``distributed`` clusters.

The clusters (:func:`clusters`), as the JSON's ``clusters`` records them:

``1w``, ``2w``  default clusters, started exactly as a user starts one:
                ``distributed.LocalCluster(n_workers=k, threads_per_worker=1, processes=True)``
                with distributed's defaults (its nanny sets ``MALLOC_TRIM_THRESHOLD_=65536`` in
                each worker's environment) and no pinning. daskdag's worker plugin
                (``daskdag/running/workers.py``) stays off there, as by default
                (``daskdag.tune-workers``). Every headline cluster figure comes from these.
``2w_tuned``    two workers tuned for this 2-core machine, reported only as separate, labelled
                methods (``*_2w_tuned``): each worker pinned to one core (worker ``i`` to core
                ``i mod cpu_count``, by :func:`dask_setup`, which distributed calls in each
                worker at start-up because this file is its preload module), and started without
                ``MALLOC_TRIM_THRESHOLD_`` (:func:`worker_environment`).

Starting a cluster leaves this process's ``os.environ`` as it was (:func:`_environ_kept`), so
processes a scenario starts later are plain ones, whatever the nannies set for their workers.

Why the tuned variant pins: XLA's CPU client sizes its intra-op thread pool by the CPUs its
process may run on, so two default workers on two cores each have a pool as wide as the machine
and fight over the cores when both compute. ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false``
does not narrow it in jaxlib 0.10 (a worker's 1024x1024 matmul loop used 1.5 CPU-seconds per
second with it as without it, and 1.0 pinned), so XLA_FLAGS is left unset everywhere.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import platform
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import dask
import distributed
import jax
import jax.numpy as jnp
import numpy as np

import daskdag

N_WORKERS = 2


def dask_setup(worker) -> None:
    """Pin every thread of this worker process to one core; threads made later inherit it."""
    cpu = int(worker.name) % os.cpu_count()
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {cpu})


def example(name: str):
    """``examples/<name>.py`` loaded as a module (under a name of its own)."""
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"daskdag_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def targets(cases: list[dict], wanted: list[dict]) -> list[dict]:
    """Each target of ``wanted`` with what this run measured: in, dicts ``{"case": case name,
    "ratio": a ratio's label in that case, "op": "<=" or ">=", "bound": float, "source": where
    the target comes from, "was": the figure before, optional}``; out, the same dicts with
    ``"measured"`` (None if the ratio is missing from this run: torch not installed, say) and
    ``"met"``. Targets of cases this run did not measure (a quick run has fewer) are left out."""
    by_name = {c["case"]: c for c in cases}
    out = []
    for t in wanted:
        if t["case"] not in by_name:
            continue
        measured = by_name[t["case"]].get("ratios", {}).get(t["ratio"])
        met = None if measured is None else (
            measured <= t["bound"] if t["op"] == "<=" else measured >= t["bound"])
        out.append({**t, "measured": measured, "met": met})
    return out


def worst_difference(got, ref) -> float:
    """Largest ``|got - ref|`` over matching leaves, each relative to its reference's largest
    entry."""
    return max(float(np.max(np.abs(np.asarray(g) - np.asarray(r))) / max(np.max(np.abs(r)), 1e-30))
               for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))


# --- Clusters -----------------------------------------------------------------------------------

# name -> (workers, tuned); see the module docstring. Only the "_tuned" ones are tuned.
CLUSTERS = {"1w": (1, False), "2w": (2, False), "2w_tuned": (2, True)}
TRIM = "MALLOC_TRIM_THRESHOLD_"


def worker_environment() -> dict:
    """Dask config for the tuned workers' environment: without ``MALLOC_TRIM_THRESHOLD_``, which
    distributed's nanny sets to 65536 (None unsets a variable there). It turns off glibc's
    adaptive mmap threshold, so large temporaries are mmapped and faulted in afresh: a 32-item
    sweep chunk took 1.8 times as long in a worker with it as without it."""
    return {f"distributed.nanny.pre-spawn-environ.{TRIM}": None}


@contextmanager
def clusters(names=tuple(CLUSTERS)) -> Iterator[dict[str, distributed.Client]]:
    """``{name: client}`` for each of ``names`` (keys of :data:`CLUSTERS`), all up at once."""
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(cluster(*CLUSTERS[name])) for name in names}


@contextmanager
def cluster(n_workers: int = N_WORKERS, tuned: bool = False) -> Iterator[distributed.Client]:
    """A client of a process ``LocalCluster`` of ``n_workers`` single-threaded workers: as a user
    starts one, or with ``tuned`` each worker pinned to one core and started without
    ``MALLOC_TRIM_THRESHOLD_``.

    The client is not made the default one, so daskdag calls without ``client=`` keep using
    Dask's threaded scheduler. This process's ``os.environ`` is left as it was (see
    :func:`_environ_kept`).
    """
    kwargs = dict(n_workers=n_workers, threads_per_worker=1, processes=True,
                  dashboard_address=":0")
    with contextlib.ExitStack() as stack:
        if tuned:
            stack.enter_context(dask.config.set(worker_environment()))
            kwargs["preload"] = [__file__]
        stack.enter_context(_environ_kept(drop=[TRIM] if tuned else []))
        local = distributed.LocalCluster(**kwargs)  # its workers have started by now
    with local, distributed.Client(local, set_as_default=False) as client:
        client.wait_for_workers(n_workers, timeout=120)
        yield client


@contextmanager
def _environ_kept(drop=()) -> Iterator[None]:
    """``os.environ`` put back as it was after the block, ``drop``'s names taken out during it.

    A nanny writes its pre-spawn variables (``MALLOC_TRIM_THRESHOLD_``, ``OMP_NUM_THREADS``, ...)
    into this process's ``os.environ`` when it spawns its worker, so every process started
    later (another cluster's workers, a scenario's plain processes) would inherit them. (A
    nanny that restarts its worker writes them again; no scenario restarts one.)
    """
    saved = dict(os.environ)
    for name in drop:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def workers(client) -> list[str]:
    """Worker addresses, ordered by worker name."""
    info = live_workers(client)
    return sorted(info, key=lambda addr: int(info[addr]["name"]))


def live_workers(client) -> dict[str, dict]:
    """``{address: info}`` of the cluster's workers, asked of the scheduler now (its cached
    ``scheduler_info()`` may not have them yet)."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def _probe(size: int = 1024, reps: int = 5) -> dict:
    """This process's CPU affinity, ``MALLOC_TRIM_THRESHOLD_`` and the CPU-seconds per second of
    a JAX matmul loop."""
    a = jnp.ones((size, size), jnp.float32)
    jax.block_until_ready(a @ a)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(reps):
        jax.block_until_ready(jnp.tanh(a @ a))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"cpus": sorted(os.sched_getaffinity(0)), TRIM: os.environ.get(TRIM),
            "matmul_cpu_per_wall": round(cpu / wall, 2)}


def describe(name: str, client) -> dict:
    """What the JSON records about the cluster ``name`` (a key of :data:`CLUSTERS`): how it was
    started, and each worker's CPU affinity, ``MALLOC_TRIM_THRESHOLD_`` and the CPU-seconds per
    second of its XLA (near 1 when pinned; probed one worker at a time, as two at once would
    share the cores anyway)."""
    n_workers, tuned = CLUSTERS[name]
    probes = {addr: client.run(_probe, workers=[addr])[addr] for addr in workers(client)}
    kind = (f"distributed.LocalCluster(n_workers={n_workers}, threads_per_worker=1, "
            f"processes=True)")
    return {
        "name": name,
        "tuned": tuned,
        "kind": kind + (", preload pinning each worker to one core, MALLOC_TRIM_THRESHOLD_ unset"
                        if tuned else ", distributed's defaults"),
        "label": (f"tuned {n_workers}-worker cluster (not a default: pinned, "
                  f"MALLOC_TRIM_THRESHOLD_ unset)" if tuned else
                  f"default {n_workers}-worker LocalCluster"),
        "xla_threads_per_worker": "1: each worker pinned to one core (os.sched_setaffinity in a "
                                  "preload); XLA_FLAGS unset" if tuned else
                                  "all cores: workers unpinned; XLA_FLAGS unset",
        "workers": probes,
    }


def plugin_state(client) -> dict:
    """Per worker, what daskdag's worker plugin ``daskdag-tune-malloc`` did there (its
    ``applied`` and ``reason``), or None where it is not registered."""
    def state(dask_worker):
        plugin = dask_worker.plugins.get("daskdag-tune-malloc")
        return None if plugin is None else {"applied": plugin.applied, "reason": plugin.reason}
    return client.run(state)


# --- Bytes a call sends --------------------------------------------------------------------------

def bytes_sent(client, fn: Callable[[], object]) -> dict:
    """Run ``fn()`` and return what it sent to ``client``'s cluster, two ways:

    ``daskdag``: the bytes daskdag placed on the cluster (inputs and nodes sent once, kept
        between calls), as its log says them (logger ``"daskdag"``, INFO: "placed N bytes");
    ``to_scheduler``: the bytes distributed's own client wrote to the scheduler meanwhile
        (``client.scheduler_comm.byte_count``, distributed's counter of its batched stream,
        which carries every graph, ``submit`` included), counted after the stream drained;
    ``messages``: how many messages that stream carried.
    """
    placed = _Placed()
    log = logging.getLogger("daskdag")
    level = log.level
    log.addHandler(placed)
    log.setLevel(logging.INFO)
    try:
        comm = client.scheduler_comm
        _drain(comm)
        before = (comm.byte_count, comm.message_count)
        jax.block_until_ready(fn())
        _drain(comm)
        after = (comm.byte_count, comm.message_count)
    finally:
        log.removeHandler(placed)
        log.setLevel(level)
    return {"daskdag": placed.total, "to_scheduler": after[0] - before[0],
            "messages": after[1] - before[1]}


class _Placed(logging.Handler):
    """Adds up the bytes daskdag's log says each call placed on the cluster."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.total = 0

    def emit(self, record):
        found = re.search(r"placed (\d+) bytes", record.getMessage())
        self.total += int(found.group(1)) if found else 0


def _drain(comm, timeout: float = 5.0) -> None:
    """Wait until the batched stream's buffer is empty and its byte count has settled."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = (comm.byte_count, len(comm.buffer))
        if now == last and not comm.buffer:
            return
        last = now


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
