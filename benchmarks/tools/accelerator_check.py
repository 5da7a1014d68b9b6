"""Accelerator check: daskdag on one host with an accelerator (a TPU chip or a GPU), in one
process, each figure beside plain JAX in the same run.

    python benchmarks/tools/accelerator_check.py [--quick] [--kinds KIND ...] [--json OUT]

Needs ``pytest`` importable (it reuses the every-kind matrix's helpers, tests/test_every_kind.py),
and runs from the repository's root. ``--quick``: small sizes, for a CPU (the test suite runs it
so); ``--kinds``: the matrix's cells of those kinds alone. It prints, and with ``--json``
writes:

1. ``compiles``: XLA compilations over three rounds of a hybrid DAG's calls (a jitted trunk, an
   eager gate with Python control flow, jitted heads), every kind: none after the first.
2. ``matrix``: the every-kind matrix's in-process cells, each against JAX on this device
   (float32, matmuls at ``highest`` precision): every kind x {eager, lazy, prepared} x {plain,
   reused across 3 calls, swept over 8 items, ``store=`` resumed after the call was SIGKILLed in
   a child process on the CPU: its exported backward programs land on this device}.
3. ``ratios``, each against plain JAX in this process, timed at JAX's default matmul precision
   (as a user runs; each answer checked at ``highest``):
   - ``hybrid``: the hybrid DAG's ``compute_grads`` of two heads against the hand-written
     ``jax.vjp`` plumbing and against one ``jax.jit`` of everything (the gate written with
     ``jnp.where``);
   - ``eager_on_cpu``: an eager node of 200 small ops, inside the DAG, on the accelerator
     against on the host's CPU (``Node(device="cpu")``): how many times faster on the CPU, in
     a call that runs it forward only and in one that differentiates through it;
   - ``prepared``: a prepared all-jit ``value_and_grad`` (two n x n matmuls on an n x n
     input) in a loop against ``jax.jit`` of the composed function's, at n=64 and n=2048;
   - ``sweep``: ``sweep_grads`` of ``vmap=True`` nodes over 16,384 items of 256 floats against
     ``jax.jit(jax.vmap(jax.value_and_grad(f)))``.
4. ``multi_head``: the benchmark scenario ``multi_head`` (K=8 jitted heads on a 4-layer jitted
   trunk behind one eager gate; ``benchmarks/scenarios/multi_head.py``) at its ``DEVICE`` sizes
   (2048 wide, batch 1024; ``--quick``: its ``QUICK`` ones), its cases and targets.

Only one process at a time can hold a TPU chip: the child it starts runs with
``JAX_PLATFORMS=cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import daskdag

ROOT = Path(__file__).resolve().parents[2]
COMPILES = [0]  # XLA compilations in this process, once main() listens


def _count(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES[0] += 1


def ready(tree):
    return jax.block_until_ready(tree)


def timed(fn, repeats: int) -> float:
    """The median of ``repeats`` timings of ``fn()`` (its results ready), after one warm call."""
    ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def side_by_side(fns: dict, repeats: int, rounds: int = 3) -> dict:
    """Each function's best median over ``rounds`` rounds, the functions alternated."""
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], timed(fn, repeats))
    return best


# -- the hybrid DAG -------------------------------------------------------------------------------

def hybrid(n: int, rows: int, layers: int = 8):
    """A jitted trunk of ``layers`` n x n matmuls, an eager gate (Python control flow on a
    value), two jitted heads."""
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.standard_normal((layers, n, n), np.float32) / np.sqrt(n))
    v1 = jnp.asarray(rng.standard_normal((n, 16), np.float32) / np.sqrt(n))
    x = jnp.asarray(rng.standard_normal((rows, n), np.float32))

    def trunk(x, ws):
        for i in range(layers):
            x = jnp.tanh(x @ ws[i])
        return x

    def gate(t):
        if not jnp.all(jnp.isfinite(t)):  # (Python control flow on a value: not jittable)
            raise FloatingPointError("the trunk is not finite")
        return t * 2.0

    def head1(g):
        return jnp.sum(jnp.tanh(g @ v1))

    def head2(g):
        return jnp.mean(g ** 2)

    dag = {"T": daskdag.Node(trunk, ["x", "ws"], jit=True), "G": (gate, ["T"]),
           "H1": daskdag.Node(head1, ["G"], jit=True), "H2": daskdag.Node(head2, ["G"], jit=True)}
    jtrunk, jh1, jh2 = jax.jit(trunk), jax.jit(head1), jax.jit(head2)

    def plumbing(x):
        t, pull_t = jax.vjp(lambda x: jtrunk(x, ws), x)
        g, pull_g = jax.vjp(gate, t)
        (h1, pull_1), (h2, pull_2) = jax.vjp(jh1, g), jax.vjp(jh2, g)
        (g1,), (g2,) = pull_g(pull_1(jnp.ones_like(h1))[0]), pull_g(pull_2(jnp.ones_like(h2))[0])
        return (h1, pull_t(g1)[0]), (h2, pull_t(g2)[0])

    def composed(x):
        g = jnp.where(jnp.all(jnp.isfinite(trunk(x, ws))), trunk(x, ws) * 2.0, jnp.nan)
        return g

    whole = jax.jit(lambda x: (jax.value_and_grad(lambda x: head1(composed(x)))(x),
                               jax.value_and_grad(lambda x: head2(composed(x)))(x)))
    return dag, {"x": x, "ws": ws}, plumbing, whole


def check_compiles(quick: bool) -> dict:
    dag, inputs, _, _ = hybrid(64 if quick else 512, 32 if quick else 256)
    f = daskdag.value_and_grad(dag, "H1", wrt=["x"])
    rounds = []
    for step in range(3):
        x = {**inputs, "x": inputs["x"] + 0.01 * step}
        before = COMPILES[0]
        ready([r.grad for r in daskdag.compute_grads(dag, x, ["H1", "H2"], wrt=["x"]).values()])
        ready(daskdag.jacobian(dag, x, ["H2"], wrt=["x"], mode="rev")["H2"].grad)
        ready(f(x))
        ready(daskdag.compute_jvps(dag, x, {"x": jnp.ones_like(x["x"])}, ["H1"])["H1"].tangent)
        ready(daskdag.compute_hvps(dag, x, {"x": jnp.ones_like(x["x"])}, ["H2"],
                                   wrt=["x"])["H2"].hvp)
        rounds.append(COMPILES[0] - before)
    return {"rounds": rounds, "ok": rounds[1:] == [0, 0]}


# -- the every-kind matrix --------------------------------------------------------------------------

def close(got, want, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    got, want = tuple(got), tuple(want)
    return len(got) == len(want) and all(
        np.allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol) for g, w in zip(got, want))


def matrix(work: Path, kinds: list[str] | None = None) -> dict:
    """The matrix's cells of ``kinds`` (None: every kind)."""
    from tests import test_every_kind as m

    cells: dict[str, bool] = {}
    for kind in kinds or m.KINDS:
        for form in m.FORMS:
            count = work / f"runs-{kind}-{form}"
            try:
                cells[f"{kind}/{form}/plain"] = close(
                    m.call(kind, form, m.make_dag(str(count)), m.P), m.want(kind, m.P)) \
                    and m.runs(count) == 1
                count = work / f"reused-{kind}-{form}"
                dag = m.make_dag(str(count))
                f = m.prepared(kind, dag, {"scheduler": "threads"}) if form == "prepared" else None
                good = True
                for step in range(3):
                    p = m.P + 0.1 * step
                    good &= close(m.call(kind, form, dag, p, f=f), m.want(kind, p))
                cells[f"{kind}/{form}/reused"] = good and m.runs(count) == 1
                count = work / f"swept-{kind}-{form}"
                ps = m.P + 0.1 * np.arange(m.ITEMS, dtype=np.float32)[:, None]
                cells[f"{kind}/{form}/swept"] = close(
                    m.sweep(kind, form, m.make_dag(str(count)), ps), m.want_items(kind, ps)) \
                    and m.runs(count) == 1
                cells[f"{kind}/{form}/stored"] = stored(m, kind, form, work)
            except Exception as e:  # (a cell that raises is a failed cell: say why, go on)
                cells[f"{kind}/{form}/raised"] = False
                print(f"  {kind}/{form}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return {"cells": cells, "ok": all(cells.values()), "count": len(cells)}


def stored(m, kind: str, form: str, work: Path) -> bool:
    """The call SIGKILLed in a child on the CPU once its store holds the trunk's stage, then
    resumed here: the trunk not run again, the results JAX's."""
    folder = work / f"stored-{kind}-{form}"
    folder.mkdir()
    count, flag, store = folder / "runs", folder / "flag", folder / "store"
    # (the child computes under this process's JAX settings, which its store records)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "JAX_DEFAULT_MATMUL_PRECISION": str(jax.config.jax_default_matmul_precision)}
    failed = m.killed_once_stored(kind, form, count, flag, store, env=env)
    if failed is not None:
        print(f"  {kind}/{form}/stored: {failed[-1500:]}", flush=True)
        return False
    flag.touch()
    got = m.call(kind, form, m.make_dag(str(count), str(flag)), m.P, store=str(store))
    return close(got, m.want(kind, m.P)) and m.runs(count) == 1


# -- the ratios -------------------------------------------------------------------------------------

def ratio_hybrid(quick: bool) -> dict:
    dag, inputs, plumbing, whole = hybrid(128 if quick else 4096, 64 if quick else 1024)

    def ours():
        res = daskdag.compute_grads(dag, inputs, ["H1", "H2"], wrt=["x"])
        return [(r.value, r.grad["x"]) for r in res.values()]

    with jax.default_matmul_precision("highest"):  # (checked in float32; timed at the default)
        ours_out, want = ours(), plumbing(inputs["x"])
    right = all(np.allclose(np.asarray(g), np.asarray(w[1]), rtol=1e-3, atol=1e-4)
                for (_, g), w in zip(ours_out, want))
    t = side_by_side({"daskdag": ours, "plumbing": lambda: plumbing(inputs["x"]),
                      "jit": lambda: whole(inputs["x"])}, 3 if quick else 5)
    return {"seconds": t, "right": right,
            "vs_plumbing": t["daskdag"] / t["plumbing"], "vs_jit": t["daskdag"] / t["jit"]}


def ratio_eager_on_cpu(quick: bool) -> dict:
    def small(v):
        for _ in range(200):
            v = v * 1.0001 + 0.001
        return v

    def loss(a):
        return jnp.sum(a ** 2)

    def tail(a, y):
        return jnp.sum(a ** 2 * y)

    # (JAX arrays on the default device: NumPy inputs would run the node in NumPy)
    x = {"x": jnp.linspace(0, 1, 64, dtype=jnp.float32), "y": jnp.float32(0.5)}
    here = {"A": daskdag.Node(small, ["x"]), "L": (tail, ["A", "y"])}
    cpu = {"A": daskdag.Node(small, ["x"], device="cpu"), "L": (tail, ["A", "y"])}
    def grads(dag: dict, wrt: str):
        return lambda: daskdag.compute_grads(dag, x, ["L"], wrt=[wrt])["L"].grad

    # (wrt=["y"]: the node runs forward only; wrt=["x"]: under jax.vjp, and pulled back)
    t = side_by_side({f"{where}_{wrt}": grads(dag, wrt)
                      for where, dag in (("default", here), ("cpu", cpu)) for wrt in ("y", "x")},
                     5)
    return {"seconds": t, "platform": jax.default_backend(),
            "cpu_faster_by": t["default_y"] / t["cpu_y"],
            "cpu_faster_by_with_gradient": t["default_x"] / t["cpu_x"]}


def ratio_prepared(n: int) -> dict:
    rng = np.random.default_rng(1)
    w1, w2 = (jnp.asarray(rng.standard_normal((n, n), np.float32) / np.sqrt(n)) for _ in "ab")

    def a(x):
        return jnp.tanh(w1 @ x)

    def b(h):
        return jnp.tanh(w2 @ h)

    def loss(h):
        return jnp.sum(h ** 2)

    dag = {"A": daskdag.Node(a, ["x"], jit=True), "B": daskdag.Node(b, ["A"], jit=True),
           "L": daskdag.Node(loss, ["B"], jit=True)}
    f = daskdag.value_and_grad(dag, "L")
    g = jax.jit(jax.value_and_grad(lambda x: loss(b(a(x)))))
    x = jnp.asarray(rng.standard_normal((n, n), np.float32))
    loops = 200 if n <= 256 else 20

    def loop(fn):
        def run():
            out = None
            for _ in range(loops):
                out = fn({"x": x}) if fn is f else fn(x)
            return out
        return run

    t = side_by_side({"daskdag": loop(f), "jax_jit": loop(g)}, 5)
    return {"n": n, "per_call_us": {k: v / loops * 1e6 for k, v in t.items()},
            "ratio": t["daskdag"] / t["jax_jit"]}


def ratio_sweep(quick: bool) -> dict:
    items, width = (1024, 64) if quick else (16384, 256)
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((width, width), np.float32) / np.sqrt(width))

    def a(x):
        return jnp.tanh(w @ x)

    def loss(h):
        return jnp.sum(h ** 2)

    dag = {"A": daskdag.Node(a, ["x"], jit=True, vmap=True),
           "L": daskdag.Node(loss, ["A"], jit=True, vmap=True)}
    xs = jnp.asarray(rng.standard_normal((items, width), np.float32))
    g = jax.jit(jax.vmap(jax.value_and_grad(lambda x: loss(a(x)))))

    def ours():
        res = daskdag.sweep_grads(dag, {"x": xs}, ["L"], batched=["x"])
        return res["L"].value, res["L"].grad

    with jax.default_matmul_precision("highest"):  # (checked in float32; timed at the default)
        (v, gr), (wv, wg) = ours(), g(xs)
    right = np.allclose(np.asarray(v), np.asarray(wv), rtol=1e-4) and \
        np.allclose(np.asarray(gr), np.asarray(wg), rtol=1e-3, atol=1e-5)
    t = side_by_side({"daskdag": ours, "jit_vmap": lambda: g(xs)}, 5)
    return {"items": items, "seconds": t, "right": bool(right),
            "result_type": type(v).__name__, "ratio": t["daskdag"] / t["jit_vmap"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--only", nargs="*",
                        default=["compiles", "matrix", "ratios", "multi_head"])
    parser.add_argument("--kinds", nargs="*", help="the matrix's kinds (default: every kind)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # (tests/, for the matrix's helpers)
    jax.monitoring.register_event_duration_secs_listener(_count)
    out: dict = {"jax": jax.__version__, "jax_file": jax.__file__,
                 "devices": [str(d) for d in jax.devices()], "backend": jax.default_backend()}
    print(json.dumps(out), flush=True)
    work = Path(tempfile.mkdtemp(prefix="accelerator-check-"))
    try:
        if "compiles" in args.only:
            with jax.default_matmul_precision("highest"):
                out["compiles"] = check_compiles(args.quick)
            print("compiles", json.dumps(out["compiles"]), flush=True)
        if "matrix" in args.only:
            with jax.default_matmul_precision("highest"):
                out["matrix"] = matrix(work, args.kinds)
            bad = [c for c, ok in out["matrix"]["cells"].items() if not ok]
            print(f"matrix: {out['matrix']['count']} cells, failed: {bad}", flush=True)
        if "ratios" in args.only:
            out["hybrid"] = ratio_hybrid(args.quick)
            print("hybrid", json.dumps(out["hybrid"]), flush=True)
            out["eager_on_cpu"] = ratio_eager_on_cpu(args.quick)
            print("eager_on_cpu", json.dumps(out["eager_on_cpu"]), flush=True)
            out["prepared"] = [ratio_prepared(n) for n in ((64, 256) if args.quick
                                                           else (64, 2048))]
            print("prepared", json.dumps(out["prepared"]), flush=True)
            out["sweep"] = ratio_sweep(args.quick)
            print("sweep", json.dumps(out["sweep"]), flush=True)
        if "multi_head" in args.only:
            from benchmarks.scenarios import multi_head
            out["multi_head"] = multi_head.run(
                args.quick, {}, multi_head.QUICK if args.quick else multi_head.DEVICE)
            print("multi_head", json.dumps({c["case"]: c["ratios"]
                                            for c in out["multi_head"]["cases"]}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    ok = all(out[k]["ok"] for k in ("compiles", "matrix") if k in out) and \
        all(out[k]["right"] for k in ("hybrid", "sweep") if k in out)
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
