"""The benchmark runner: every scenario, one run, one report.

    python -m benchmarks [--quick] [--only k_heads,overhead,...] [--out DIR] [--update-docs]
    python -m benchmarks --from-json DIR/latest.json [--out DIR] [--update-docs]

Scenarios (one module each): ``k_heads`` (K outputs over a shared trunk: daskdag against naive
JAX, the hand-written VJP plumbing, jitted JAX and PyTorch autograd; bytes sent per call),
``overhead`` (per-node cost against hand-written Dask graphs), ``sweeps`` (``sweep_grads``
against a loop and ``jit(vmap)``), ``large_sweep`` (a sweep of large items against two plain
processes; skipped, and said so, while its module is missing), ``portable`` (pullbacks moved
between processes), ``jacobians`` (``daskdag.jacobian`` of a 64-output chain against
``jax.jacrev`` and PyTorch), ``sparse_jacobians`` (a block-diagonal and a banded n x n
Jacobian through a 5-node DAG of eager nodes: ``daskdag.jacobian`` dense, with a sparsity
pattern (one pass per colour, passes counted) and with ``sparsity="detect"``, against
``jax.jacrev``; on this process's threads, no cluster), ``custom_nodes`` (nodes of NumPy
code with the user's own VJP against JAX nodes and hand-written loops), ``tiny_nodes`` (the
seed DAG and layered DAGs of up to 50,000 tiny nodes on Dask's threaded scheduler against the
same VJP plumbing by hand),
``scale_out`` (nodes that wait, on default clusters of W = 4, 8, 16 workers that it starts
itself: ``compute_grads`` of a wide DAG and ``sweep_grads`` against hand-written Dask graphs,
as efficiency against the ideal), ``remat`` (a 16-node chain with 200 MB of residuals per node
on 2 workers of 1.5 GB: ``Node(remat=True)`` against spilling and an unlimited run; peak worker
memory and time), ``repeat_calls`` (repeated calls as an optimiser makes them: four models
against OpenMDAO's ``compute_totals`` on the same JAX components and ``jax.jit``, SLSQP against
OpenMDAO's ``ScipyOptimizeDriver``, a 200-step loop on the default cluster with its bytes per
step, the seed DAG in a 1,000-call loop), ``durable_sweeps`` (``sweep_grads(store=...)`` against
the same sweep in memory, and resuming a sweep that died at 90%). Each times its methods against baselines in the same run,
interleaved, and reports medians, ratios and its targets. Cluster methods run on the default clusters of
``common.CLUSTERS``; those ending in ``_tuned`` on the tuned one, reported apart. The scenarios
of ``OWN_CLUSTERS`` use none of those: they run after those clusters are closed.

Writes to ``DIR`` (default ``benchmarks/results``, or ``benchmarks/results/quick`` with
``--quick``): ``latest.json`` (every time, after each scenario, so a failure keeps what was
measured), ``latest.md`` and one PNG per scenario. ``--update-docs`` puts the report in
docs/performance.md between its benchmark markers, its PNGs in docs/performance/. ``--quick`` takes several minutes on 2 cores.
``--from-json`` measures nothing: it redraws the report of an earlier run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

from . import common, report
SCENARIOS = ("k_heads", "overhead", "sweeps", "large_sweep", "portable", "jacobians",
             "sparse_jacobians", "custom_nodes", "tiny_nodes", "scale_out", "remat",
             "repeat_calls", "durable_sweeps")
ONE_WORKER = {"sweeps", "large_sweep"}  # the scenarios that also use the 1-worker cluster
# use none of common.CLUSTERS (scale_out and remat start their own; the others run on this
# process's threads)
OWN_CLUSTERS = {"sparse_jacobians", "tiny_nodes", "scale_out", "remat"}
HERE = Path(__file__).parent
PAGE = HERE.parent / "docs" / "performance.md"
MARKERS = ("<!-- benchmarks:start -->", "<!-- benchmarks:end -->")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller problems, fewer repetitions")
    parser.add_argument("--only", type=lambda s: s.split(","), default=list(SCENARIOS),
                        help=f"comma-separated scenarios, of {', '.join(SCENARIOS)}")
    parser.add_argument("--out", type=Path, help="folder for latest.json, latest.md and the PNGs")
    parser.add_argument("--update-docs", action="store_true",
                        help="write the report into docs/performance.md between its benchmark "
                             "markers, and its plots into docs/performance/")
    parser.add_argument("--from-json", type=Path, metavar="PATH",
                        help="measure nothing: redraw the report of the run saved in PATH")
    args = parser.parse_args(argv)
    unknown = [s for s in args.only if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    if importlib.util.find_spec("matplotlib") is None:  # before minutes of measuring, not after
        parser.error("the report's plots need matplotlib: pip install -e '.[bench]' (make bench "
                     "does it), which also brings the PyTorch peer")
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        out = args.out or args.from_json.parent
    else:
        out = args.out or (HERE / "results" / "quick" if args.quick else HERE / "results")
        results = measure(args.quick, args.only, out)
    out.mkdir(parents=True, exist_ok=True)
    pngs = report.plots(results, out)
    md = report.markdown(results, images=".")
    (out / "latest.md").write_text(md)
    print("\n" + md)
    print(f"wrote {out / 'latest.md'}, " + ", ".join(p.name for p in pngs))
    if args.update_docs:
        _update_page(report.markdown(results, images="performance"), pngs)
        print(f"updated {PAGE}")
    return 0


def measure(quick: bool, only: list[str], out: Path) -> dict:
    """Run the scenarios in ``only``; write ``out/latest.json`` after each."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = {"machine": common.machine(),
               "run": {"mode": "quick" if quick else "full",
                       "command": "python -m benchmarks" + (" --quick" if quick else "")
                                  + ("" if set(only) == set(SCENARIOS) else f" --only {','.join(only)}"),
                       "started": datetime.datetime.now().isoformat(timespec="seconds")},
               "scenarios": {}}
    names = [s for s in SCENARIOS if s in only]
    missing = [s for s in names
               if importlib.util.find_spec(f".scenarios.{s}", __package__) is None]
    for name in missing:
        print(f"skipping {name}: benchmarks/scenarios/{name}.py is not there", flush=True)
        results.setdefault("skipped", {})[name] = f"benchmarks/scenarios/{name}.py is not there"
    names = [s for s in names if s not in missing]

    def run(name: str, clients: dict) -> None:
        scenario = importlib.import_module(f".scenarios.{name}", __package__)
        t = time.perf_counter()
        results["scenarios"][name] = scenario.run(quick, clients)
        results["scenarios"][name]["wall_s"] = time.perf_counter() - t
        results["run"]["wall_s"] = time.perf_counter() - started
        _write_json(out / "latest.json", results)

    shared = [s for s in names if s not in OWN_CLUSTERS]
    if shared:  # (the runner's clusters are closed before the others run)
        wanted = ("1w", "2w", "2w_tuned") if ONE_WORKER & set(shared) else ("2w", "2w_tuned")
        with common.clusters(wanted) as clients:
            results["clusters"] = {k: common.describe(k, c) for k, c in clients.items()}
            for name in shared:
                run(name, clients)
            for k, c in clients.items():  # what daskdag's worker plugin did, after every call
                results["clusters"][k]["daskdag_plugin"] = common.plugin_state(c)
    for name in names:
        if name in OWN_CLUSTERS:
            run(name, {})
    results["run"]["wall_s"] = time.perf_counter() - started
    _write_json(out / "latest.json", results)
    print(f"wrote {out / 'latest.json'}")
    return results


def _write_json(path: Path, results: dict) -> None:
    path.write_text(json.dumps(results, indent=1, default=float) + "\n")


def _update_page(md: str, pngs: list[Path]) -> None:
    """The report into the docs' performance page, its plots beside it (the site serves only
    what is in docs/)."""
    folder = PAGE.parent / "performance"
    folder.mkdir(exist_ok=True)
    for png in pngs:
        shutil.copyfile(png, folder / png.name)
    text = PAGE.read_text()
    start, end = (text.index(m) for m in MARKERS)
    PAGE.write_text(text[:start + len(MARKERS[0])] + "\n" + md + text[end:])


if __name__ == "__main__":
    sys.exit(main())
