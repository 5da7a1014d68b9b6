"""Scenario: memory-bounded backward passes, ``Node(remat=True)`` against keeping residuals.

    x -> n0 -> n1 -> ... -> n15 -> loss,   n_i(h) = tanh(h[:, None] @ v[None, :]) @ u + h

``h`` float32[1000], ``v`` and ``u`` float32[25000] closed over: each node's output is 4 KB,
but JAX's vjp of it keeps two float32[1000, 25000] arrays (tanh's output and 1 - it), 200 MB of
residuals per node, 3.2 GB for the chain. ``compute_grads`` of ``loss`` with respect to ``x`` on
process ``LocalCluster`` s of 2 single-threaded workers, which the scenario starts itself:

remat_limited:          every node ``remat=True``, workers with ``memory_limit="1.5GB"``: each
                        backward task redoes its node's forward pass, so no residual outlives
                        the task that made it.
remat_unlimited:        the same, workers without a memory limit: what remat costs in time.
plain_unlimited:        no remat (the chain runs as one task under one ``jax.vjp``, daskdag's
                        default), workers without a memory limit: the baseline.
plain_unfused_limited:  no remat, every node a task (``daskdag.fuse-chains`` false), so that
                        Dask can spill each node's residuals (their sizes are reported to it
                        exactly), on the 1.5 GB workers: completes or not, as recorded.
plain_limited:          no remat, daskdag's default (one task holding all 3.2 GB), on the
                        1.5 GB workers: expected to fail (the nanny kills the worker).

Each run records the peak RSS of each worker process, sampled every 20 ms (psutil), and its
wall time; the gradient is checked against ``jax.grad`` of the composed chain with every node
under ``jax.checkpoint``. The limited cluster lets a task kill at most one worker
(``distributed.scheduler.allowed-failures`` 0) so a failing method fails in seconds.

Targets: remat completes on the limited workers with every worker's peak RSS below the limit
(``peak_rss/memory_limit`` < 1), and takes at most 2.5x the unlimited run without remat (remat
costs one more forward pass of each node: about 1.35x, measured node by node here).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from functools import partial

import dask
import distributed
import jax
import jax.numpy as jnp
import numpy as np
import psutil

import daskdag

from .. import common

TITLE = "Memory-bounded backward passes: remat on workers of 1.5 GB"
DESCRIPTION = ("a 16-node chain with 200 MB of residuals per node on 2 workers of 1.5 GB: "
               "``Node(remat=True)`` against spilling and an unlimited run; peak worker "
               "memory and time")
CLUSTERS = None  # starts its own clusters of 2 workers
RTOL = 1e-4


@dataclass(frozen=True)
class Config:
    nodes: int
    rows: int
    width: int
    memory_limit: str
    reps: int
    timeout_s: float


FULL = Config(nodes=16, rows=1000, width=25000, memory_limit="1.5GB", reps=2, timeout_s=120)
QUICK = Config(nodes=16, rows=1000, width=25000, memory_limit="1.5GB", reps=1, timeout_s=90)

TARGETS = [
    {"case": "chain", "ratio": "peak_rss_remat_limited/memory_limit", "op": "<=", "bound": 1.0,
     "source": "issue 23 item 4: completes on 1.5 GB workers"},
    {"case": "chain", "ratio": "remat_limited/plain_unlimited", "op": "<=", "bound": 2.5,
     "source": "issue 23 item 4: one more forward pass per node"},
]


def layer(h, v, u):
    return jnp.tanh(h[:, None] @ v[None, :]) @ u + h


def chain_dag(cfg: Config, remat: bool) -> tuple[dict, list]:
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal(cfg.width, np.float32) / np.float32(50),
                rng.standard_normal(cfg.width, np.float32) / np.float32(cfg.width))
               for _ in range(cfg.nodes)]
    dag, prev = {}, "x"
    for i, (v, u) in enumerate(weights):
        dag[f"n{i}"] = daskdag.Node(partial(layer, v=v, u=u), [prev], remat=remat)
        prev = f"n{i}"
    dag["loss"] = (lambda h: jnp.sum(h * h), [prev])
    return dag, weights


def reference(weights, x):
    """``jax.grad`` of the composed chain, each node under ``jax.checkpoint`` (so that this
    process does not hold 3.2 GB of residuals either)."""
    def composed(h):
        for v, u in weights:
            h = jax.checkpoint(partial(layer, v=jnp.asarray(v), u=jnp.asarray(u)))(h)
        return jnp.sum(h * h)
    return jax.grad(composed)(x)


class PeakRSS:
    """The largest RSS of each of the cluster's worker processes while the block runs."""

    def __init__(self, client):
        self.pids = client.run(os.getpid)
        self.peak = {addr: 0 for addr in self.pids}
        self._stop = threading.Event()

    def _sample(self):
        procs = {a: psutil.Process(p) for a, p in self.pids.items()}
        while not self._stop.is_set():
            for a, proc in procs.items():
                try:
                    self.peak[a] = max(self.peak[a], proc.memory_info().rss)
                except psutil.Error:  # (a worker killed)
                    pass
            self._stop.wait(0.02)

    def __enter__(self):
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def attempt(client, dag, x, timeout_s: float, fuse: bool = True) -> dict:
    """One ``compute_grads`` on ``client``'s cluster: its time, each worker's peak RSS, and the
    gradient, or what went wrong."""
    with dask.config.set({"daskdag.fuse-chains": fuse}):
        call = daskdag.grads(dag, x, "loss")
    with PeakRSS(client) as rss:
        start = time.perf_counter()
        future = client.compute(call)
        try:
            result = future.result(timeout=timeout_s)
            grad, error = result.grad, None
        except Exception as e:  # (KilledWorker, a timeout)
            grad, error = None, f"{type(e).__name__}: {str(e).split('. ')[0][:200]}"
        finally:
            future.cancel()
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_rss": max(rss.peak.values()), "peak_rss_per_worker":
            list(rss.peak.values()), "grad": grad, "error": error}


def limited_cluster(memory_limit):
    # (a task that kills a worker is not retried: a failing method fails in seconds)
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        return distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                        memory_limit=memory_limit, dashboard_address=":0")


def run(quick: bool, clients: dict) -> dict:
    cfg = QUICK if quick else FULL
    limit = dask.utils.parse_bytes(cfg.memory_limit)
    x = jnp.linspace(-1.0, 1.0, cfg.rows)
    dags = {remat: chain_dag(cfg, remat)[0] for remat in (True, False)}
    want = reference(chain_dag(cfg, True)[1], x)
    print(f"{TITLE}: {cfg.nodes} nodes, residuals "
          f"{common_bytes(2 * cfg.rows * cfg.width * 4)} each", flush=True)
    runs: dict[str, list[dict]] = {}
    with limited_cluster(cfg.memory_limit) as limited_c, \
            distributed.Client(limited_c, set_as_default=False) as limited, \
            distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                     memory_limit=0, dashboard_address=":0") as free_c, \
            distributed.Client(free_c, set_as_default=False) as free:
        limited.wait_for_workers(2, timeout=120)
        free.wait_for_workers(2, timeout=120)
        methods = {"remat_limited": (limited, True, True), "remat_unlimited": (free, True, True),
                   "plain_unlimited": (free, False, True)}
        for name, (client, remat, fuse) in methods.items():  # once first (compiles), checked
            out = attempt(client, dags[remat], x, cfg.timeout_s, fuse)
            _check(name, out, want)
        names = list(methods)
        for rep in range(cfg.reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                client, remat, fuse = methods[name]
                out = attempt(client, dags[remat], x, cfg.timeout_s, fuse)
                _check(name, out, want)
                runs.setdefault(name, []).append(out)
            print(f"  rep {rep + 1}/{cfg.reps}: " + ", ".join(
                f"{n} {runs[n][-1]['seconds']:.1f} s, peak {common_bytes(runs[n][-1]['peak_rss'])}"
                for n in names), flush=True)
        # Without remat on the limited workers: by spilling (a task per node), then daskdag's
        # default (one task); last, as they may kill workers.
        for name, fuse in (("plain_unfused_limited", False), ("plain_limited", True)):
            out = attempt(limited, dags[False], x, cfg.timeout_s, fuse)
            if out["error"] is None:
                out["worst_relative"] = common.worst_difference(out["grad"], want)
            runs[name] = [out]
            print(f"  {name}: " + (f"completed in {out['seconds']:.1f} s" if out["error"] is None
                                   else f"failed after {out['seconds']:.1f} s: {out['error']}")
                  + f", peak {common_bytes(out['peak_rss'])}", flush=True)
    done = {n: rs for n, rs in runs.items() if all(r["error"] is None for r in rs)}
    times = {n: [r["seconds"] for r in rs] for n, rs in done.items()}
    c = common.case("chain", {"nodes": cfg.nodes, "residual_bytes_per_node":
                              2 * cfg.rows * cfg.width * 4, "memory_limit": limit}, times,
                    {"remat_limited/plain_unlimited": ("remat_limited", "plain_unlimited"),
                     "remat_unlimited/plain_unlimited": ("remat_unlimited", "plain_unlimited"),
                     "plain_unfused_limited/plain_unlimited": ("plain_unfused_limited",
                                                               "plain_unlimited")},
                    outcomes={n: ("completed" if all(r["error"] is None for r in rs)
                                  else next(r["error"] for r in rs if r["error"]))
                              for n, rs in runs.items()},
                    peak_rss={n: max(r["peak_rss"] for r in rs) for n, rs in runs.items()},
                    worst_relative={n: rs[-1].get("worst_relative") for n, rs in runs.items()})
    for n in ("remat_limited", "plain_unfused_limited"):
        if n in done:
            c["ratios"][f"peak_rss_{n}/memory_limit"] = c["peak_rss"][n] / limit
    return {"title": TITLE, "config": {**asdict(cfg), "rtol": RTOL},
            "description": (
                f"Median seconds of {cfg.reps} runs of the gradient of a {cfg.nodes}-node chain "
                f"whose nodes keep {common_bytes(2 * cfg.rows * cfg.width * 4)} of residuals each, "
                f"on process LocalClusters of 2 single-threaded workers, `memory_limit="
                f"\"{cfg.memory_limit}\"` (`_limited`) or none (`_unlimited`). Peak worker RSS: "
                + ", ".join(f"{n} {common_bytes(v)}" for n, v in c["peak_rss"].items())
                + ". Outcomes: " + ", ".join(f"{n}: {o}" for n, o in c["outcomes"].items())
                + "."),
            "where": {n: f"its own 2-worker LocalCluster ({'memory_limit=' + cfg.memory_limit if 'limited' in n and 'unlimited' not in n else 'no memory limit'})"
                      for n in runs},
            "targets": common.targets([c], TARGETS), "cases": [c]}


def _check(name: str, out: dict, want) -> None:
    if out["error"] is not None:
        raise AssertionError(f"{TITLE}: {name} failed: {out['error']}")
    out["worst_relative"] = common.worst_difference(out["grad"], want)
    if out["worst_relative"] > RTOL:
        raise AssertionError(f"{TITLE}: {name} disagrees with jax.grad: {out['worst_relative']}")


def common_bytes(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    result = run(parser.parse_args().quick, {})
    print(json.dumps({k: result["cases"][0][k] for k in ("ratios", "outcomes", "peak_rss")},
                     indent=1, default=float))
    print(json.dumps(result["targets"], indent=1, default=float))
