"""Scenario 2: what daskdag costs per node, on DAGs of tiny nodes where that cost is all there is.

Two shapes, each of N nodes (N = 100 to 1,000; 50 and 150 in a quick run), with gradients of one scalar output:

chain:    x -> n0 -> n1 -> ... -> n{N-1},  each ``step(h) = sin(h) + 0.5 * h`` on float32[8],
          the output ``sum`` of the last.
fan_out:  x -> n_i = step(x) for i < N -> out = the sum of all n_i; x's cotangent is the sum of
          N shares.

The same arithmetic five ways, each giving the output's value and gradient:

jax_loop:         in this process, ``jax.vjp`` of each node, then the pullbacks in reverse: the
                  floor, JAX's own eager cost per node.
dask_threads:     a hand-written Dask graph (``dask.task_spec`` tasks) on Dask's threaded
                  scheduler: a forward task per node, and a backward task per node that calls
                  ``jax.vjp`` of the node on its input and pulls its cotangent back. It
                  re-runs the node's (tiny) forward pass instead of receiving a pullback, which is
                  what makes it runnable on any scheduler without daskdag's portable pullbacks.
daskdag_threads:  ``daskdag.compute_grads`` on the threaded scheduler. A stage's nodes share
                  its tasks, and a closed stage's forward task runs its backward pass too:
                  a fan-out's node is one task, a chain one stage (the tasks per node are
                  counted on the cluster, from the scheduler's task stream).
dask_2w:          the hand-written graph on the default 2-worker process ``LocalCluster``
                  (``2w`` in ``common.CLUSTERS``, as a user starts one).
daskdag_2w:       ``compute_grads`` on it.
daskdag_2w_tuned: ``compute_grads`` on the tuned 2-worker cluster (``2w_tuned``: pinned workers,
                  ``MALLOC_TRIM_THRESHOLD_`` unset), a labelled extra, for the smaller N only.

And the schedulers' own floor: ``noop_threads`` and ``noop_2w`` run the hand-written graph's
shape (the same keys and dependencies) with every task a no-op on an int, so what they take is
scheduling alone.

Reported in microseconds per node (median seconds / N), with daskdag's ratio to the hand-written
graph on the same scheduler.

Targets (issue 11): tiny-node chain on distributed, ``daskdag_2w / dask_2w`` <= 1.0 (it was
1.5-1.6), for every chain N; (issue 52) the fan-out's ``daskdag_2w / dask_2w`` <= 1.2 (it was
2.36 at N=1,000), with the tasks per node reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial

import dask.threaded
import jax
import jax.numpy as jnp
from dask.task_spec import DataNode, Task, TaskRef

import daskdag

from .. import common, report
TITLE = "Per-node overhead"
DESCRIPTION = "per-node cost against hand-written Dask graphs"
CLUSTERS = ("2w", "2w_tuned")  # 2w: its *_2w methods; 2w_tuned: daskdag_2w_tuned
RTOL = 1e-5
SHAPES = ("chain", "fan_out")


@dataclass(frozen=True)
class Config:
    nodes: tuple[int, ...]
    reps: int
    tuned_nodes: tuple[int, ...]  # the N that also run daskdag_2w_tuned


FULL = Config(nodes=(100, 300, 1000), reps=5, tuned_nodes=(100, 300))
QUICK = Config(nodes=(50, 150), reps=3, tuned_nodes=(50,))


def step(h):
    return jnp.sin(h) + 0.5 * h


def total(*hs):
    return sum(jnp.sum(h) for h in hs)


def make_dag(shape: str, n: int) -> tuple[dict, str]:
    """The daskdag DAG and its output's name."""
    names = [f"n{i}" for i in range(n)]
    if shape == "chain":
        dag = {name: (step, [prev]) for name, prev in zip(names, ["x"] + names)}
        dag["out"] = (total, [names[-1]])
    else:
        dag = {name: (step, ["x"]) for name in names}
        dag["out"] = (total, names)
    return dag, "out"


# --- The same arithmetic without daskdag --------------------------------------------------------

def _pull(fn, ct, *primals):
    """The cotangents of ``fn``'s inputs: its ``jax.vjp`` taken here, on ``primals``."""
    return jax.vjp(fn, *primals)[1](ct)


def _pull_one(fn, ct, index, primal):
    """``_pull`` of a one-input ``fn``, its cotangent the ``index``-th of ``ct`` (None: ``ct``)."""
    return _pull(fn, ct if index is None else ct[index], primal)[0]


def _sum(*cts):
    return sum(cts)


def hand_written_graph(dag: dict, output: str, x) -> tuple[dict, list]:
    """A plain Dask graph computing ``output``'s value and its gradient with respect to ``x``."""
    g = {"x": DataNode("x", x)}
    for name, (fn, deps) in dag.items():  # the dict is in topological order
        g[f"fwd-{name}"] = Task(f"fwd-{name}", fn, *(_ref(d) for d in deps))
    out_fn, out_deps = dag[output]
    g["seed"] = Task("seed", jnp.ones_like, TaskRef(f"fwd-{output}"))
    g["bwd-out"] = Task("bwd-out", _pull, out_fn, TaskRef("seed"), *(_ref(d) for d in out_deps))
    ct_of = {d: ("bwd-out", i) for i, d in enumerate(out_deps)}  # where each cotangent comes from
    shares = []
    for name in reversed([n for n in dag if n != output]):
        fn, (dep,) = dag[name]
        source, index = ct_of[name]
        g[f"bwd-{name}"] = Task(f"bwd-{name}", _pull_one, fn, TaskRef(source), index, _ref(dep))
        if dep == "x":
            shares.append(TaskRef(f"bwd-{name}"))
        else:
            ct_of[dep] = (f"bwd-{name}", None)
    g["grad"] = Task("grad", _sum, *shares)
    return g, [f"fwd-{output}", "grad"]


def noop_graph(graph: dict) -> dict:
    """``graph``'s keys and dependencies, every task a no-op."""
    return {k: Task(k, _noop, *(TaskRef(d) for d in t.dependencies)) if isinstance(t, Task)
            else DataNode(k, 0) for k, t in graph.items()}


def _noop(*_):
    return 0


def _ref(dep: str) -> TaskRef:
    return TaskRef("x" if dep == "x" else f"fwd-{dep}")


def jax_loop(dag: dict, output: str, x):
    """Forward with ``jax.vjp`` per node, then each pullback once, cotangents summed by hand."""
    values, pullbacks = {"x": x}, {}
    for name, (fn, deps) in dag.items():
        values[name], pullbacks[name] = jax.vjp(fn, *(values[d] for d in deps))
    cts = {output: jnp.ones_like(values[output])}
    for name in reversed(dag):
        for dep, ct in zip(dag[name][1], pullbacks[name](cts.pop(name))):
            cts[dep] = cts[dep] + ct if dep in cts else ct
    return values[output], cts["x"]


def with_compute_grads(dag: dict, output: str, x, client=None):
    r = daskdag.compute_grads(dag, x, output, client=client)
    return r.value, r.grad


def with_dask(graph: dict, keys: list, client=None):
    return tuple(dask.threaded.get(graph, keys) if client is None else client.get(graph, keys))


def methods(shape: str, n: int, client, tuned=None) -> dict:
    """The methods; ``client`` the default 2-worker cluster's, ``tuned`` (if any) the tuned
    one's."""
    dag, output = make_dag(shape, n)
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    graph, keys = hand_written_graph(dag, output, x)
    noop = noop_graph(graph)
    runs = {"noop_threads": partial(with_dask, noop, keys),
            "noop_2w": partial(with_dask, noop, keys, client),
            "jax_loop": partial(jax_loop, dag, output, x),
            "dask_threads": partial(with_dask, graph, keys),
            "daskdag_threads": partial(with_compute_grads, dag, output, x),
            "dask_2w": partial(with_dask, graph, keys, client),
            "daskdag_2w": partial(with_compute_grads, dag, output, x, client)}
    if tuned is not None:
        runs["daskdag_2w_tuned"] = partial(with_compute_grads, dag, output, x, tuned)
    return runs


RATIOS = {"daskdag_threads/dask_threads": ("daskdag_threads", "dask_threads"),
          "daskdag_2w/dask_2w": ("daskdag_2w", "dask_2w"),
          "daskdag_2w_tuned/dask_2w": ("daskdag_2w_tuned", "dask_2w"),
          "daskdag_threads/jax_loop": ("daskdag_threads", "jax_loop"),
          "dask_threads/jax_loop": ("dask_threads", "jax_loop")}


def tasks_per_node(fn, client, n: int) -> float:
    """The tasks the scheduler ran for one call of ``fn`` (its task stream), per node."""
    import distributed

    with distributed.get_task_stream(client) as stream:
        fn()
    return len(stream.data) / n


def run(quick: bool, clients: dict) -> dict:
    cfg = QUICK if quick else FULL
    cases = []
    for shape in SHAPES:
        for n in cfg.nodes:
            label = f"{shape} N={n}: "
            print(f"{TITLE}, {label}", flush=True)
            runs = methods(shape, n, clients["2w"],
                           clients.get("2w_tuned") if n in cfg.tuned_nodes else None)
            out = {name: common.timed(fn)[1] for name, fn in runs.items()}  # warm-up
            diffs = {name: common.worst_difference(got, out["jax_loop"]) for name, got in out.items()
                     if not name.startswith("noop")}
            if max(diffs.values()) > RTOL:
                raise AssertionError(f"{label}: disagrees with jax_loop beyond {RTOL}: {diffs}")
            times = common.interleaved(runs, cfg.reps, label)
            c = common.case(f"{shape}, N={n}", {"shape": shape, "nodes": n}, times, RATIOS,
                            max_rel_diff_vs_jax_loop=diffs)
            for m in c["methods"].values():
                m["us_per_node"] = m["median_s"] / n * 1e6
            c["tasks_per_node"] = {name: tasks_per_node(runs[name], clients["2w"], n)
                                   for name in ("daskdag_2w", "dask_2w")}
            cases.append(c)
    wanted = [{"case": f"chain, N={n}", "ratio": "daskdag_2w/dask_2w", "op": "<=", "bound": 1.0,
               "was": "1.5-1.6", "source": "issue 11"} for n in cfg.nodes]
    wanted += [{"case": f"fan_out, N={n}", "ratio": "daskdag_2w/dask_2w", "op": "<=",
                "bound": 1.2, "was": "2.36", "source": "issue 52"} for n in cfg.nodes]
    return {"title": TITLE, "config": asdict(cfg), "cases": cases,
            "targets": common.targets(cases, wanted)}


# --- Its report (benchmarks/report.py draws the rest) ---------------------------------------------

# Its methods in the order its table and plot show them.
COLUMNS = ("noop_threads", "noop_2w", "jax_loop", "dask_threads", "daskdag_threads", "dask_2w",
           "daskdag_2w", "daskdag_2w_tuned")


def section(s: dict) -> str:
    """Microseconds per node, a column per method, then the ratios to the hand-written graph."""
    cases = s["cases"]
    cols = report.columns(cases, COLUMNS)
    ratios = [r for r in ("daskdag_threads/dask_threads", "daskdag_2w/dask_2w",
                          "daskdag_2w_tuned/dask_2w") if any(r in c["ratios"] for c in cases)]

    def cell(c, m):
        return f"{c['methods'][m]['us_per_node']:.0f}" if m in c["methods"] else "–"

    tasks = [m for m in ("daskdag_2w", "dask_2w")
             if any(m in c.get("tasks_per_node", {}) for c in cases)]
    rows = [[c["case"]] + [cell(c, m) for m in cols]
            + [f"{c['ratios'][r]:.2f}" if r in c["ratios"] else "–" for r in ratios]
            + [f"{c['tasks_per_node'][m]:.2f}" if m in c.get("tasks_per_node", {}) else "–"
               for m in tasks]
            for c in cases]
    head = (f"Microseconds per node (median of {s['config']['reps']} runs / N) for one scalar "
            f"output's value and gradient; `dask_*` is the same arithmetic as a hand-written "
            f"Dask graph, `noop_*` that graph's shape with tasks that do nothing: the "
            f"scheduler's own cost. `daskdag_2w/dask_2w` is the tiny-node chain's headline on "
            f"distributed. `tasks/node`: the tasks the scheduler ran for one call (its task "
            f"stream), per node.")
    return head + "\n\n" + report.table(["case", *cols, *ratios,
                                          *(f"tasks/node {m}" for m in tasks)], rows)


def plot(s: dict, ax_row) -> None:
    """Microseconds per node against N, one axes per shape."""
    for ax, shape in zip(ax_row, ("chain", "fan_out")):
        mine = [c for c in s["cases"] if c["params"]["shape"] == shape]
        for m in report.columns(mine, COLUMNS):
            have = [c for c in mine if m in c["methods"]]
            ax.plot([c["params"]["nodes"] for c in have],
                    [c["methods"][m]["us_per_node"] for c in have], marker="o", label=m,
                    color=report.color(m, COLUMNS))
        report.log_axis(ax.xaxis)
        report.log_axis(ax.yaxis)
        ax.set_xlabel("nodes")
        ax.set_ylabel("µs per node (log)")
        ax.set_title(shape)
    ax_row[-1].legend(fontsize=8)


PLOT_AXES = 2  # the axes, in a row, that plot draws on
