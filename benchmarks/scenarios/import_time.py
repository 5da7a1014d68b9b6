"""Scenario: what importing daskdag costs, each import in a fresh Python process.

jax:            ``import jax`` alone.
dask:           ``import dask`` alone.
daskdag:        ``import daskdag`` after ``import jax`` (timed: daskdag's import alone).
first call's modules: the same, then ``daskdag.compute_grads`` (the first public name imports
                every module a call needs: daskdag's, Dask's; not distributed's).
--version:      ``daskdag --version``, the whole process, as a shell runs it.

Median of ``reps`` processes each. Ratios against ``import jax`` in the same run. Targets
(issue 42): ``import daskdag`` after ``import jax`` <= 0.3 s, ``daskdag --version`` <= 1 s;
the report lists the seconds themselves.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

from .. import common

TITLE = "Import time"
DESCRIPTION = ("``import daskdag`` after ``import jax`` and ``daskdag --version``, in fresh "
               "processes, against ``import jax`` and ``import dask``")
CLUSTERS = None
TIMED = {
    "jax": ("import time; t = time.perf_counter(); import jax; "
            "print(time.perf_counter() - t)"),
    "dask": ("import time; t = time.perf_counter(); import dask; "
             "print(time.perf_counter() - t)"),
    "daskdag": ("import jax, time; t = time.perf_counter(); import daskdag; "
                "print(time.perf_counter() - t)"),
    "first call's modules": ("import jax, time; t = time.perf_counter(); import daskdag; "
                             "daskdag.compute_grads; print(time.perf_counter() - t)"),
}


def _timed(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300).stdout
    return float(out.split()[-1])


def _version() -> float:
    command = shutil.which("daskdag") or None
    args = [command, "--version"] if command else [sys.executable, "-m", "daskdag.cli",
                                                   "--version"]
    start = time.perf_counter()
    subprocess.run(args, capture_output=True, check=True, timeout=300)
    return time.perf_counter() - start


def run(quick: bool, clients: dict) -> dict:
    reps = 3 if quick else 7
    times: dict[str, list[float]] = {m: [] for m in (*TIMED, "--version")}
    for _ in range(reps):  # (interleaved: a busy moment of the machine hits every method)
        for method, code in TIMED.items():
            times[method].append(_timed(code))
        times["--version"].append(_version())
    cases = [common.case("imports", {"reps": reps}, times, {
        "daskdag after jax / jax": ("daskdag", "jax"),
        "first call's modules / jax": ("first call's modules", "jax"),
        "--version / jax": ("--version", "jax")})]
    return {"title": TITLE, "config": {"reps": reps, "python": sys.version.split()[0]},
            "cases": cases, "targets": [],
            "where": {m: "a fresh Python process each" for m in times}}
