"""Scenario 3, sweeps: one DAG's values and gradients over N items, in a Python loop and with
``sweep_grads``.

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
2. sweep_1w:       ``daskdag.sweep_grads(..., client=)`` on the default 1-worker process
                   LocalCluster (``1w`` in ``common.CLUSTERS``, as a user starts one).
3. sweep_2w:       the same on the default 2-worker LocalCluster (``2w``).
   sweep_2w_tuned: the same on the tuned 2-worker cluster (``2w_tuned``: each worker pinned to
                   its own core, ``MALLOC_TRIM_THRESHOLD_`` unset), a labelled extra.
4. sweep_threads:  ``sweep_grads`` without a client: Dask's local threads, in this process.

And on the jittable variant of the DAG, where ``h2 = tanh(h1 @ w)`` always (the same work per
item as either branch):

5. jit_vmap:       ``jax.jit(jax.vmap(jax.value_and_grad(composed)))`` for both outputs in one
                   jitted function, all items at once, in this process: the single-process limit.
6. sweep_vmap_2w:  ``sweep_grads`` on the default 2-worker cluster with every node
                   ``Node(..., vmap=True)``: the nodes run as one program per chunk (a fused
                   stage, forward and backward together, ``jit(vmap)`` over its items), with
                   ``sweep_grads``' default chunk size, as a user calls it (here 2 chunks of
                   128 items: a vectorized chunk holds at least 16 MiB unless a worker would
                   get none).
7. submit_vmap_2w: Dask's own round trip of the same work on the same cluster, as a user
                   writes it: the items split into the same chunks, each chunk and ``w``
                   scattered, one ``client.submit`` per chunk of a function that calls
                   ``jit_vmap``'s jitted one, gathered and joined. What the cluster itself costs, daskdag aside.

The item-by-item sweeps use the same explicit chunk size, N / 8: the default of
``sweep_grads`` on the 2-worker cluster (four chunks per worker), so the 1-worker and 2-worker
sweeps run the same chunk graphs and their ratio is the second worker's speedup alone. (The default on one worker would
be chunks twice as large, whose backward pass costs more per item.)

Before timing, each method runs once (its warm-up), and its values and gradients are checked
with ``np.allclose`` against the loop over the same DAG. Then the methods are timed interleaved
and compared by median: the item-by-item ones in one loop, ``reps`` times; the vectorized pair
(``jit_vmap``, ``sweep_vmap_2w``, ``submit_vmap_2w``, about 0.1 s a run) in a loop of their own, ``vector_reps``
times. (Interleaved with the 5-second eager sweeps, each of their runs followed a different
heavy method, on a different cluster: in one full run their per-run times spread from 158
to 217 ms and from 235 to 290 ms.) Every ratio ``a/b`` is a's median time over b's.
Targets: issue #4, sweep_1w / sweep_2w >= 1.7 (the second worker's speedup) and loop /
sweep_2w >= 1.6 (what a user gains over the loop on this 2-core machine); issue 11,
sweep_vmap_2w / jit_vmap <= 1.3 (it was 3.9): the vectorized sweep's time over the
single-process limit's, lower is better.

All clusters are up together, idle while another one runs: in an earlier measurement, sweeps on
either cluster took 3-4 % longer with the other one up, while the loop drifted by up to 50 %
between two separate phases, so the methods share one loop baseline.

Where the time goes is recorded too: for the cluster sweeps, one more run under
``distributed``'s task stream: the workers' busy time per task kind, and what moved between
them.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Callable

import distributed
import jax
import jax.numpy as jnp
import numpy as np

import daskdag
from daskdag.transport import programs
from .. import common, report
TITLE = "Sweeps"
DESCRIPTION = "``sweep_grads`` against a loop and ``jit(vmap)``"
CLUSTERS = ("1w", "2w", "2w_tuned")  # its sweep_<cluster> methods run on each
TARGETS = [{"ratio": "sweep_1w/sweep_2w", "op": ">=", "bound": 1.7, "source": "issue 4"},
           {"ratio": "loop/sweep_2w", "op": ">=", "bound": 1.6, "source": "issue 4"},
           {"ratio": "sweep_vmap_2w/jit_vmap", "op": "<=", "bound": 1.3, "was": "3.9",
            "source": "issue 11"},
           {"ratio": "sweep_vmap_2w/submit_vmap_2w", "op": "<=", "bound": 1.1,
            "source": "issue 52: no worse than Dask's own round trip"}]
RTOL = 1e-4  # np.allclose(rtol=RTOL, atol=RTOL * largest |entry| of the loop's result)
OUTPUTS = ("energy", "overlap")


@dataclass(frozen=True)
class Config:
    items: int  # N
    rows: int  # an item x is float32[rows, width]
    width: int  # w is float32[width, width]
    reps: int  # timed repetitions per method, after one warm-up
    chunk_size: int  # items per chunk, in the item-by-item sweeps
    vector_reps: int = 21  # timed repetitions of the vectorized methods (VECTORIZED), timed apart


FULL = Config(items=256, rows=32, width=256, reps=7, chunk_size=32, vector_reps=21)
QUICK = Config(items=64, rows=32, width=256, reps=3, chunk_size=8, vector_reps=5)
VECTORIZED = ("jit_vmap", "sweep_vmap_2w", "submit_vmap_2w")  # timed in a loop of their own


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


def vector_chunks(items: int) -> int:
    """The chunks ``sweep_grads`` makes of this scenario's items, vectorized, on 2 workers: at
    least one a worker, at least 16 MiB (512 items of 32 KiB) each."""
    return max(2, items // 512)


def vmap_chunk(x, w) -> dict:
    """``jit_vmap``'s program on a chunk of items, in a worker. (Submitted itself, the jitted
    function would travel by value and compile again at each call.)"""
    return _jit_vmap(x, w)


def submit_vmap(inputs: dict, client: distributed.Client) -> dict:
    """:func:`vmap_chunk` over the items' chunks, one ``client.submit`` each (scattered afresh
    each call, ``hash=False``: data scattered under its content's key, released by one call
    and scattered again by the next, is lost on the way)."""
    x = np.asarray(inputs["x"])
    w = client.scatter(inputs["w"], hash=False)
    chunks = client.scatter(np.array_split(x, vector_chunks(len(x))), hash=False)
    parts = client.gather([client.submit(vmap_chunk, c, w) for c in chunks])
    return {o: tuple(np.concatenate([np.asarray(p[o][k]) for p in parts]) for k in (0, 1))
            for o in OUTPUTS}


@dataclass(frozen=True)
class Method:
    run: Callable[[dict], dict]
    reference: str  # the loop it is checked against: "loop" (branching DAG) or "loop_jittable"
    client: distributed.Client | None = None  # the cluster it runs on, if any


def methods(clients: dict, chunk_size: int) -> dict[str, Method]:
    """The methods whose clusters are in ``clients`` (``{"1w": client, "2w": client,
    "2w_tuned": client}``): ``sweep_<name>`` for each."""
    sweep = partial(with_sweep, chunk_size=chunk_size)
    branching, vectorized = make_dag(), make_dag(jittable=True, vmap=True)
    runs = {"loop": Method(loop, "loop")}
    for key, client in clients.items():
        runs[f"sweep_{key}"] = Method(partial(sweep, dag=branching, client=client), "loop", client)
    runs["sweep_threads"] = Method(partial(sweep, dag=branching), "loop")
    runs["jit_vmap"] = Method(jit_vmap, "loop_jittable")
    if "2w" in clients:
        runs["sweep_vmap_2w"] = Method(partial(with_sweep, dag=vectorized, chunk_size=None,
                                               client=clients["2w"]), "loop_jittable", clients["2w"])
        runs["submit_vmap_2w"] = Method(partial(submit_vmap, client=clients["2w"]),
                                        "loop_jittable", clients["2w"])
    return runs


# --- Measuring -----------------------------------------------------------------------------

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




# --- The scenario ------------------------------------------------------------------------------

RATIOS = {"sweep_1w/sweep_2w": ("sweep_1w", "sweep_2w"),
          "loop/sweep_2w": ("loop", "sweep_2w"),
          "loop/sweep_2w_tuned": ("loop", "sweep_2w_tuned"),
          "sweep_1w/sweep_2w_tuned": ("sweep_1w", "sweep_2w_tuned"),
          "loop/sweep_1w": ("loop", "sweep_1w"),
          "loop/sweep_threads": ("loop", "sweep_threads"),
          "loop/sweep_vmap_2w": ("loop", "sweep_vmap_2w"),
          "loop/jit_vmap": ("loop", "jit_vmap"),
          "sweep_vmap_2w/jit_vmap": ("sweep_vmap_2w", "jit_vmap"),
          "submit_vmap_2w/jit_vmap": ("submit_vmap_2w", "jit_vmap"),
          "sweep_vmap_2w/submit_vmap_2w": ("sweep_vmap_2w", "submit_vmap_2w")}


def run(quick: bool, clients: dict) -> dict:
    cfg = QUICK if quick else FULL
    print(f"{TITLE}: N={cfg.items} items of x float32[{cfg.rows}, {cfg.width}], chunks of "
          f"{cfg.chunk_size}", flush=True)
    inputs = make_inputs(cfg)
    runs = methods(clients, cfg.chunk_size)
    checks = check(runs, inputs)
    bad = {n: c for n, c in checks.items() if not c["allclose"]}
    if bad:
        raise AssertionError(f"{TITLE}: disagrees with the loop beyond rtol={RTOL}: {bad}")
    vectorized = {n: partial(m.run, inputs) for n, m in runs.items() if n in VECTORIZED}
    times = common.interleaved({n: partial(m.run, inputs) for n, m in runs.items()
                                if n not in VECTORIZED}, cfg.reps)
    times.update(common.interleaved(vectorized, cfg.vector_reps, label="vectorized: "))
    profiles = {name: task_stream_profile(m, inputs) for name, m in runs.items() if m.client}
    c = common.case(f"N={cfg.items}", {"items": cfg.items, "chunk_size": cfg.chunk_size}, times,
                    RATIOS, baseline="loop", checks=checks, profiles=profiles)
    cases = [c] + ([vectorized_at_scale(quick, clients["2w"], cfg.reps)] if "2w" in clients else [])
    return {"title": TITLE, "config": {**asdict(cfg), "outputs": list(OUTPUTS), "rtol": RTOL},
            "targets": common.targets([c], [{"case": c["case"], **t} for t in TARGETS]),
            "cases": cases}


def vectorized_at_scale(quick: bool, client, reps: int) -> dict:
    """``sweep_vmap_2w`` against ``jit_vmap`` over 8 times as many items (N = 2048, 4 chunks of
    512 by default; 512 items with ``--quick``). At N = 256 most of what the cluster adds to
    the program is a fixed cost per sweep, about 60 ms before the first chunk computes
    (planning, the shared input and the chunk graph placed, the items scattered) and 20 ms
    after the last (results gathered, stored); with more items, the items and results moving
    (64 MiB each way here) weigh too, partly overlapped with the chunks computing."""
    cfg = replace(QUICK if quick else FULL, items=512 if quick else 2048)
    inputs = make_inputs(cfg, seed=1)
    runs = {"jit_vmap": partial(jit_vmap, inputs),
            "sweep_vmap_2w": partial(with_sweep, inputs, make_dag(jittable=True, vmap=True),
                                     None, client),
            "submit_vmap_2w": partial(submit_vmap, inputs, client)}
    want = runs["jit_vmap"]()
    checks = {}
    for name in ("sweep_vmap_2w", "submit_vmap_2w"):
        got = runs[name]()
        worst = max(float(np.max(np.abs(g - w) / (np.abs(w) + 1e-3))) for o in OUTPUTS
                    for g, w in zip(got[o], want[o]))
        if worst > RTOL:
            raise AssertionError(f"{TITLE}: {name} disagrees with jit_vmap at N={cfg.items}: {worst}")
        checks[name] = {"worst_relative": worst}
    times = common.interleaved(runs, reps)
    return common.case(f"N={cfg.items}, vectorized", {"items": cfg.items}, times,
                       {k: v for k, v in RATIOS.items() if "loop" not in k},
                       baseline="jit_vmap", checks=checks)


# --- Its report (benchmarks/report.py draws the rest) ---------------------------------------------

# Its methods in the order its table and plot show them.
COLUMNS = ("loop", "sweep_threads", "sweep_1w", "sweep_2w", "sweep_2w_tuned", "sweep_vmap_2w",
           "submit_vmap_2w", "jit_vmap")


def section(s: dict) -> str:
    """A row per method: its median and the loop's time over it; then the vectorized sweep
    over more items."""
    c, *more = s["cases"]
    cols = report.columns([c], COLUMNS)
    loop = report.baseline(c)
    cfg = s["config"]
    vector_reps = (f" ({cfg['vector_reps']} for the vectorized methods, timed "
                   f"interleaved in a loop of their own)" if "vector_reps" in cfg else "")
    head = (f"N = {cfg['items']} items of x float32[{cfg['rows']}, {cfg['width']}], two outputs, "
            f"chunks of {cfg['chunk_size']}; eager nodes with Python control flow, except the "
            f"vectorized methods `sweep_vmap_2w`, `submit_vmap_2w` and `jit_vmap` (the jittable "
            f"variant; `submit_vmap_2w` is Dask's own round trip of the same chunks, "
            f"`client.submit`). Median of {cfg['reps']} "
            f"runs{vector_reps}. `loop / method` is the loop's time over the method's: above 1, "
            f"the method is faster than the loop.")
    rows = [[m, report.seconds(c["methods"][m]["median_s"]),
             f"{loop / c['methods'][m]['median_s']:.2f}"] for m in cols]
    parts = [head, report.table(["method", "median", "loop / method"], rows),
             report.ratio_table([c])]
    if more:  # the vectorized sweep over more items (vectorized_at_scale)
        parts.append("The vectorized sweep over more items, with its default chunks: part of "
                     "what the cluster adds to the program is a fixed cost per sweep.")
        vectorized = [m for m in ("jit_vmap", "sweep_vmap_2w", "submit_vmap_2w")
                      if m in more[0]["methods"]]
        ratios = [r for r in ("sweep_vmap_2w/jit_vmap", "submit_vmap_2w/jit_vmap",
                              "sweep_vmap_2w/submit_vmap_2w") if r in more[0]["ratios"]]
        parts.append(report.table(
            ["case", *vectorized, *ratios],
            [[m["case"], *(report.seconds(m["methods"][v]["median_s"]) for v in vectorized),
              *(f"{m['ratios'][r]:.2f}" for r in ratios)] for m in more]))
    return "\n\n".join(parts)


def plot(s: dict, ax_row) -> None:
    """Each method's speed-up over the loop."""
    c = s["cases"][0]  # (the vectorized case at scale is in the text report only)
    cols = report.columns([c], COLUMNS)
    loop = report.baseline(c)
    (ax,) = ax_row
    ax.barh(cols, [loop / c["methods"][m]["median_s"] for m in cols])
    ax.axvline(1, color="black", linewidth=0.8)
    report.log_axis(ax.xaxis)
    ax.set_xlabel("speed-up over the loop (log)")
    ax.set_title(f"{c['case']}")


PLOT_AXES = 1  # the axes, in a row, that plot draws on
