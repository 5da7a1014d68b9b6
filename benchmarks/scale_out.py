"""Scenario: scaling out to W workers, on nodes that wait (a solver, a GPU kernel) rather than compute.

For each W (4, 8, 16; 4 and 8 in a quick run) the scenario starts its own default cluster,
one at a time: ``distributed.LocalCluster(n_workers=W, threads_per_worker=1, processes=True,
dashboard_address=None)`` with distributed's defaults, and a ``Client(cluster,
set_as_default=False)``; this process's environment is kept as ``common._environ_kept`` keeps
it. The nodes mostly sleep, so W worker processes on a 2-core machine can all be busy at once.

wide:   4W independent branches ``x -> S_i``, each ``time.sleep(0.25)`` then ``sin(x * (i + 1))``
        on float32[8], and one scalar ``head`` summing them all; the value and gradient of
        ``head``.
        daskdag:       ``daskdag.compute_grads(dag, x, "head", client=client)``.
        hand_written:  the same work as a hand-written Dask graph: one ``dask.delayed`` task per
                       branch doing ``jax.value_and_grad`` of its share (the sum of its branch's
                       output), summed by one task, on the same client.
        Ideal: the total waiting over W workers, (4W * 0.25 s) / W = 1 s.
sweeps: 100W items, each item's node ``time.sleep(0.02)`` then ``tanh(x * w)``, the loss the
        sum of squares; ``x`` batched (float32[100W, 8]), ``w`` shared.
        daskdag:  ``daskdag.sweep_grads(dag, {"x": xs, "w": w}, "loss", batched=["x"],
                  client=client)``, its default chunk size.
        delayed:  ``dask.delayed`` over the same chunks of items (the chunk size daskdag's
                  default gives, ``max(1, min(256, ceil(N / (4 * threads))))``, recorded), each
                  chunk task doing ``jax.value_and_grad`` item by item of the composed
                  function, all chunks computed at once with ``dask.compute(*parts,
                  scheduler=client)`` and stacked.
        Ideal: N * 0.02 s / W = 2 s.

Each method runs once first (warm-up: compiles, places things), daskdag checked against the
hand-written method (values and gradients, ``np.testing.assert_allclose``, rtol 1e-5); then the
methods are timed interleaved (``common.interleaved``), each repetition on a fresh input
(``x + rep * 1e-3``) so that nothing is served from an earlier identical call. Efficiency is
ideal / median time, reported as the ratios ``efficiency_<method>``, next to the ratio of the
medians ``daskdag/hand_written`` (``daskdag/delayed``).

The diagnosis when efficiency is low (``branch_tasks`` of each wide case, from
``distributed.get_task_stream``): for each timed call of each method, how many branches ran on
each worker (daskdag: the forward tasks, those whose key contains ``fwd`` and the branch's node
name, a fused key possibly naming several; hand_written: the ``branch_share`` tasks; ideal: 4
per worker), and the call's timeline: before the first branch started, from it to the last
branch's end, and after. For sweeps, ``cpu_floor_s``: the delayed method's own work per item
without the waiting, timed in this process, times N over the machine's cores, a floor that
the waiting does not set (on 2 cores, 100W items' JAX work can exceed N * 0.02 / W).

Targets (issue 21), at each W: wide ``efficiency_daskdag >= 0.85`` and ``daskdag/hand_written
<= 1.0``; sweeps ``daskdag/delayed <= 1.0``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable, Iterator

import dask
import distributed
import jax
import jax.numpy as jnp
import numpy as np

import daskdag

from . import common
TITLE = "Scale-out to W workers (nodes that wait)"
RTOL = 1e-5
STEP = 1e-3  # each repetition's input is the warm-up's plus rep * STEP
WHERE = "a default W-worker LocalCluster the scenario starts (W as the case says)"


@dataclass(frozen=True)
class Config:
    workers: tuple[int, ...]  # the values of W, one cluster each, one at a time
    reps: int  # timed repetitions per method, after one warm-up
    branches_per_worker: int = 4  # wide: 4W branches
    wide_wait_s: float = 0.25  # wide: each branch's wait
    items_per_worker: int = 100  # sweeps: 100W items
    item_wait_s: float = 0.02  # sweeps: each item's wait
    width: int = 8  # x (an item of xs) is float32[width]
    start_timeout_s: float = 300.0  # for all W workers to join


FULL = Config(workers=(4, 8, 16), reps=3)
QUICK = Config(workers=(4, 8), reps=2)


# --- The clusters ------------------------------------------------------------------------------

def kind(n_workers: int) -> str:
    return (f"distributed.LocalCluster(n_workers={n_workers}, threads_per_worker=1, "
            f"processes=True, dashboard_address=None), distributed's defaults")


@contextlib.contextmanager
def cluster(n_workers: int, timeout: float) -> Iterator[distributed.Client]:
    """A default ``n_workers``-worker process cluster and a client of it (not the default
    client); this process's ``os.environ`` left as it was."""
    with common._environ_kept():
        local = distributed.LocalCluster(n_workers=n_workers, threads_per_worker=1,
                                         processes=True, dashboard_address=None)
    with local, distributed.Client(local, set_as_default=False) as client:
        client.wait_for_workers(n_workers, timeout=timeout)
        yield client


class Fresh:
    """``fn(x)`` with a fresh input each call: the first call (the warm-up) gets ``x``, the
    k-th ``x + (k - 1) * STEP``. ``windows``: each call's (start, end) in ``time.time()``."""

    def __init__(self, fn: Callable, x):
        self.fn, self.x, self.calls, self.windows = fn, x, 0, []

    def __call__(self):
        x = self.x + np.float32(self.calls * STEP)
        self.calls += 1
        start = time.time()
        out = jax.block_until_ready(self.fn(x))
        self.windows.append((start, time.time()))
        return out


# --- wide: 4W branches that wait, one head --------------------------------------------------------

def branch(wait: float, i: int, x):
    time.sleep(wait)  # standing in for a solver or a GPU kernel
    return jnp.sin(x * (i + 1))


def total(*branches):
    return sum(jnp.sum(s) for s in branches)


def wide_dag(n: int, wait: float) -> dict:
    dag = {f"S{i}": (partial(branch, wait, i), ["x"]) for i in range(n)}
    dag["head"] = (total, [f"S{i}" for i in range(n)])
    return dag


def wide_daskdag(dag: dict, client, x):
    r = daskdag.compute_grads(dag, x, "head", client=client)
    return r.value, r.grad


def branch_share(wait: float, i: int, x):
    """One branch's share of the head: its value and gradient."""
    return jax.value_and_grad(lambda x: jnp.sum(branch(wait, i, x)))(x)


def add_shares(*shares):
    return sum(s[0] for s in shares), sum(s[1] for s in shares)


def wide_hand_written(n: int, wait: float, client, x):
    shares = [dask.delayed(branch_share, pure=True)(wait, i, x) for i in range(n)]
    (out,) = dask.compute(dask.delayed(add_shares, pure=True)(*shares), scheduler=client)
    return out


def branch_tasks(data: list[dict], branches: Callable[[str], int],
                 windows: list[tuple[float, float]], workers: list[str], ideal: float) -> dict:
    """Where and when the branch tasks of each timed call ran: ``data`` the task stream
    (``distributed.get_task_stream``), ``branches(key)`` how many branches the task of ``key``
    runs (0: not a branch task), ``windows`` each call's (start, end) in ``time.time()``,
    ``workers`` the cluster's addresses in the order to report, ``ideal`` the branches per
    worker of an even spread.

    Out, ``ideal_per_worker`` and ``calls``, one entry per call: ``per_worker`` (branches run on each worker), ``busiest`` and
    ``idle_workers``, and the call's timeline: ``before_first_s`` (from the call's start to the
    first branch task's start: building, sending, scheduling), ``branches_s`` (first branch
    start to last branch end) and ``after_last_s`` (last branch end to the call's end: the
    rest of the graph and the results' way back)."""
    calls = [{"counts": Counter(), "starts": [], "stops": []} for _ in windows]
    outside = 0
    for task in data:
        found = branches(str(task.get("key")))
        if not found:
            continue
        compute = [s for s in task.get("startstops", ()) if s.get("action") == "compute"]
        start = compute[0]["start"] if compute else None
        k = next((k for k, (a, b) in enumerate(windows) if start is not None and a <= start <= b),
                 None)
        if k is None:
            outside += found
            continue
        calls[k]["counts"][task.get("worker")] += found
        calls[k]["starts"].append(start)
        calls[k]["stops"].append(compute[0]["stop"])
    out = []
    for (a, b), call in zip(windows, calls):
        counts = [call["counts"].get(w, 0) for w in workers]
        entry = {"per_worker": counts, "busiest": max(counts), "idle_workers": counts.count(0)}
        if call["starts"]:
            first, last = min(call["starts"]), max(call["stops"])
            entry.update(before_first_s=first - a, branches_s=last - first, after_last_s=b - last)
        out.append(entry)
    result = {"ideal_per_worker": ideal, "calls": out}
    if outside:
        result["outside_calls"] = outside
    if not any(sum(c["per_worker"]) for c in out):
        result["note"] = "no branch task found in the task stream (has the key format changed?)"
    return result


def daskdag_forwards(names: list[str]) -> Callable[[str], int]:
    """How many of the nodes ``names`` a daskdag task key runs forward: the key contains
    ``fwd`` and, as whole words, the nodes' names (a fused key may name several)."""
    name = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, names))
                      + r")(?![A-Za-z0-9_])")
    return lambda key: len(name.findall(key)) if "fwd" in key else 0


def hand_written_branches(key: str) -> int:
    return int(branch_share.__name__ in key)


def wide(cfg: Config, w: int, client) -> dict:
    n, wait = cfg.branches_per_worker * w, cfg.wide_wait_s
    label = f"wide W={w}: "
    print(f"{TITLE}, {label}", flush=True)
    dag = wide_dag(n, wait)
    x = jnp.linspace(0.01, 0.02, cfg.width, dtype=jnp.float32)  # every sin(x * (i + 1)) > 0
    runs = {"daskdag": Fresh(partial(wide_daskdag, dag, client), x),
            "hand_written": Fresh(partial(wide_hand_written, n, wait, client), x)}
    got, ref = runs["daskdag"](), runs["hand_written"]()  # warm-up, checked
    for g, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=RTOL)
    for r in runs.values():
        r.windows.clear()
    with distributed.get_task_stream(client) as stream:
        times = common.interleaved(runs, cfg.reps, label)
    ideal = n * wait / w
    c = _efficiency(common.case(f"wide, W={w}", {"W": w, "branches": n, "wait_s": wait}, times,
                                {"daskdag/hand_written": ("daskdag", "hand_written")}), ideal)
    addresses = common.workers(client)
    c["branch_tasks"] = {
        "daskdag": branch_tasks(stream.data, daskdag_forwards([f"S{i}" for i in range(n)]),
                                runs["daskdag"].windows, addresses, cfg.branches_per_worker),
        "hand_written": branch_tasks(stream.data, hand_written_branches,
                                     runs["hand_written"].windows, addresses,
                                     cfg.branches_per_worker)}
    c["max_rel_diff"] = common.worst_difference(got, ref)
    return c


# --- sweeps: 100W items that wait ---------------------------------------------------------------

def wait_then_tanh(wait: float, x, w):
    time.sleep(wait)
    return jnp.tanh(x * w)


def sum_of_squares(h):
    return jnp.sum(h ** 2)


def item_loss(wait: float, x, w):
    return sum_of_squares(wait_then_tanh(wait, x, w))


def sweep_dag(wait: float) -> dict:
    return {"h": (partial(wait_then_tanh, wait), ["x", "w"]), "loss": (sum_of_squares, ["h"])}


def default_chunk_size(items: int, threads: int) -> int:
    """daskdag's default chunk size for item-by-item nodes, as its docs state it."""
    return max(1, min(256, math.ceil(items / (4 * threads))))


def sweep_daskdag(dag: dict, w, client, xs):
    r = daskdag.sweep_grads(dag, {"x": xs, "w": w}, "loss", batched=["x"], client=client)
    grad = r.grad["x"] if isinstance(r.grad, dict) else r.grad
    return np.asarray(r.value), np.asarray(grad)


def chunk_grads(wait: float, xs, w):
    """Each item's loss and gradient with respect to its x, stacked."""
    f = jax.value_and_grad(partial(item_loss, wait))
    values, grads = zip(*(f(x, w) for x in xs))
    return np.stack(values), np.stack(grads)


def sweep_delayed(wait: float, w, chunk: int, client, xs):
    xs = np.asarray(xs)
    parts = [dask.delayed(chunk_grads, pure=True)(wait, xs[i:i + chunk], w)
             for i in range(0, len(xs), chunk)]
    done = dask.compute(*parts, scheduler=client)
    return np.concatenate([v for v, _ in done]), np.concatenate([g for _, g in done])


def cpu_per_item(xs, w, items: int = 50) -> float:
    """Seconds per item of ``chunk_grads``' own work (no waiting), in this process: the best of
    two timings after a warm-up."""
    chunk_grads(0.0, xs[:2], w)
    best = math.inf
    for _ in range(2):
        t = time.perf_counter()
        chunk_grads(0.0, xs[:items], w)
        best = min(best, time.perf_counter() - t)
    return best / items


def sweeps(cfg: Config, w: int, client) -> dict:
    n, wait = cfg.items_per_worker * w, cfg.item_wait_s
    label = f"sweeps W={w}: "
    print(f"{TITLE}, {label}", flush=True)
    threads = sum(info.get("nthreads", 1) for info in common.live_workers(client).values())
    chunk = default_chunk_size(n, threads)
    rng = np.random.default_rng(w)
    xs = rng.uniform(0.1, 1.0, (n, cfg.width)).astype(np.float32)
    wv = jnp.asarray(rng.uniform(0.5, 1.5, cfg.width).astype(np.float32))
    runs = {"daskdag": Fresh(partial(sweep_daskdag, sweep_dag(wait), wv, client), xs),
            "delayed": Fresh(partial(sweep_delayed, wait, wv, chunk, client), xs)}
    got, ref = runs["daskdag"](), runs["delayed"]()  # warm-up, checked
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=RTOL)
    times = common.interleaved(runs, cfg.reps, label)
    c = _efficiency(common.case(f"sweeps, W={w}", {"W": w, "items": n, "wait_s": wait,
                                                   "chunk_size": chunk, "threads": threads},
                                times, {"daskdag/delayed": ("daskdag", "delayed")}),
                    n * wait / w)
    c["max_rel_diff"] = common.worst_difference(got, ref)
    per_item = cpu_per_item(xs, wv)
    c["cpu_s_per_item"] = per_item
    c["cpu_floor_s"] = n * per_item / (os.cpu_count() or 1)
    return c


def _efficiency(c: dict, ideal: float) -> dict:
    """``c`` with ``ideal_s`` and, per method, ``efficiency`` = ideal / median, also as the
    ratio ``efficiency_<method>``."""
    c["ideal_s"] = ideal
    for m, record in c["methods"].items():
        record["efficiency"] = ideal / record["median_s"]
        c["ratios"][f"efficiency_{m}"] = record["efficiency"]
    return c


# --- The scenario ------------------------------------------------------------------------------

def wanted(workers: tuple[int, ...]) -> list[dict]:
    out = []
    for w in workers:
        out += [{"case": f"wide, W={w}", "ratio": "efficiency_daskdag", "op": ">=", "bound": 0.85,
                 "source": "issue 21"},
                {"case": f"wide, W={w}", "ratio": "daskdag/hand_written", "op": "<=",
                 "bound": 1.0, "source": "issue 21"},
                {"case": f"sweeps, W={w}", "ratio": "daskdag/delayed", "op": "<=", "bound": 1.0,
                 "source": "issue 21"}]
    return out


def run(quick: bool, clients: dict) -> dict:
    """``clients`` (the runner's clusters) are not used: each W gets a cluster of its own."""
    cfg = QUICK if quick else FULL
    cases, started = [], {}
    for w in cfg.workers:
        t = time.perf_counter()
        print(f"{TITLE}: starting {w} workers", flush=True)
        with cluster(w, cfg.start_timeout_s) as client:
            started[w] = time.perf_counter() - t
            for c in (wide(cfg, w, client), sweeps(cfg, w, client)):
                c["cluster"] = kind(w)
                cases.append(c)
    return {"title": TITLE, "config": asdict(cfg), "cases": cases,
            "cluster_start_s": {str(w): s for w, s in started.items()},
            "where": {m: WHERE for m in ("daskdag", "hand_written", "delayed")},
            "targets": common.targets(cases, wanted(cfg.workers))}
