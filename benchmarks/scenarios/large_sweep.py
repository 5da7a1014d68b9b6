"""Scenario: a sweep of large items on default clusters, against the machine's own limit.

    python -m benchmarks.scenarios.large_sweep [--quick]

Workload: the DAG of ``benchmarks/scenarios/sweeps.py`` (eager nodes, ``tanh`` of matmuls, a
Python branch on a value, two scalar outputs, gradients with respect to ``x``) over N items of x
float32[400, 256] (400 KB each; N = 96, 24 with ``--quick``), w float32[256, 256] shared.
``sweep_grads`` runs with its default chunk size, as a user calls it.

Methods, timed interleaved (each rep starts at the next method), compared by median:

- loop:           ``sweeps.loop``, the hand-written ``jax.vjp`` loop, in this process.
- two_processes:  two plain Python processes, started (and warmed up) once before timing; per
                  rep each runs ``sweeps.loop`` over its half of the items, triggered over a
                  pipe; the time is until both have finished. This is what this machine can
                  do with the workload on two processes: the limit the 2-worker sweep is
                  measured against.
- sweep_1w:       ``sweep_grads(..., client=)`` on ``LocalCluster(n_workers=1,
                  threads_per_worker=1, processes=True)``, distributed's defaults otherwise
                  (no dashboard; daskdag's worker plugin registers itself on the first call).
- sweep_2w:       the same with two workers.
- worker_loop:    ``sweeps.loop`` over all items inside the 1-worker cluster's worker process
                  (``client.run``): a diagnostic, the worker process's own speed without
                  daskdag's data path.

Ratios: ``loop/sweep_1w`` (target 0.9), the limit ``loop/two_processes``, and every cluster
figure as a fraction of the limit, ``two_processes/sweep_2w`` (target 0.85) and
``two_processes/sweep_1w``.

XLA: left as it comes, the same in every process. jaxlib 0.10's CPU runtime cannot be made
single-threaded by a flag: with ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false`` the loop still
used 1.5 CPU-seconds per second, 0.85 of them in its two ``tf_XLAEigen`` threads; only pinning a
process to one core does, and a default cluster does not pin its workers. So every process here
(the loop, the two plain processes, the workers) runs XLA with its default thread pool.

Where the time goes (``profile`` below: ``distributed.get_task_stream``, the workers' fine
performance metrics, the task bytes the scheduler received, CPU seconds per process; plus
``cProfile`` of the client and of a chunk run in-process. ``performance_report`` needs bokeh,
which is not installed here, so its figures were read from these same sources). Figures from
full runs (96 items) on the 2-core machine while other users loaded it (load average 6 to 14):
wall-clock times swung by 2x between reps, so the byte counts and CPU seconds are the figures
to trust, the ratios less so.

Before (a chunk's items packed into its task graph, cloudpickled into the task's arguments,
sent through the scheduler, which unpickles and forwards them; results gathered through the
scheduler as JAX arrays, turned back into JAX arrays on the client, then copied into the
stacked NumPy outputs, which had first been filled with NaN):

- the scheduler received 39.6 MB of task graphs per sweep (the whole of x, 9.6 MB, plus
  pickling copies), its largest task 9.8 MB (a 24-item chunk, 1 worker) or 4.9 MB (12 items,
  2 workers); every result (19 MB per 24-item chunk) came back through it too;
- CPU seconds, 1w / 2w: this process (client, and the LocalCluster's scheduler and nannies)
  0.74 / 0.74, the workers 4.70 / 5.18, the loop 4.23 / 4.35 for the same items;
- workers busy 0.96 (1w) / 0.89 (2w) of the wall time.

After (items scattered straight to the chunk's worker, ``Client.scatter(direct=True)``; the
task holds their keys; results returned as NumPy and gathered straight from the worker,
``Client.gather(direct=True)``, copied once into outputs allocated uninitialised):

- the scheduler received 0.30 MB of task graphs per sweep, its largest task 262 KB: the shared
  weight w, placed once per sweep; no result passes through it;
- CPU seconds, 1w / 2w: this process 0.78 / 0.68, the workers 5.26 / 5.33, the loop 4.64 / 4.89
  (the same run's loop, under more load); workers busy 0.98 / 0.92 of the wall time.

What was left was in the workers' task, not the data path: a chunk run with Dask's synchronous
scheduler in one process took 1.10 to 1.17 times the loop's CPU time over the same 12 items,
about half of it in ``daskdag.chunked``'s ``stack``/``unstack`` (each item-by-item node stacked
its items' results into one array, and the next node split it again: two copies of every
intermediate and cotangent, 8 % of the task's time under cProfile), and the two outputs'
cotangents pulled back together under ``jax.vmap``, which traces eager pullbacks anew on
every call; a worker process's own loop (``worker_loop``) runs at 0.96 to 1.07 of this
process's loop. The client's share (slicing, packing, scattering, building and pickling each
chunk's graph, gathering, storing) was 0.2 s of main-thread CPU per 96-item sweep, plus 0.3 s
in the event-loop thread that the client shares with the LocalCluster's scheduler.

Since then: item-by-item nodes pass their values on unstacked (``chunked.Items``); two
outputs' cotangents are pulled back one by one (``tasks.BATCH_FROM``); a sweep's chunk graph is
built and pickled once, not per chunk, and scattered items are not hashed. A 24-item chunk in
one process went from 1.20 to 1.02 to 1.09 times the loop's time; on the cluster, see the
report.

The figures of one run (the last, full mode; load average 0.6 at its start, 6 at its end:
reps 4 and 5 ran 1.5x slower), medians: loop 2.91 s, two_processes 2.88 s, sweep_1w 3.32 s,
sweep_2w 2.97 s, worker_loop 2.79 s. loop/sweep_1w 0.88 (0.87 to 0.90 in the three quiet
reps), the limit loop/two_processes 1.01, two_processes/sweep_2w 0.97, two_processes/sweep_1w
0.87. The limit is far below the issue's 1.57: each unpinned process's XLA wants about 1.5
cores, so two of them had no second core to gain from. Same run's profile: scheduler received
0.30 MB per sweep; CPU seconds 1w / 2w, this process 0.68 / 0.59, workers 4.94 / 5.15, loop
4.48 / 4.60. Earlier runs under heavy load (6 to 14): loop/sweep_1w 0.90 and 0.61,
two_processes/sweep_2w 1.20 and 0.89; the same code before this change, under load 6 to 9:
loop/sweep_1w 0.82, two_processes/sweep_2w 1.19.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing
import time
from dataclasses import asdict, dataclass

import distributed
import numpy as np
from distributed.diagnostics.plugin import SchedulerPlugin

from .. import common
from . import sweeps
TITLE = "Large-item sweep"
DESCRIPTION = "a sweep of large items against two plain processes"
CLUSTERS = ("1w", "2w", "2w_tuned")  # sweep_1w, sweep_2w (2w_tuned: up, unused)
TARGETS = (("loop/sweep_1w", 0.9, "0.61"), ("two_processes/sweep_2w", 0.85, "0.44"))  # issue 11
RTOL = 1e-4
RATIOS = {"loop/sweep_1w": ("loop", "sweep_1w"),
          "loop/two_processes": ("loop", "two_processes"),  # the limit
          "two_processes/sweep_2w": ("two_processes", "sweep_2w"),
          "two_processes/sweep_1w": ("two_processes", "sweep_1w"),
          "loop/sweep_2w": ("loop", "sweep_2w"),
          "loop/worker_loop": ("loop", "worker_loop")}


@dataclass(frozen=True)
class Config:
    items: int
    rows: int = 400
    width: int = 256
    reps: int = 5

    def sweep_config(self) -> sweeps.Config:
        return sweeps.Config(items=self.items, rows=self.rows, width=self.width, reps=self.reps,
                             chunk_size=0)


FULL = Config(items=96, reps=5)
QUICK = Config(items=24, reps=3)


# --- two plain processes ---------------------------------------------------------------------

def _half(conn, cfg: Config, part: int) -> None:
    """In a plain process: make the inputs, keep half the items, warm up, then run the loop
    over them each time the parent says go (None: stop)."""
    inputs = sweeps.make_inputs(cfg.sweep_config())
    half = {"x": inputs["x"][part::2], "w": inputs["w"]}
    sweeps.loop(half)
    conn.send("ready")
    while conn.recv() is not None:
        sweeps.loop(half)
        conn.send("done")


class TwoProcesses:
    """Two plain processes, each running half the loop per call; started once."""

    def __init__(self, cfg: Config):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for part in (0, 1):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_half, args=(there, cfg, part), daemon=True)
            proc.start()
            self.conns.append(here)
            self.procs.append(proc)
        for conn in self.conns:
            assert conn.recv() == "ready"

    def __call__(self):
        for conn in self.conns:
            conn.send("go")
        for conn in self.conns:
            assert conn.recv() == "done"

    def close(self):
        for conn, proc in zip(self.conns, self.procs):
            with contextlib.suppress(OSError):
                conn.send(None)
            proc.join(30)
            if proc.is_alive():
                proc.kill()


# --- clusters and the worker's own loop --------------------------------------------------------

@contextlib.contextmanager
def default_client(n_workers: int):
    """A client of a default process LocalCluster of ``n_workers`` single-threaded workers."""
    with distributed.LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as local, \
            distributed.Client(local, set_as_default=False) as client:
        client.wait_for_workers(n_workers, timeout=120)
        yield client


def _worker_setup(cfg: Config, dask_worker=None):
    dask_worker._large_sweep_inputs = sweeps.make_inputs(cfg.sweep_config())
    sweeps.loop(dask_worker._large_sweep_inputs)  # warm-up


def _worker_loop(dask_worker=None):
    sweeps.loop(dask_worker._large_sweep_inputs)


# --- profiling -------------------------------------------------------------------------------

def _metrics(client) -> dict:
    return client.run_on_scheduler(lambda dask_scheduler: dict(dask_scheduler.cumulative_worker_metrics))


class TaskSizes(SchedulerPlugin):
    """On the scheduler: the pickled size of each task it received (its run_spec)."""

    name = "large-sweep-task-sizes"

    def __init__(self):
        self.sizes = []

    def update_graph(self, scheduler, *, keys, **kwargs):
        import pickle
        for key in keys:
            ts = scheduler.tasks.get(key)
            if ts is not None and ts.run_spec is not None:
                self.sizes.append(len(pickle.dumps(ts.run_spec, protocol=5)))


def _sizes(dask_scheduler, name=TaskSizes.name):
    sizes = dask_scheduler.plugins[name].sizes
    out = list(sizes)
    sizes.clear()
    return out


def _cpu() -> float:
    return time.process_time()


def profile(client, inputs: dict, dag: dict) -> dict:
    """One more sweep, under the task stream: wall time; CPU seconds of this process (which
    also runs the LocalCluster's scheduler and nannies) and of the workers, beside the loop's
    own; the workers' busy fraction (task compute time / wall time per worker) and their fine
    metrics by activity (seconds); the task graph bytes the scheduler received."""
    cpu = time.process_time()
    sweeps.loop(inputs)
    loop_cpu = time.process_time() - cpu
    if TaskSizes.name not in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins)):
        client.register_plugin(TaskSizes(), name=TaskSizes.name)
    client.run_on_scheduler(_sizes)
    time.sleep(0.5)
    before, workers_before = _metrics(client), client.run(_cpu)
    wall, cpu = time.perf_counter(), time.process_time()
    with client.as_current(), distributed.get_task_stream(client=client) as stream:
        sweeps.with_sweep(inputs, dag, None, client)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    workers_cpu = sum(t - workers_before[a] for a, t in client.run(_cpu).items())
    sizes = client.run_on_scheduler(_sizes)
    time.sleep(2.5)  # the metrics come with the workers' heartbeats
    after = _metrics(client)
    actions = collections.defaultdict(float)
    for task in stream.data:
        for span in task["startstops"]:
            actions[span["action"]] += span["stop"] - span["start"]
    fine = collections.defaultdict(float)
    for key, value in after.items():
        delta = value - before.get(key, 0)
        if isinstance(key, tuple) and key[-1] == "seconds" and delta:
            # ("execute", prefix, activity, "seconds") or (context, activity, "seconds")
            fine[" ".join(str(k) for k in (key[:1] + key[2:-1] if key[0] == "execute" else key[:-1]))] += delta
    n = len(client.scheduler_info()["workers"])
    return {"wall_s": wall, "tasks": len(stream.data),
            "cpu_s": {"loop": loop_cpu, "client_and_scheduler": cpu, "workers": workers_cpu},
            "busy_fraction": actions["compute"] / (wall * n),
            "task_stream_s": dict(actions),
            "scheduler_received_bytes": sum(sizes), "largest_task_bytes": max(sizes, default=0),
            "fine_metrics_s": {k: round(v, 3) for k, v in sorted(fine.items(), key=lambda kv: -kv[1])}}


# --- the scenario ------------------------------------------------------------------------------

def _check(got: dict, ref: dict) -> dict:
    pairs = [(got[o][k], ref[o][k]) for o in sweeps.OUTPUTS for k in (0, 1)]
    return {"allclose": all(g.shape == r.shape and np.allclose(g, r, rtol=RTOL, atol=RTOL * np.abs(r).max())
                            for g, r in pairs),
            "numpy": all(type(g) is np.ndarray for g, _ in pairs)}


def run(quick: bool, clients: dict) -> dict:
    cfg = QUICK if quick else FULL
    print(f"{TITLE}: N={cfg.items} items of x float32[{cfg.rows}, {cfg.width}]", flush=True)
    inputs, dag = sweeps.make_inputs(cfg.sweep_config()), sweeps.make_dag()
    with contextlib.ExitStack() as stack:
        own = {k: stack.enter_context(default_client(n)) for k, n in (("1w", 1), ("2w", 2))
               if k not in clients}
        c1, c2 = {**clients, **own}["1w"], {**clients, **own}["2w"]
        two = TwoProcesses(cfg)
        stack.callback(two.close)
        c1.run(_worker_setup, cfg)
        methods = {"loop": lambda: sweeps.loop(inputs), "two_processes": two,
                   "sweep_1w": lambda: sweeps.with_sweep(inputs, dag, None, c1),
                   "sweep_2w": lambda: sweeps.with_sweep(inputs, dag, None, c2),
                   "worker_loop": lambda: c1.run(_worker_loop)}
        ref = sweeps.loop(inputs)
        checks = {m: _check(methods[m](), ref) for m in ("sweep_1w", "sweep_2w")}  # + warm-up
        bad = {m: c for m, c in checks.items() if not all(c.values())}
        if bad:
            raise AssertionError(f"{TITLE}: disagrees with the loop or is not NumPy: {bad}")
        times = common.interleaved(methods, cfg.reps)
        profiles = {"sweep_1w": profile(c1, inputs, dag), "sweep_2w": profile(c2, inputs, dag)}
    c = common.case(f"N={cfg.items}", {"items": cfg.items, "item_kb": cfg.rows * cfg.width * 4 / 1000},
                    times, RATIOS, baseline="loop", checks=checks, profiles=profiles)
    wanted = [{"case": c["case"], "ratio": r, "op": ">=", "bound": b, "was": was, "source": "issue 11"}
              for r, b, was in TARGETS]
    return {"title": TITLE, "config": {**asdict(cfg), "outputs": list(sweeps.OUTPUTS), "rtol": RTOL},
            "targets": common.targets([c], wanted),
            "where": {"two_processes": "two plain processes", "worker_loop": "in the 1w worker"},
            "cases": [c]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer items and repetitions")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    result = run(args.quick, {})
    c = result["cases"][0]
    print(json.dumps({"ratios": c["ratios"], "targets": result["targets"],
                      "median_s": {m: r["median_s"] for m, r in c["methods"].items()},
                      "profiles": c["profiles"]}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=float)
    return result


if __name__ == "__main__":
    main()
