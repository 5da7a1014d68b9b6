"""The benchmark runner: every scenario, one run, one report.

    python -m benchmarks [--quick] [--only NAME,NAME,...] [--out DIR] [--update-docs]
    python -m benchmarks --from-json DIR/latest.json [--out DIR] [--update-docs]

Scenarios: the modules of ``benchmarks/scenarios/``, one each, in report order (its
``__init__.py`` lists them, and says what each declares); ``--help`` lists them, each with its
one-line ``DESCRIPTION``, as does the end of this docstring once the module is imported. Each
times its methods against baselines in the same run, interleaved, and reports medians, ratios
and its targets. Cluster methods run on the default clusters of ``common.CLUSTERS``; those
ending in ``_tuned`` on the tuned one, reported apart. The runner starts the clusters the chosen
scenarios declare (``CLUSTERS``), runs those scenarios, and closes the clusters before it runs
the scenarios that declare none (``CLUSTERS = None``).

Writes to ``DIR`` (default ``benchmarks/results``, or ``benchmarks/results/quick`` with
``--quick``): ``latest.json`` (every time, after each scenario, so a failure keeps what was
measured), ``latest.md`` and one PNG per scenario. ``--update-docs`` puts the report in
docs/performance.md between its benchmark markers, its PNGs in docs/performance/. ``--quick`` takes several minutes on 2 cores.
``--from-json`` measures nothing: it redraws the report of an earlier run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import shutil
import sys
import textwrap
import time
from pathlib import Path

from . import common, report, scenarios

HERE = Path(__file__).parent
PAGE = HERE.parent / "docs" / "performance.md"
MARKERS = ("<!-- benchmarks:start -->", "<!-- benchmarks:end -->")


def listing(width: int = 96, quote: str = "``") -> str:
    """The scenarios, in report order, each with its one-line ``DESCRIPTION`` (its code quoted
    with ``quote``)."""
    lines = []
    for name in scenarios.NAMES:
        module = scenarios.load(name)
        text = module.DESCRIPTION if module else "its module is not there: skipped"
        lines.append(textwrap.fill(f"{name}: {text.replace('``', quote)}", width,
                                   initial_indent="  ", subsequent_indent="      ",
                                   break_on_hyphens=False))
    return "\n".join(lines)


__doc__ += "\nThe scenarios:\n\n" + listing() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
        epilog="scenarios, in report order:\n" + listing(78, quote="`"),
        formatter_class=argparse.RawDescriptionHelpFormatter)  # (the epilog's lines kept)
    names = scenarios.NAMES
    parser.add_argument("--quick", action="store_true", help="smaller problems, fewer repetitions")
    parser.add_argument("--only", type=lambda s: s.split(","), default=list(names),
                        help=f"comma-separated scenarios, of {', '.join(names)}")
    parser.add_argument("--out", type=Path, help="folder for latest.json, latest.md and the PNGs")
    parser.add_argument("--update-docs", action="store_true",
                        help="write the report into docs/performance.md between its benchmark "
                             "markers, and its plots into docs/performance/")
    parser.add_argument("--from-json", type=Path, metavar="PATH",
                        help="measure nothing: redraw the report of the run saved in PATH")
    args = parser.parse_args(argv)
    unknown = [s for s in args.only if s not in names]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {', '.join(names)}")
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
                                  + ("" if set(only) == set(scenarios.NAMES)
                                     else f" --only {','.join(only)}"),
                       "started": datetime.datetime.now().isoformat(timespec="seconds")},
               "scenarios": {}}
    chosen = {s: scenarios.load(s) for s in scenarios.NAMES if s in only}
    for name in [s for s, module in chosen.items() if module is None]:
        print(f"skipping {name}: benchmarks/scenarios/{name}.py is not there", flush=True)
        results.setdefault("skipped", {})[name] = f"benchmarks/scenarios/{name}.py is not there"
    chosen = {s: module for s, module in chosen.items() if module is not None}

    def run(name: str, clients: dict) -> None:
        scenario = chosen[name]
        t = time.perf_counter()
        results["scenarios"][name] = scenario.run(quick, clients)
        results["scenarios"][name]["run"] = {  # (which run measured it, once merged with others)
            "command": results["run"]["command"], "started": results["run"]["started"]}
        results["scenarios"][name]["wall_s"] = time.perf_counter() - t
        results["run"]["wall_s"] = time.perf_counter() - started
        _write_json(out / "latest.json", results)

    shared = [s for s, module in chosen.items() if module.CLUSTERS is not None]
    if shared:  # (the runner's clusters are closed before the others run)
        wanted = tuple(k for k in common.CLUSTERS if any(k in chosen[s].CLUSTERS for s in shared))
        with common.clusters(wanted) as clients:
            results["clusters"] = {k: common.describe(k, c) for k, c in clients.items()}
            for name in shared:
                run(name, clients)
            for k, c in clients.items():  # what daskdag's worker plugin did, after every call
                results["clusters"][k]["daskdag_plugin"] = common.plugin_state(c)
    for name, module in chosen.items():
        if module.CLUSTERS is None:
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
