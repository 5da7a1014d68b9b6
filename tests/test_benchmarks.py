"""The benchmark runner, end to end: ``python -m benchmarks --quick`` and what it writes.

Takes about three minutes, so it runs only with ``DASKDAG_BENCH=1`` (``make bench-test``).
No time is asserted: the checks are that every scenario ran every method, agreed with its
reference (the runner raises otherwise), and reported ratios that are the ones of its medians.
"""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {"k_heads", "overhead", "sweeps", "portable"}

pytestmark = [pytest.mark.bench,
              pytest.mark.skipif(not os.environ.get("DASKDAG_BENCH"),
                                 reason="minutes long: set DASKDAG_BENCH=1 (make bench-test)")]


@pytest.mark.timeout(600)
def test_quick_run_writes_json_markdown_and_plots(tmp_path):
    subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path)],
                   cwd=ROOT, check=True, timeout=540)
    results = json.loads((tmp_path / "latest.json").read_text())
    assert results["run"]["mode"] == "quick"
    assert set(results["scenarios"]) == SCENARIOS

    for name, scenario in results["scenarios"].items():
        assert scenario["cases"], name
        for case in scenario["cases"]:
            methods = case["methods"]
            for m, record in methods.items():
                assert record["median_s"] == pytest.approx(statistics.median(record["times_s"]))
                assert record["median_s"] > 0, (name, case["case"], m)
            assert case["ratios"] and all(math.isfinite(r) and r > 0 for r in case["ratios"].values())

    heads = results["scenarios"]["k_heads"]["cases"]
    assert {(c["params"]["K"], c["params"]["mode"]) for c in heads} == {
        (k, mode) for k in (1, 4, 16) for mode in ("eager", "jit")}
    for c in heads:
        med = {m: r["median_s"] for m, r in c["methods"].items()}
        assert c["ratios"]["compute_grads/hand_written"] == pytest.approx(
            med["compute_grads"] / med["hand_written"])
        assert {"naive", "hand_written", "compute_grads", "cluster_2w", "torch"} <= set(med)
    for c in results["scenarios"]["overhead"]["cases"]:
        for record in c["methods"].values():
            assert record["us_per_node"] == pytest.approx(record["median_s"] / c["params"]["nodes"] * 1e6)

    md = (tmp_path / "latest.md").read_text()
    for name, scenario in results["scenarios"].items():
        assert scenario["title"] in md
        # A row per case; sweeps has one case, and a row per method.
        rows = list(scenario["cases"][0]["methods"]) if name == "sweeps" else [
            c["case"] for c in scenario["cases"]]
        assert all(f"| {row} |" in md for row in rows), (name, rows)
    for name in SCENARIOS:
        png = (tmp_path / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000, name
        assert f"({name}.png)" in md.replace("./", "")
