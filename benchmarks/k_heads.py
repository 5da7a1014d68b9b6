"""K scalar heads over one expensive shared trunk: values and gradients three ways.

    x -> t0 -> t1 -> ... -> t_mid -> ... -> t_last
                              \\________________\\____> head_k(t_mid, t_last),  k = 0..K-1

Each trunk node is ``tanh(h @ W_i)`` on a ``width x width`` float32 matrix; each head is a cheap,
different scalar of the middle and last trunk nodes. We want all K values and all K gradients
with respect to ``x``, computed three ways, eagerly (no ``jax.jit``):

1. naive:          ``jax.value_and_grad`` of each composed head: the trunk's forward and
                   backward pass run K times.
2. hand_written:   ``jax.vjp`` of the trunk once, ``jax.vjp`` of each head on its output, then K
                   trunk pullbacks: the VJP plumbing daskdag exists to spare its users.
3. compute_grads:  ``daskdag.compute_grads(dag, x, heads)`` on Dask's default threaded scheduler.

Methods 2 and 3 do the same JAX work (one trunk forward, K trunk backwards), so their ratio is
daskdag's overhead, which should stay within 10 %; naive / compute_grads is what it saves over
the obvious code. Each method's first run is its warm-up, and its values and gradients are
checked against naive's (exit 1, before any timing, if they disagree); then the methods are
timed round-robin, each repetition starting at the next method, and compared by median. The
trunk's plain forward pass is timed too, to show the scale of the work.

Run: ``python benchmarks/k_heads.py [--quick] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import dask
import jax
import jax.numpy as jnp
import numpy as np

import daskdag

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


# --- The model: trunk layers and heads, shared by all three methods ---------------------------

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


# --- The three methods: each returns [(value_k, grad_k)] ---------------------------------------

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


def with_compute_grads(model: Model, x):
    dag, heads = to_dag(model)
    res = daskdag.compute_grads(dag, x, heads)
    return [(res[h].value, res[h].grad) for h in heads]


METHODS = {"naive": naive, "hand_written": hand_written, "compute_grads": with_compute_grads}


# --- Measuring -----------------------------------------------------------------------------

def timed(method, model, x) -> tuple[float, list]:
    start = time.perf_counter()
    out = jax.block_until_ready(method(model, x))  # eager JAX dispatches asynchronously
    return time.perf_counter() - start, out


def worst_difference(got: list, ref: list) -> float:
    """Largest |got - ref| over all values and gradients, relative to that result's scale."""
    return max(float(np.max(np.abs(np.asarray(g) - np.asarray(r))) / max(np.max(np.abs(r)), 1e-30))
               for pair_got, pair_ref in zip(got, ref) for g, r in zip(pair_got, pair_ref))


def check(model: Model, x) -> dict[str, float]:
    """Run each method once (the warm-up); each one's worst relative difference to naive."""
    out = {name: timed(method, model, x)[1] for name, method in METHODS.items()}
    return {name: worst_difference(got, out["naive"]) for name, got in out.items()}


def time_trunk(model: Model, x, reps: int) -> float:
    """Median seconds of one plain (non-differentiated) trunk forward pass."""
    return statistics.median(timed(trunk, model, x)[0] for _ in range(reps))


def time_methods(model: Model, x, reps: int) -> dict[str, list[float]]:
    """Seconds per run, round-robin, each repetition starting at the next method."""
    times = {name: [] for name in METHODS}
    names = list(METHODS)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            times[name].append(timed(METHODS[name], model, x)[0])
            print(f"  rep {rep + 1}/{reps}  {name:<14} {times[name][-1]:7.3f} s", flush=True)
    return times


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),  # XLA's CPU thread pool and Dask's threaded scheduler size
        "load_average_at_start": os.getloadavg(),
        "jax": jax.__version__,
        "jax_devices": [str(d) for d in jax.devices()],
        "dask": dask.__version__,
        "daskdag": daskdag.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller trunk (a smoke run)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "k_heads.json")
    args = parser.parse_args()
    cfg = QUICK if args.quick else FULL
    info = machine()
    print(f"K={cfg.heads} heads, trunk of {cfg.depth} nodes on {cfg.width}x{cfg.width} float32, "
          f"{cfg.reps} reps, {info['cpu_count']} CPUs")

    model = make_model(cfg)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((cfg.width, cfg.width), np.float32))
    diffs = check(model, x)
    print("max |diff| vs naive, relative to each result's largest entry: "
          + ", ".join(f"{name} {d:.1e}" for name, d in diffs.items()))
    failed = {name: d for name, d in diffs.items() if d > RTOL}
    if failed:
        print(f"DISAGREEMENT with naive beyond {RTOL}: {failed}; not timing", file=sys.stderr)
        return 1

    trunk_s = time_trunk(model, x, cfg.reps)
    print(f"trunk forward alone: {trunk_s:.3f} s")
    times = time_methods(model, x, cfg.reps)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    overhead = medians["compute_grads"] / medians["hand_written"]
    saving = medians["naive"] / medians["compute_grads"]

    print(f"\n{'method':<14} {'median s':>9}")
    for name in METHODS:
        print(f"{name:<14} {medians[name]:9.3f}")
    print(f"\ncompute_grads / hand_written = {overhead:.3f}  (target <= {TARGET:.2f}: "
          f"{'met' if overhead <= TARGET else 'NOT met'})")
    print(f"naive / compute_grads        = {saving:.2f}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "k_heads",
        "machine": info,
        "config": {**asdict(cfg), "mid": cfg.mid, "quick": args.quick,
                   "scheduler": "dask threaded (default)", "jit": False},
        "trunk_forward_median_s": trunk_s,
        "methods": {name: {"times_s": times[name], "median_s": medians[name],
                           "max_rel_diff_vs_naive": diffs[name]} for name in METHODS},
        "ratios": {"compute_grads/hand_written": overhead, "naive/compute_grads": saving},
        "target": TARGET,
        "target_met": overhead <= TARGET,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
