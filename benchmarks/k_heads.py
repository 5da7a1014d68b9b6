"""K scalar heads over one expensive shared trunk: values and gradients four ways.

    x -> t0 -> t1 -> ... -> t_mid -> ... -> t_last
                              \\________________\\____> head_k(t_mid, t_last),  k = 0..K-1

Each trunk node is ``tanh(h @ W_i)`` on a ``width x width`` float32 matrix; each head is a cheap,
different scalar of the middle and last trunk nodes. We want all K values and all K gradients
with respect to ``x``, computed four ways, eagerly (no ``jax.jit``):

1. naive:          ``jax.value_and_grad`` of each composed head: the trunk's forward and
                   backward pass run K times.
2. hand_written:   ``jax.vjp`` of the trunk once, ``jax.vjp`` of each head on its output, then K
                   trunk pullbacks: the VJP plumbing daskdag exists to spare its users.
3. compute_grads:  ``daskdag.compute_grads(dag, x, heads)`` on Dask's default threaded scheduler.
4. cluster:        the same call with ``client=`` a 2-worker process ``LocalCluster``
                   (one thread and one XLA thread per worker, each pinned to its own core;
                   ``--unpinned-workers``: XLA threads on every core; see ``common.py``),
                   started once before any timing.

Methods 2 and 3 do the same JAX work (one trunk forward, K trunk backwards), so their ratio is
daskdag's overhead, which should stay within 10 %; naive / compute_grads is what it saves over
the obvious code. cluster / hand_written and cluster / compute_grads (the threaded run) are what
going to worker processes costs on this machine: each call ships the task graph, whose trunk
functions close over their weight matrices, so every call pickles and sends all the weights
(their pickled size is recorded), pullbacks that Dask moves between the workers travel with their
residuals, and the K gradients come back to the client. Each method's first run is its warm-up,
and its values and gradients are checked against naive's (exit 1, before any timing, if they
disagree); then the methods are timed round-robin, each repetition starting at the next method,
and compared by median. The trunk's plain forward pass is timed too, to show the scale of the
work.

Run: ``python benchmarks/k_heads.py [--quick] [--unpinned-workers] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np

import common
import daskdag
from daskdag import programs

TARGET = 1.10  # compute_grads / hand_written must not exceed this
RTOL = 1e-4  # agreement with naive, relative to each result's largest entry


@dataclass(frozen=True)
class Config:
    heads: int  # K
    width: int  # x and every trunk node are width x width float32 matrices
    depth: int  # trunk nodes
    reps: int  # timed repetitions per method, after one warm-up

    @property
    def mid(self) -> int:
        """Index of the trunk node that the heads read besides the last one."""
        return self.depth // 2


FULL = Config(heads=8, width=2048, depth=8, reps=3)
QUICK = Config(heads=8, width=1024, depth=6, reps=3)


# --- The model: trunk layers and heads, shared by all the methods ----------------------------

def layer(w, h):
    return jnp.tanh(h @ w)


def head(v, c, mid, last):
    return jnp.mean(v * jnp.tanh(last)) + c * jnp.mean(mid * last)


@dataclass(frozen=True)
class Model:
    layers: tuple[Callable, ...]  # trunk node i: h -> h
    heads: tuple[Callable, ...]  # head k: (mid, last) -> scalar
    mid: int


def make_model(cfg: Config, seed: int = 0) -> Model:
    rng = np.random.default_rng(seed)
    n = cfg.width
    layers = tuple(partial(layer, jnp.asarray(rng.standard_normal((n, n), np.float32) / np.sqrt(n)))
                   for _ in range(cfg.depth))
    heads = tuple(partial(head, jnp.asarray(rng.standard_normal(n, np.float32)), float(c))
                  for c in rng.uniform(-1, 1, cfg.heads))
    return Model(layers, heads, cfg.mid)


def trunk(model: Model, x):
    """``(mid, last)``: the two trunk nodes the heads read."""
    h = x
    for i, f in enumerate(model.layers):
        h = f(h)
        if i == model.mid:
            mid = h
    return mid, h


def to_dag(model: Model) -> tuple[dict, list[str]]:
    """The model as a daskdag DAG over free input ``x``, and its head names."""
    names = [f"t{i}" for i in range(len(model.layers))]
    dag = {name: (f, [prev]) for name, f, prev in zip(names, model.layers, ["x"] + names)}
    heads = [f"head{k}" for k in range(len(model.heads))]
    dag.update({h: (f, [names[model.mid], names[-1]]) for h, f in zip(heads, model.heads)})
    return dag, heads


# --- The methods: each returns [(value_k, grad_k)] --------------------------------------------

def naive(model: Model, x):
    def composed(f):
        return lambda x: f(*trunk(model, x))

    return [jax.value_and_grad(composed(f))(x) for f in model.heads]


def hand_written(model: Model, x):
    (mid, last), trunk_pullback = jax.vjp(partial(trunk, model), x)
    results = []
    for f in model.heads:
        value, head_pullback = jax.vjp(f, mid, last)
        (grad,) = trunk_pullback(head_pullback(jnp.ones_like(value)))
        results.append((value, grad))
    return results


def with_compute_grads(model: Model, x, client=None):
    dag, heads = to_dag(model)
    res = daskdag.compute_grads(dag, x, heads, client=client)
    return [(res[h].value, res[h].grad) for h in heads]


def methods(client) -> dict[str, Callable]:
    """The four methods; ``cluster`` runs on ``client``, ``compute_grads`` on Dask's threads."""
    return {"naive": naive, "hand_written": hand_written, "compute_grads": with_compute_grads,
            "cluster": partial(with_compute_grads, client=client)}


# --- Measuring -----------------------------------------------------------------------------

def timed(method, model, x) -> tuple[float, list]:
    start = time.perf_counter()
    out = jax.block_until_ready(method(model, x))  # eager JAX dispatches asynchronously
    return time.perf_counter() - start, out


def worst_difference(got: list, ref: list) -> float:
    """Largest |got - ref| over all values and gradients, relative to that result's scale."""
    return max(float(np.max(np.abs(np.asarray(g) - np.asarray(r))) / max(np.max(np.abs(r)), 1e-30))
               for pair_got, pair_ref in zip(got, ref) for g, r in zip(pair_got, pair_ref))


def check(runs: dict, model: Model, x) -> dict[str, float]:
    """Run each method once (the warm-up); each one's worst relative difference to naive."""
    out = {name: timed(method, model, x)[1] for name, method in runs.items()}
    return {name: worst_difference(got, out["naive"]) for name, got in out.items()}


def time_trunk(model: Model, x, reps: int) -> float:
    """Median seconds of one plain (non-differentiated) trunk forward pass."""
    return statistics.median(timed(trunk, model, x)[0] for _ in range(reps))


def time_methods(runs: dict, model: Model, x, reps: int) -> dict[str, list[float]]:
    """Seconds per run, round-robin, each repetition starting at the next method."""
    times = {name: [] for name in runs}
    names = list(runs)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            times[name].append(timed(runs[name], model, x)[0])
            print(f"  rep {rep + 1}/{reps}  {name:<14} {times[name][-1]:7.3f} s", flush=True)
    return times


def shipped_per_call(model: Model, x) -> dict:
    """What every cluster call pickles into its task graph: the node functions (the trunk's carry
    their weights) and the input; and how long pickling them takes here."""
    dag, _ = to_dag(model)
    start = time.perf_counter()
    functions = len(cloudpickle.dumps([fn for fn, _ in dag.values()]))
    pickle_s = time.perf_counter() - start
    return {"node_functions_pickled_bytes": functions, "x_bytes": int(x.nbytes),
            "pickle_node_functions_s": pickle_s}


def cluster_traffic(client, calls: int) -> dict:
    """Per cluster call: pullbacks and other values fetched from the other worker, and their bytes
    (Dask's size estimates); and the backward programs the workers compiled or found cached."""
    logs = client.run(lambda dask_worker: list(dask_worker.transfer_incoming_log))
    moved = [(key, nbytes) for log in logs.values() for entry in log
             for key, nbytes in entry["keys"].items()]
    pullbacks = [nbytes for key, nbytes in moved if key.startswith("pb-")]
    others = [nbytes for key, nbytes in moved if not key.startswith("pb-")]
    stats = client.run(programs.stats)
    return {"calls": calls,
            "pullbacks_moved_per_call": len(pullbacks) / calls,
            "pullback_bytes_moved_per_call": sum(pullbacks) / calls,
            "other_values_moved_per_call": len(others) / calls,
            "other_bytes_moved_per_call": sum(others) / calls,
            "programs_compiled": sum(s["compiled"] for s in stats.values()),
            "program_cache_hits": sum(s["cache_hits"] for s in stats.values())}


def report(medians: dict) -> dict[str, float]:
    """Print the medians and the ratios; return the ratios."""
    ratios = {"compute_grads/hand_written": medians["compute_grads"] / medians["hand_written"],
              "naive/compute_grads": medians["naive"] / medians["compute_grads"],
              "cluster/hand_written": medians["cluster"] / medians["hand_written"],
              "cluster/compute_grads": medians["cluster"] / medians["compute_grads"]}
    print(f"\n{'method':<14} {'median s':>9}")
    for name, median in medians.items():
        print(f"{name:<14} {median:9.3f}")
    overhead = ratios["compute_grads/hand_written"]
    print(f"\ncompute_grads / hand_written = {overhead:.3f}  (target <= {TARGET:.2f}: "
          f"{'met' if overhead <= TARGET else 'NOT met'})")
    print(f"naive / compute_grads        = {ratios['naive/compute_grads']:.2f}")
    print(f"cluster / hand_written       = {ratios['cluster/hand_written']:.2f}")
    print(f"cluster / compute_grads      = {ratios['cluster/compute_grads']:.2f}  "
          f"(compute_grads: Dask's threaded scheduler)")
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller trunk (a smoke run)")
    parser.add_argument("--unpinned-workers", action="store_true",
                        help="let each worker's XLA use every core instead of one")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "k_heads.json")
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    info = common.machine()
    print(f"K={cfg.heads} heads, trunk of {cfg.depth} nodes on {cfg.width}x{cfg.width} float32, "
          f"{cfg.reps} reps, {info['cpu_count']} CPUs")

    model = make_model(cfg)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((cfg.width, cfg.width), np.float32))
    shipped = shipped_per_call(model, x)
    print(f"each cluster call pickles {shipped['node_functions_pickled_bytes'] / 2**20:.1f} MiB of "
          f"node functions ({shipped['pickle_node_functions_s']:.3f} s here) and a "
          f"{shipped['x_bytes'] / 2**20:.1f} MiB input into its task graph")
    pin = not args.unpinned_workers
    with common.cluster(pin=pin) as client:
        cluster_info = common.describe(client, pin)
        print(f"cluster: {cluster_info['kind']}; XLA threads per worker: "
              f"{cluster_info['xla_threads_per_worker']}")
        runs = methods(client)
        diffs = check(runs, model, x)
        print("max |diff| vs naive, relative to each result's largest entry: "
              + ", ".join(f"{name} {d:.1e}" for name, d in diffs.items()))
        failed = {name: d for name, d in diffs.items() if d > RTOL}
        if failed:
            print(f"DISAGREEMENT with naive beyond {RTOL}: {failed}; not timing", file=sys.stderr)
            return 1
        trunk_s = time_trunk(model, x, cfg.reps)
        print(f"trunk forward alone: {trunk_s:.3f} s")
        times = time_methods(runs, model, x, cfg.reps)
        traffic = cluster_traffic(client, calls=cfg.reps + 1)
    print(f"per cluster call: {traffic['pullbacks_moved_per_call']:.1f} pullbacks moved between "
          f"workers ({traffic['pullback_bytes_moved_per_call'] / 2**20:.1f} MiB), "
          f"{traffic['other_values_moved_per_call']:.1f} other values "
          f"({traffic['other_bytes_moved_per_call'] / 2**20:.1f} MiB); backward programs compiled "
          f"{traffic['programs_compiled']}, cache hits {traffic['program_cache_hits']}")
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    ratios = report(medians)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "k_heads",
        "machine": info,
        "config": {**asdict(cfg), "mid": cfg.mid, "quick": args.quick, "jit": False,
                   "scheduler": {"compute_grads": "dask threaded (default)",
                                 "cluster": cluster_info}},
        "trunk_forward_median_s": trunk_s,
        "methods": {name: {"times_s": times[name], "median_s": medians[name],
                           "max_rel_diff_vs_naive": diffs[name]} for name in times},
        "ratios": ratios,
        "cluster_shipped_per_call": shipped,
        "cluster_traffic": traffic,
        "target": TARGET,
        "target_met": ratios["compute_grads/hand_written"] <= TARGET,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
