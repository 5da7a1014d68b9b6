"""Scenario 4, portable pullbacks: the cost per node of a backward pass run in another process
than its forward.

A node's :class:`~daskdag.rules.vjp.Pullback` is normally called in the worker that ran the node's
forward pass. When Dask runs the backward task elsewhere, the pullback travels: daskdag exports
its backward program (``jax.export``), ships it with the residual arrays that are not the node's
own inputs, and the receiver compiles the program, once per program and process. This measures
what that costs per node, for a few node kinds:

  elementwise_1k   ``sin(x) * exp(x / 3)``, x float32[1024]: small residuals, little work.
  matvec_1k        ``tanh(w @ x)``, w float32[1024, 1024] a non-differentiated input: its
                   largest residual is w itself, which stays behind.
  matmul_sum       ``sum(tanh(w @ X))``, X float32[1024, 256], w as above: residuals are large
                   intermediates (1 MiB each), besides w.
  closure_matvec   ``tanh(w @ x)`` with w closed over by the node function, not an input.

In this process, medians over the repetitions (after one warm-up repetition):

  local_call            ``pb(ct, inputs)`` where the forward ran: the baseline (its second call,
                        as the first compiles JAX's eager operations for new shapes).
  serialize_first       ``distributed.protocol.serialize(pb)``, exporting a program new to this
                        process; serialize_cached: the same pullback again (export cache hit).
  deserialize_first     ``deserialize`` compiling the program; call_after_first: the call after.
  deserialize_cached    ``deserialize`` hitting the compile cache; call_cached: the call after.
  bytes                 shipped (sum of the frames), the residuals, the residuals that are not
                        the node's inputs (found with plain ``jax.vjp``), the exported program,
                        and the node function pickled.

``daskdag.programs`` caches exports and compilations per program key in-process, and keeps no
public way to clear them. The key hashes the backward program's structure and shapes, not its
constants (a Python float in the function becomes a residual), so repetition ``k`` (from 1)
grows one dimension of the node's arrays by ``k`` (at most 2.1 % of 1024 in the full run), which
makes a new key; each repetition checks, with ``programs.stats()``, that its first serialize
exported, its first deserialize compiled and its second one hit the cache.

Deserializing here skips the copy a transfer between processes makes, so the node is also run
on the default two-worker process ``LocalCluster`` (``2w`` in ``common.CLUSTERS``) as
a one-node DAG, three ways per repetition, timed from submission to results in this process:

  one_step     ``client.compute(graph, workers=[a])``: no move.
  same_2step   forward keys computed on worker a first, then the rest on a: no move, but the two
               submissions a forced move needs.
  moved        forward keys on a, then the rest on b, so the backward task on b fetches the
               pullback from a (``tests/conftest.py::compute_split``).

Each repetition perturbs the differentiated input, so its keys are new and nothing is reused
from the previous one; the node function and shapes stay the same, so b compiles its backward
program in the first (warm-up) moved call only, which is reported apart. Before it, each worker
runs the graph once unmoved, untimed, so the warm-up moved call adds only that compilation.
The warm-up calls check placement and gradients.

"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Callable

import cloudpickle
import dask
import distributed
import jax
import jax.numpy as jnp
import numpy as np
from distributed.protocol import deserialize, serialize

from daskdag import Node
from daskdag.transport import programs
from daskdag.graph.build import GradientSeeding, build
from daskdag.model.request import prepare
from daskdag.model.plan import ship
from daskdag.graph.assembly import kind_of
from daskdag.transport.transports import LAZY
from daskdag.rules.vjp import linearize

from .. import common, report


def build_graph(dag, x, outputs, *, wrt=None, cotangents=None):
    """A call's spec, plan and graph (``{output: (value, {input: grad})}`` of ``Delayed``), as
    daskdag builds it for a lazy call, without computing it."""
    request = prepare(dag, x, outputs, wrt, cotangents)
    plan = ship(request.plan, LAZY)
    return request.spec, plan, build(plan, request.values, GradientSeeding(request.cotangents),
                                     LAZY)


TITLE = "Portable pullbacks"
DESCRIPTION = "pullbacks moved between processes"
CLUSTERS = ("2w", "2w_tuned")  # moved / one_step on 2w (2w_tuned: up, unused)
RATIO_NOTE = "portable's `shipped/...` are ratios of bytes"  # (the report's ratio rule)
N = 1024  # the arrays' base size
GROWTH = 32  # the most rows or columns a repetition adds (see make_base)
RTOL = 1e-4  # moved pullbacks' results against the local ones
MODES = {"one_step": (None, 0), "same_2step": (0, 0), "moved": (0, 1)}  # (forward on, rest on)


@dataclass(frozen=True)
class Config:
    reps: int  # timed repetitions in this process, after one warm-up
    cluster_reps: int  # timed repetitions of each cluster mode, after one warm-up


FULL = Config(reps=20, cluster_reps=15)
QUICK = Config(reps=5, cluster_reps=5)


# --- Node kinds --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    name: str
    what: str
    wrt: str  # the one differentiated dep
    make: Callable[[int, dict], tuple[Callable, dict]]  # (k, base) -> (node fn, {dep: value})

    def node(self, k: int, base: dict) -> tuple[Node, dict]:
        """The node of repetition ``k >= 1`` and its input values: a program new to this kind."""
        if not 1 <= k <= GROWTH:
            raise ValueError(f"repetition {k} outside 1..{GROWTH}")
        fn, values = self.make(k, base)
        return Node(fn, tuple(values)), values


def _elementwise(k, base):
    return (lambda x: jnp.sin(x) * jnp.exp(x / 3)), {"x": base["x"][:N + k]}


def _matvec(k, base):  # grows w's rows: w is taller than wide
    return (lambda x, w: jnp.tanh(w @ x)), {"x": base["x"][:N], "w": base["w"][:N + k, :N]}


def _matmul_sum(k, base):
    return (lambda X, w: jnp.sum(jnp.tanh(w @ X))), {"X": base["X"], "w": base["w"][:N + k, :N]}


def _closure_matvec(k, base):  # grows w's columns, so no program is _matvec's
    w = base["w"][:N, :N + k]
    return (lambda x: jnp.tanh(w @ x)), {"x": base["x"][:N + k]}


KINDS = (
    Kind("elementwise_1k", "sin(x) * exp(x / 3), x f32[1024]", "x", _elementwise),
    Kind("matvec_1k", "tanh(w @ x), w f32[1024,1024] a non-differentiated input", "x", _matvec),
    Kind("matmul_sum", "sum(tanh(w @ X)), X f32[1024,256], w f32[1024,1024] a "
         "non-differentiated input", "X", _matmul_sum),
    Kind("closure_matvec", "tanh(w @ x), w f32[1024,1024] closed over by the function",
         "x", _closure_matvec),
)


def make_base(seed: int = 0) -> dict:
    """Arrays ``GROWTH`` larger than ``N`` where a kind grows them; kinds take slices."""
    rng = np.random.default_rng(seed)
    m = N + GROWTH
    return {"x": jnp.asarray(rng.standard_normal(m, np.float32)),
            "w": jnp.asarray(rng.standard_normal((m, m), np.float32) / np.sqrt(N)),
            "X": jnp.asarray(rng.standard_normal((N, 256), np.float32))}


def active(kind: Kind, values: dict) -> tuple[bool, ...]:
    return tuple(d == kind.wrt for d in values)


def cotangent(primal):
    return jnp.ones_like(primal)


# --- In this process ---------------------------------------------------------------------------

def one_rep(kind: Kind, k: int, base: dict) -> dict[str, float]:
    """Repetition ``k``'s pullback: called here, serialized twice, deserialized twice, each copy
    called."""
    node, values = kind.node(k, base)
    inputs = tuple(values.values())
    primal, pb = linearize(node, inputs, active(kind, values))
    ct = tuple(jax.tree.leaves(cotangent(primal)))  # a pullback takes the output's leaves
    t = {}
    before = programs.stats()
    pb(ct, inputs)  # compiles JAX's eager ops for this repetition's new shapes
    t["local_call"], expected = common.timed(pb, ct, inputs)
    t["serialize_first"], (header, frames) = common.timed(serialize, pb)
    t["serialize_cached"], _ = common.timed(serialize, pb)
    t["deserialize_first"], first = common.timed(deserialize, header, frames)
    t["call_after_first"], _ = common.timed(first, ct, inputs)
    t["deserialize_cached"], cached = common.timed(deserialize, header, frames)
    t["call_cached"], got = common.timed(cached, ct, inputs)
    counts = {key: programs.stats()[key] - before[key] for key in before}
    if counts != {"exported": 1, "compiled": 1, "cache_hits": 1}:
        raise RuntimeError(f"{kind.name}, repetition {k}: expected one export, one compilation and "
                           f"one cache hit, got {counts}")
    assert_close(kind.name, got, expected)
    return t


def assert_close(name: str, got, expected) -> None:
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=RTOL, atol=1e-6, err_msg=name)


def plain_vjp(node: Node, kind: Kind, values: dict):
    """``(primal, vjp_fn)`` of plain ``jax.vjp`` with respect to ``kind.wrt`` alone."""
    def of_wrt(v):
        return node.fn(*(v if d == kind.wrt else values[d] for d in values))

    return jax.vjp(of_wrt, values[kind.wrt])


def nbytes(kind: Kind, k: int, base: dict) -> dict[str, int]:
    """Bytes a serialized pullback ships, against its residuals (found with plain ``jax.vjp``:
    its function's leaves) and those of them that are not the node's inputs."""
    node, values = kind.node(k, base)
    _, pb = linearize(node, tuple(values.values()), active(kind, values))
    _, frames = serialize(pb)
    residuals = jax.tree.leaves(plain_vjp(node, kind, values)[1])
    input_ids = {id(v) for v in values.values()}
    return {"shipped": sum(memoryview(f).nbytes for f in frames),
            "residuals": pb.residual_nbytes(),
            "residuals_plain_vjp": sum(r.nbytes for r in residuals),
            "residuals_not_inputs": sum(r.nbytes for r in residuals if id(r) not in input_ids),
            "program": len(pb.portable().get("program", b"")),
            "node_pickled": len(cloudpickle.dumps(node))}


def measure_in_process(kind: Kind, base: dict, reps: int) -> dict:
    samples = [one_rep(kind, k, base) for k in range(1, reps + 2)][1:]  # the first warms up
    times = {key: [s[key] for s in samples] for key in samples[0]}
    return {"times_s": times, "median_s": {key: statistics.median(v) for key, v in times.items()},
            "bytes": nbytes(kind, reps + 2, base)}


# --- On a two-worker cluster -------------------------------------------------------------------

def run_graph(client, node: Node, kind: Kind, values: dict, fwd_on, rest_on, watch=False):
    """``(seconds, {output: (value, grads)}, {key: worker} or None)`` for the one-node DAG.

    With ``fwd_on``, its forward keys are computed there first and held, then the whole graph
    on ``rest_on``, which reuses them; else the whole graph on ``rest_on`` at once.
    """
    primal = node.fn(*values.values())
    cts = {"N": cotangent(primal)} if jnp.ndim(primal) else None
    x = next(iter(values.values())) if len(values) == 1 else values
    _, _, graph = build_graph({"N": node}, x, ["N"], wrt=[kind.wrt], cotangents=cts)
    dsk = dict(dask.delayed(graph).__dask_graph__())
    fwd_keys = [key for key in dsk if kind_of(key) in ("fwd", "val")]
    with (distributed.get_task_stream(client) if watch else nullcontext()) as stream:
        start = time.perf_counter()
        if fwd_on is not None:
            held = client.get(dsk, fwd_keys, workers=[fwd_on], sync=False)
            with client.as_current():
                distributed.wait(held)
        (computed,) = client.compute([graph], workers=[rest_on], sync=True)
        seconds = time.perf_counter() - start
    return seconds, computed, {t["key"]: t["worker"] for t in stream.data} if watch else None


def check_placement(mode: str, ran: dict, fwd_on, rest_on) -> None:
    where = {phase: {w for key, w in ran.items() if kind_of(key) == phase}
             for phase in ("fwd", "bwd")}
    want = {"fwd": {fwd_on or rest_on}, "bwd": {rest_on}}
    if where != want:
        raise RuntimeError(f"{mode}: tasks ran on {where}, expected {want}")


def placed(mode: str, workers: list) -> tuple:
    """``(forward on, rest on)`` worker addresses of a mode."""
    f, r = MODES[mode]
    return (None if f is None else workers[f]), workers[r]


def warm_up(client, node: Node, kind: Kind, values: dict, workers: list) -> dict[str, float]:
    """Each mode once, its placement and gradient checked against plain ``jax.vjp``; seconds per
    mode. Every worker first runs the whole graph once, untimed, so that the moved call's time
    adds to the others' only the compilation of the backward program on b."""
    primal, vjp_fn = plain_vjp(node, kind, values)
    (expected,) = vjp_fn(cotangent(primal))
    for worker in workers:  # JAX's eager operations compiled for these shapes, everywhere
        run_graph(client, node, kind, values, None, worker)
    first = {}
    for mode in MODES:
        fwd_on, rest_on = placed(mode, workers)
        first[mode], computed, ran = run_graph(client, node, kind, values, fwd_on, rest_on,
                                               watch=True)
        check_placement(mode, ran, fwd_on, rest_on)
        assert_close(f"{kind.name} {mode}", computed["N"][1][kind.wrt], expected)
    return first


def measure_cluster(client, kind: Kind, base: dict, reps: int) -> dict:
    workers = common.workers(client)
    b = placed("moved", workers)[1]
    node, values = kind.node(1, base)  # b has compiled nothing yet
    before = client.run(programs.stats, workers=[b])[b]
    first = warm_up(client, node, kind, values, workers)
    times = {mode: [] for mode in MODES}
    names = list(MODES)
    for rep in range(1, reps + 1):
        perturbed = {**values, kind.wrt: values[kind.wrt] + rep / 1024}  # new keys, same program
        for mode in names[rep % len(names):] + names[:rep % len(names)]:
            times[mode].append(run_graph(client, node, kind, perturbed, *placed(mode, workers))[0])
    after = client.run(programs.stats, workers=[b])[b]
    medians = {mode: statistics.median(ts) for mode, ts in times.items()}
    return {"times_s": times, "median_s": medians, "first_s": first,
            "programs_on_b": {key: after[key] - before[key] for key in ("compiled", "cache_hits")},
            "ratios": {"moved/one_step": medians["moved"] / medians["one_step"],
                       "moved/same_2step": medians["moved"] / medians["same_2step"]}}


# --- Reporting ---------------------------------------------------------------------------------

RATIOS = {  # label: (numerator, denominator), of median seconds or of bytes
    "ser 1st/local": (("serialize_first",), ("local_call",)),
    "ser hit/local": (("serialize_cached",), ("local_call",)),
    "des+call 1st/local": (("deserialize_first", "call_after_first"), ("local_call",)),
    "des+call hit/local": (("deserialize_cached", "call_cached"), ("local_call",)),
    "call hit/local": (("call_cached",), ("local_call",)),
    "shipped/residual": (("shipped",), ("residuals",)),
    "shipped/not input": (("shipped",), ("residuals_not_inputs",)),
}


def ratios(m: dict) -> dict[str, float]:
    values = {**m["median_s"], **m["bytes"]}
    return {label: sum(values[k] for k in num) / sum(values[k] for k in den)
            for label, (num, den) in RATIOS.items()}


def run(quick: bool, clients: dict) -> dict:
    cfg = QUICK if quick else FULL
    base = make_base()
    cases = []
    for kind in KINDS:
        print(f"{TITLE}, {kind.name}: {kind.what}", flush=True)
        m = measure_in_process(kind, base, cfg.reps)
        cluster = measure_cluster(clients["2w"], kind, base, cfg.cluster_reps)
        cases.append({"case": kind.name, "params": {"what": kind.what},
                      "methods": {k: {"times_s": t, "median_s": m["median_s"][k]}
                                  for k, t in m["times_s"].items()},
                      "ratios": {**ratios(m), **cluster["ratios"]},
                      "bytes": m["bytes"], "cluster": cluster})
    return {"title": TITLE, "config": {**asdict(cfg), "cluster_modes": {
                m: {"forward_on": f, "rest_on": r} for m, (f, r) in MODES.items()}},
            "cases": cases}


# --- Its report (benchmarks/report.py draws the rest) ---------------------------------------------

def section(s: dict) -> str:
    """A row per kind of node: times in this process, bytes shipped, the cluster's ratios."""
    cases = s["cases"]
    head = ("A pullback serialized in one process and called in another: median times in this "
            "process, bytes shipped against the residuals, and on the default 2-worker cluster "
            "(`2w`) a one-node DAG whose backward task runs on the other worker (`moved`) "
            "against the same DAG on one worker (`one_step`); the receiving worker compiles "
            "each backward program once and then finds it in its cache.")
    rows = []
    for c in cases:
        t = {k: v["median_s"] for k, v in c["methods"].items()}
        b = c["bytes"]
        rows.append([c["case"], report.seconds(t["local_call"]),
                     report.seconds(t["serialize_first"]), report.seconds(t["serialize_cached"]),
                     report.seconds(t["deserialize_first"] + t["call_after_first"]),
                     report.seconds(t["deserialize_cached"] + t["call_cached"]),
                     f"{b['shipped'] / 1024:.1f}", f"{b['residuals'] / 1024:.1f}",
                     f"{c['ratios']['shipped/residual']:.2f}",
                     f"{c['ratios']['moved/one_step']:.2f}",
                     "{compiled} / {cache_hits}".format(**c["cluster"]["programs_on_b"])])
    return head + "\n\n" + report.table(
        ["kind", "local call", "serialize (export)", "serialize (cached)",
         "deserialize+call (compile)", "deserialize+call (cached)", "shipped KiB",
         "residuals KiB", "shipped/residual", "moved/one_step", "compiled / cache hits"], rows)


def plot(s: dict, ax_row) -> None:
    """Each kind's local call against serializing and calling elsewhere."""
    cases = s["cases"]
    bars = {"local call": lambda t: t["local_call"],
            "deserialize+call (cached)": lambda t: t["deserialize_cached"] + t["call_cached"],
            "deserialize+call (compile)": lambda t: t["deserialize_first"] + t["call_after_first"],
            "serialize (export)": lambda t: t["serialize_first"]}
    (ax,) = ax_row
    width = 0.8 / len(bars)
    for j, (label, f) in enumerate(bars.items()):
        ys = [f({k: v["median_s"] * 1e3 for k, v in c["methods"].items()}) for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], ys, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], [c["case"] for c in cases])
    report.log_axis(ax.yaxis)
    ax.set_ylabel("ms (log)")
    ax.legend(fontsize=8)


PLOT_AXES = 1  # the axes, in a row, that plot draws on
