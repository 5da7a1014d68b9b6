"""Sweeps: one DAG's values and gradients over N items, in a Python loop and with sweep_grads.

The DAG, per item (``x`` an item's float32[rows, width], ``w`` a float32[width, width] weight
shared by all items), two scalar outputs, gradients with respect to ``x``::

    h1 = tanh(x @ w)
    h2 = tanh(h1 @ w)  if mean(h1) > 0  else  tanh(h1 @ w.T)     (Python control flow on values)
    h3 = tanh(h2 @ w) * h1
    energy  = mean(h3 ** 2)
    overlap = mean(h2 * h1)

Every node runs eagerly, a few milliseconds per item forward and backward, mostly JAX's
per-operation dispatch. ``h2`` branches on its value, so this DAG can be neither jitted nor
vmapped: it runs item by item. The methods, each returning values and gradients stacked over
the items as NumPy arrays:

1. loop:           for each item, ``jax.vjp`` of each node, chained by hand, and both outputs'
                   cotangents pulled back through those pullbacks: the code daskdag spares its
                   users, run sequentially in this process. The baseline.
2. sweep_1w:       ``daskdag.sweep_grads(..., client=)`` on a 1-worker process LocalCluster.
3. sweep_2w:       the same on a 2-worker LocalCluster. Both come from ``common.cluster``: one
                   thread per worker, each worker pinned to its own core.
4. sweep_threads:  ``sweep_grads`` without a client: Dask's local threads, in this process.

And on the jittable variant of the DAG, where ``h2 = tanh(h1 @ w)`` always (the same work per
item as either branch):

5. jit_vmap:       ``jax.jit(jax.vmap(jax.value_and_grad(composed)))`` for both outputs in one
                   jitted function, all items at once, in this process: the single-process limit.
6. sweep_vmap_2w:  ``sweep_grads`` on the 2-worker cluster with every node
                   ``Node(..., vmap=True)``: each node runs once per chunk, vectorized.

Every sweep uses the same explicit chunk size, N / 8 (``--chunk-size`` to change it): the
default of ``sweep_grads`` on the 2-worker cluster (four chunks per worker), so the 1-worker and
2-worker sweeps run the same chunk graphs and their ratio is the second worker's speedup alone.
(The default on one worker would be chunks twice as large, whose backward pass costs more per
item.)

Before timing, each method runs once (its warm-up), and its values and gradients are checked
with ``np.allclose`` against the loop over the same DAG; exit 1 if any disagree. Then the
methods are timed round-robin, each repetition starting at the next method, and compared by
median. Targets: sweep_1w / sweep_2w >= 1.7 (the second worker's speedup) and loop / sweep_2w
>= 1.6 (what a user gains over the loop on this 2-core machine).

Workers start without ``MALLOC_TRIM_THRESHOLD_``, which distributed's nanny sets to 65536 by
default (``distributed.nanny.pre-spawn-environ``). Setting it turns off glibc's adaptive mmap
threshold, so large temporaries are mmapped and faulted in afresh: a 32-item chunk of this DAG
took 1.8 times as long in a worker with it as without it, and in one process 7.6 times the page
faults (``--distributed-malloc-trim`` keeps it, to see).

Both clusters are started once, before any timing, and are up together, so two workers are
pinned to core 0, one of them idle at any time. ``--separate-phases`` instead runs the 1-worker
and the 2-worker cluster's methods in two phases, each with only its cluster up and its own loop
baseline, to check that the idle cluster costs nothing. It did not, beyond the noise: sweeps
on either cluster took 3-4 % longer with the other one up, while the loop drifted by up to 50 %
between two phases of one run, so together, sharing the loop baseline, is the default.

Where the time goes is recorded too: each method's CPU seconds in this process (the client, and
the clusters' schedulers, which LocalCluster runs here), and for the cluster sweeps one more run
under ``distributed``'s task stream: the workers' busy time per task kind, and what moved
between workers.

Run: ``python benchmarks/sweeps.py [--quick] [--chunk-size K] [--separate-phases]
[--distributed-malloc-trim] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import dask
import distributed
import jax
import jax.numpy as jnp
import numpy as np

import common
import daskdag
from daskdag import programs

TARGETS = {"sweep_1w/sweep_2w": 1.7, "loop/sweep_2w": 1.6}
RTOL = 1e-4  # np.allclose(rtol=RTOL, atol=RTOL * largest |entry| of the loop's result)
OUTPUTS = ("energy", "overlap")


@dataclass(frozen=True)
class Config:
    items: int  # N
    rows: int  # an item x is float32[rows, width]
    width: int  # w is float32[width, width]
    reps: int  # timed repetitions per method, after one warm-up
    chunk_size: int  # items per chunk, in every sweep


FULL = Config(items=256, rows=32, width=256, reps=7, chunk_size=32)
QUICK = Config(items=64, rows=32, width=256, reps=3, chunk_size=8)


# --- The DAG ---------------------------------------------------------------------------------

def layer(h, w):
    return jnp.tanh(h @ w)


def gate(h, w):
    if jnp.mean(h) > 0:  # a Python branch on a value: no jit, no vmap
        return jnp.tanh(h @ w)
    return jnp.tanh(h @ w.T)


def mix(h2, h1, w):
    return jnp.tanh(h2 @ w) * h1


def energy(h3):
    return jnp.mean(h3 ** 2)


def overlap(h2, h1):
    return jnp.mean(h2 * h1)


def make_dag(jittable: bool = False, vmap: bool = False) -> dict:
    """The DAG; ``jittable``: ``h2`` without the branch; ``vmap``: every node vectorized."""
    nodes = {"h1": (layer, ["x", "w"]), "h2": (layer if jittable else gate, ["h1", "w"]),
             "h3": (mix, ["h2", "h1", "w"]), "energy": (energy, ["h3"]),
             "overlap": (overlap, ["h2", "h1"])}
    return {name: daskdag.Node(fn, deps, vmap=vmap) for name, (fn, deps) in nodes.items()}


def make_inputs(cfg: Config, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((cfg.width, cfg.width), np.float32) / np.sqrt(cfg.width)
    x = rng.standard_normal((cfg.items, cfg.rows, cfg.width), np.float32)
    x += rng.choice([-0.3, 0.3], (cfg.items, 1, 1)).astype(np.float32)  # both branches of gate
    return {"x": jnp.asarray(x), "w": jnp.asarray(w)}


# --- The methods: each returns {output: (values[N], grads[N, rows, width])} as NumPy ---------

def loop(inputs: dict, jittable: bool = False) -> dict:
    h2_fn = layer if jittable else gate
    w = inputs["w"]
    per_item = [_hand_written_item(x, w, h2_fn) for x in inputs["x"]]
    return {o: (np.stack([np.asarray(item[o][0]) for item in per_item]),
                np.stack([np.asarray(item[o][1]) for item in per_item])) for o in OUTPUTS}


def _hand_written_item(x, w, h2_fn) -> dict:
    """One item: each node's ``jax.vjp`` once, each output's cotangent pulled back by hand."""
    h1, pb1 = jax.vjp(lambda x: layer(x, w), x)
    h2, pb2 = jax.vjp(lambda h1: h2_fn(h1, w), h1)
    h3, pb3 = jax.vjp(lambda h2, h1: mix(h2, h1, w), h2, h1)
    e, pbe = jax.vjp(energy, h3)
    v, pbv = jax.vjp(overlap, h2, h1)

    (ct_h3,) = pbe(jnp.ones_like(e))
    ct_h2, ct_h1 = pb3(ct_h3)
    (ct_h1_via_h2,) = pb2(ct_h2)
    (grad_e,) = pb1(ct_h1 + ct_h1_via_h2)

    ct_h2, ct_h1 = pbv(jnp.ones_like(v))
    (ct_h1_via_h2,) = pb2(ct_h2)
    (grad_v,) = pb1(ct_h1 + ct_h1_via_h2)
    return {"energy": (e, grad_e), "overlap": (v, grad_v)}


def with_sweep(inputs: dict, dag: dict, chunk_size: int, client=None) -> dict:
    res = daskdag.sweep_grads(dag, inputs, list(OUTPUTS), batched=["x"], client=client,
                              chunk_size=chunk_size)
    return {o: (res[o].value, res[o].grad["x"]) for o in OUTPUTS}


def composed(output: str, x, w):
    h1 = layer(x, w)
    h2 = layer(h1, w)
    return energy(mix(h2, h1, w)) if output == "energy" else overlap(h2, h1)


@jax.jit
def _jit_vmap(x, w):
    return {o: jax.vmap(jax.value_and_grad(partial(composed, o)), in_axes=(0, None))(x, w)
            for o in OUTPUTS}


def jit_vmap(inputs: dict) -> dict:
    out = _jit_vmap(inputs["x"], inputs["w"])
    return {o: (np.asarray(v), np.asarray(g)) for o, (v, g) in out.items()}


@dataclass(frozen=True)
class Method:
    run: Callable[[dict], dict]
    reference: str  # the loop it is checked against: "loop" (branching DAG) or "loop_jittable"
    client: distributed.Client | None = None  # the cluster it runs on, if any


def methods(clients: dict, chunk_size: int) -> dict[str, Method]:
    """The methods whose clusters are in ``clients`` (``{"1w": client, "2w": client}``)."""
    sweep = partial(with_sweep, chunk_size=chunk_size)
    branching, vectorized = make_dag(), make_dag(jittable=True, vmap=True)
    runs = {"loop": Method(loop, "loop")}
    for key, client in clients.items():
        runs[f"sweep_{key}"] = Method(partial(sweep, dag=branching, client=client), "loop", client)
    runs["sweep_threads"] = Method(partial(sweep, dag=branching), "loop")
    runs["jit_vmap"] = Method(jit_vmap, "loop_jittable")
    if "2w" in clients:
        runs["sweep_vmap_2w"] = Method(partial(sweep, dag=vectorized, client=clients["2w"]),
                                       "loop_jittable", clients["2w"])
    return runs


# --- Clusters --------------------------------------------------------------------------------

def worker_environment(distributed_malloc_trim: bool) -> dict:
    """Dask config for the workers' environment: distributed's default, or without
    ``MALLOC_TRIM_THRESHOLD_`` (None unsets a variable there)."""
    return {} if distributed_malloc_trim else {
        "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}


@contextlib.contextmanager
def clusters(worker_counts: tuple[int, ...], environment: dict):
    """``{"1w": client, ...}``: a ``common.cluster`` per worker count, all up at once."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(dask.config.set(environment))
        yield {f"{n}w": stack.enter_context(common.cluster(n_workers=n)) for n in worker_counts}


# --- Measuring -----------------------------------------------------------------------------

def timed(fn, inputs) -> tuple[float, float, dict]:
    """Wall seconds, CPU seconds of this process, and the result."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(inputs)
    return time.perf_counter() - wall, time.process_time() - cpu, out


def check(runs: dict[str, Method], inputs: dict) -> dict[str, dict]:
    """Warm up every method; compare its values and gradients with its reference loop's."""
    refs = {"loop": loop(inputs), "loop_jittable": loop(inputs, jittable=True)}
    report = {}
    for name, method in runs.items():
        got, ref = method.run(inputs), refs[method.reference]
        pairs = [(got[o][k], ref[o][k]) for o in OUTPUTS for k in (0, 1)]
        report[name] = {
            "reference": method.reference,
            "allclose": all(g.shape == r.shape and np.allclose(g, r, rtol=RTOL, atol=RTOL * np.abs(r).max())
                            for g, r in pairs),
            "max_rel_diff": max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in pairs),
        }
    return report


def time_methods(runs: dict[str, Method], inputs: dict, reps: int, label: str) -> dict[str, dict]:
    """Wall and CPU seconds per run, round-robin, each repetition starting at the next method."""
    times = {name: {"wall_s": [], "client_cpu_s": []} for name in runs}
    names = list(runs)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            wall, cpu, _ = timed(runs[name].run, inputs)
            times[name]["wall_s"].append(wall)
            times[name]["client_cpu_s"].append(cpu)
            print(f"  {label}rep {rep + 1}/{reps}  {name:<14} {wall:7.3f} s  "
                  f"(this process: {cpu:6.3f} CPU s)", flush=True)
    return times


def task_stream_profile(method: Method, inputs: dict) -> dict:
    """One more run under the task stream: where the workers' time went, by task kind (the
    key's prefix: ``fwd``, ``bwd``, ...), and what moved between them."""
    client = method.client
    before = _worker_counters(client)
    wall = time.perf_counter()
    with distributed.get_task_stream(client=client) as stream:
        method.run(inputs)
    wall = time.perf_counter() - wall
    after = _worker_counters(client)
    compute, transfer, tasks, per_worker = (defaultdict(float), defaultdict(float),
                                            defaultdict(int), defaultdict(float))
    for task in stream.data:
        kind = task["key"].split("-")[0]
        for span in task["startstops"]:
            seconds = span["stop"] - span["start"]
            if span["action"] == "compute":
                compute[kind] += seconds
                per_worker[task["worker"]] += seconds
                tasks[kind] += 1
            elif span["action"] == "transfer":
                transfer[kind] += seconds
    moved = [(key.split("-")[0], nbytes) for addr in after for key, nbytes in after[addr]["moved"]]
    return {"wall_s": wall, "workers": len(after),
            "compute_s_per_worker": sorted(per_worker.values()),
            "busy_fraction": sum(per_worker.values()) / (wall * len(after)),
            "compute_s_by_kind": dict(compute), "tasks_by_kind": dict(tasks),
            "transfer_s_by_kind": dict(transfer),
            "values_moved_by_kind": {k: sum(1 for kind, _ in moved if kind == k) for k, _ in moved},
            "bytes_moved": sum(nbytes for _, nbytes in moved),
            "backward_programs_compiled": sum(after[a]["compiled"] - before[a]["compiled"] for a in after)}


def _worker_counters(client) -> dict[str, dict]:
    """Per worker: the values it fetched from another worker since the last call, ``(key,
    nbytes)``, and how many backward programs of moved pullbacks it has compiled in all."""
    def counters(dask_worker):
        moved = [(key, nbytes) for entry in dask_worker.transfer_incoming_log
                 for key, nbytes in entry["keys"].items()]
        dask_worker.transfer_incoming_log.clear()
        return {"moved": moved, "compiled": programs.stats()["compiled"]}
    return client.run(counters)


def run_phase(cfg: Config, inputs: dict, worker_counts: tuple[int, ...], environment: dict,
              label: str) -> dict:
    """Start the clusters, check every method, time them round-robin, profile the cluster sweeps."""
    with clusters(worker_counts, environment) as clients:
        described = {k: common.describe(c) for k, c in clients.items()}
        for k, d in described.items():
            print(f"{label}cluster {k}: " + ", ".join(
                f"cpus {w['cpus']} matmul CPU/wall {w['matmul_cpu_per_wall']}" for w in d["workers"].values()))
        runs = methods(clients, cfg.chunk_size)
        checks = check(runs, inputs)
        print(f"{label}agreement (allclose, max |diff| / max |ref|): " + ", ".join(
            f"{n} {'ok' if c['allclose'] else 'FAIL'} {c['max_rel_diff']:.1e}" for n, c in checks.items()))
        if not all(c["allclose"] for c in checks.values()):
            return {"checks": checks}
        times = time_methods(runs, inputs, cfg.reps, label)
        profiles = {name: task_stream_profile(m, inputs) for name, m in runs.items() if m.client}
    return {"clusters": described, "checks": checks, "times": times, "profiles": profiles}


# --- Reporting -----------------------------------------------------------------------------

def medians(times: dict) -> dict[str, dict[str, float]]:
    return {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}


def ratios(phases: dict) -> dict[str, float]:
    """Ratios of median wall times. With separate phases, sweep_1w / sweep_2w is also given
    normalized by each phase's own loop median, which cancels a drift of the machine between
    phases; the loop ratios use the loop of the sweep's own phase."""
    wall = {p: {n: m["wall_s"] for n, m in medians(ph["times"]).items()} for p, ph in phases.items()}
    one = next(w for w in wall.values() if "sweep_1w" in w)
    two = next(w for w in wall.values() if "sweep_2w" in w)
    out = {"sweep_1w/sweep_2w": one["sweep_1w"] / two["sweep_2w"],
           "loop/sweep_2w": two["loop"] / two["sweep_2w"],
           "loop/sweep_1w": one["loop"] / one["sweep_1w"],
           "loop/sweep_threads": two["loop"] / two["sweep_threads"],
           "sweep_2w/jit_vmap": two["sweep_2w"] / two["jit_vmap"],
           "sweep_vmap_2w/jit_vmap": two["sweep_vmap_2w"] / two["jit_vmap"],
           "loop/jit_vmap": two["loop"] / two["jit_vmap"]}
    if one is not two:
        out["sweep_1w/sweep_2w, loop-normalized"] = (one["sweep_1w"] / one["loop"]) / (
            two["sweep_2w"] / two["loop"])
    return out


def print_report(phases: dict, ratio: dict) -> None:
    print(f"\n{'phase':<10} {'method':<14} {'median s':>9} {'loop/this':>10} {'client CPU s':>13}")
    for p, ph in phases.items():
        meds = medians(ph["times"])
        for name, m in meds.items():
            print(f"{p:<10} {name:<14} {m['wall_s']:9.3f} {meds['loop']['wall_s'] / m['wall_s']:10.2f} "
                  f"{m['client_cpu_s']:13.3f}")
    print()
    for name, r in ratio.items():
        target = TARGETS.get(name)
        met = "" if target is None else f"  (target >= {target}: {'met' if r >= target else 'NOT met'})"
        print(f"{name:<36} = {r:6.2f}{met}")
    for p, ph in phases.items():
        for name, prof in ph["profiles"].items():
            kinds = sorted(prof["compute_s_by_kind"].items(), key=lambda kv: -kv[1])[:2]
            print(f"{p} {name}: workers busy {prof['busy_fraction']:.0%} of {prof['wall_s']:.2f} s "
                  f"x {prof['workers']} (compute s per worker "
                  f"{', '.join(f'{s:.2f}' for s in prof['compute_s_per_worker'])}; "
                  + ", ".join(f"{k} {s:.2f} s in {prof['tasks_by_kind'][k]} tasks" for k, s in kinds)
                  + f"); moved between workers: {prof['values_moved_by_kind'] or 'nothing'} "
                  f"({prof['bytes_moved'] / 2**20:.1f} MiB), backward programs compiled "
                  f"{prof['backward_programs_compiled']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer items and repetitions")
    parser.add_argument("--chunk-size", type=int, help="items per chunk (default: N / 8)")
    parser.add_argument("--separate-phases", action="store_true",
                        help="the 1-worker and 2-worker clusters in separate phases, not together")
    parser.add_argument("--distributed-malloc-trim", action="store_true",
                        help="keep distributed's MALLOC_TRIM_THRESHOLD_=65536 in the workers")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sweeps.json")
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    if args.chunk_size:
        cfg = replace(cfg, chunk_size=args.chunk_size)
    environment = worker_environment(args.distributed_malloc_trim)
    info = common.machine()
    print(f"N={cfg.items} items of x float32[{cfg.rows}, {cfg.width}], shared w "
          f"float32[{cfg.width}, {cfg.width}], outputs {list(OUTPUTS)}, chunks of {cfg.chunk_size}, "
          f"{cfg.reps} reps, {info['cpu_count']} CPUs")
    inputs = make_inputs(cfg)

    layout = {"1w": (1,), "2w": (2,)} if args.separate_phases else {"together": (1, 2)}
    phases = {}
    for name, counts in layout.items():
        label = f"[{name}] " if len(layout) > 1 else ""
        phases[name] = run_phase(cfg, inputs, counts, environment, label)
        if "times" not in phases[name]:
            print(f"DISAGREEMENT beyond rtol={RTOL}: {phases[name]['checks']}; not timing",
                  file=sys.stderr)
            return 1
    ratio = ratios(phases)
    print_report(phases, ratio)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "sweeps",
        "machine": info,
        "config": {**asdict(cfg), "quick": args.quick, "outputs": list(OUTPUTS), "jit": False,
                   "chunks": -(-cfg.items // cfg.chunk_size),
                   "chunk_size_chosen": "explicit: N / 8, the sweep_grads default on 2 workers"
                                        if not args.chunk_size else "explicit (--chunk-size)",
                   "layout": "separate phases" if args.separate_phases else "both clusters up together",
                   "worker_malloc_trim_threshold": "65536 (distributed's default)"
                                                   if args.distributed_malloc_trim else "unset",
                   "rtol": RTOL},
        "phases": {p: {**ph, "medians": medians(ph["times"])} for p, ph in phases.items()},
        "ratios": ratio,
        "targets": TARGETS,
        "targets_met": {k: ratio[k] >= t for k, t in TARGETS.items()},
    }, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
