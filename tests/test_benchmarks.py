"""The benchmark runner, end to end: ``python -m benchmarks --quick`` and what it writes.

Takes several minutes, so it runs only with ``DASKDAG_BENCH=1`` (``make bench-test``).
No time is asserted: the checks are that every scenario ran every method, agreed with its
reference (the runner raises otherwise), reported ratios that are the ones of its medians and
its targets against them, that the headline clusters are default ones, and that a repeated
K-heads call re-sends no weight while a weight changed in place is sent again.
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
SCENARIOS = {"k_heads", "multi_head", "overhead", "sweeps", "large_sweep", "portable",
             "jacobians", "sparse_jacobians", "custom_nodes", "tiny_nodes", "scale_out", "remat",
             "durable_sweeps", "repeat_calls", "shared_work", "durable_calls", "implicit",
             "import_time"}

pytestmark = [pytest.mark.bench, pytest.mark.timeout(1800),  # the first test runs the runner
              pytest.mark.skipif(not os.environ.get("DASKDAG_BENCH"),
                                 reason="minutes long: set DASKDAG_BENCH=1 (make bench-test)")]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)],
                   cwd=ROOT, check=True, timeout=1680)
    return json.loads((out / "latest.json").read_text()), out


def test_quick_run_writes_json_markdown_and_plots(run):
    results, out = run
    assert results["run"]["mode"] == "quick"
    assert set(results["scenarios"]) | set(results.get("skipped", {})) == SCENARIOS
    assert not results.get("skipped")  # every scenario's module is there

    for name, scenario in results["scenarios"].items():
        assert scenario["cases"], name
        for case in scenario["cases"]:
            methods = case["methods"]
            for m, record in methods.items():
                assert record["median_s"] == pytest.approx(statistics.median(record["times_s"]))
                assert record["median_s"] > 0, (name, case["case"], m)
            assert case["ratios"] and all(math.isfinite(r) and r > 0 for r in case["ratios"].values())

    heads = results["scenarios"]["k_heads"]
    assert {(c["params"]["K"], c["params"]["mode"]) for c in heads["cases"]} == {
        (k, mode) for k in heads["config"]["heads"] for mode in ("eager", "jit")}
    for c in heads["cases"]:
        med = {m: r["median_s"] for m, r in c["methods"].items()}
        assert {"naive", "hand_written", "daskdag_threads", "daskdag_2w", "daskdag_2w_tuned",
                "torch"} <= set(med)
        assert c["ratios"]["daskdag_2w/daskdag_threads"] == pytest.approx(
            med["daskdag_2w"] / med["daskdag_threads"])
    for c in results["scenarios"]["overhead"]["cases"]:
        for record in c["methods"].values():
            assert record["us_per_node"] == pytest.approx(record["median_s"] / c["params"]["nodes"] * 1e6)
        assert "daskdag_2w/dask_2w" in c["ratios"]
    assert "sweep_vmap_2w/jit_vmap" in results["scenarios"]["sweeps"]["cases"][0]["ratios"]
    jacobians = {c["case"]: c for c in results["scenarios"]["jacobians"]["cases"]}
    assert set(jacobians) == {"jit", "eager"}
    for c in jacobians.values():
        med = {m: r["median_s"] for m, r in c["methods"].items()}
        assert c["ratios"]["daskdag_threads/jacrev"] == pytest.approx(
            med["daskdag_threads"] / med["jacrev"])
    sparse = {c["case"]: c for c in results["scenarios"]["sparse_jacobians"]["cases"]}
    assert set(sparse) == {"block", "banded"}
    for c in sparse.values():  # one pass per colour, counted; a dense call one per element
        assert c["passes_equal_colours"] and c["passes"]["sparse"] == c["colours"][c["mode"]]
        assert c["passes"]["dense"] == c["params"]["n"]
        assert "sparse/dense" in c["ratios"] and "detect_and_sparse/dense" in c["ratios"]
    scale = results["scenarios"]["scale_out"]  # a wide, a deep and a sweeps case per shape
    assert [(c["params"]["workers"], c["params"]["threads"]) for c in scale["cases"]] == [
        tuple(shape) for shape in scale["config"]["shapes"] for _ in ("wide", "deep", "sweeps")]
    for c in scale["cases"]:
        for m, record in c["methods"].items():
            assert record["efficiency"] == pytest.approx(c["ideal_s"] / record["median_s"])
            assert c["ratios"][f"efficiency_{m}"] == pytest.approx(record["efficiency"])
        if c["case"].startswith(("wide", "deep")):  # every baseline branch task seen, on some worker
            base = "hand_written" if c["case"].startswith("wide") else "two_phase"
            spread = c["branch_tasks"]
            for call in spread[base]["calls"]:
                assert len(call["per_worker"]) == c["params"]["workers"]
                assert sum(call["per_worker"]) == c["params"]["branches"] * c["params"].get("layers", 1)
                assert "tail" in call and "return_s" in call
                assert call["after_last_s"] >= call["return_s"] >= 0.0  # (the return: the tail's end)
            for call in spread["daskdag"]["calls"]:  # (unknown if daskdag's key format changed)
                assert sum(call["per_worker"]) <= c["params"]["branches"] * c["params"].get("layers", 1)
            assert "tail_ratio" in c["ratios"]
    tiny = results["scenarios"]["tiny_nodes"]["cases"]
    assert tiny[0]["case"] == "seed DAG" and "daskdag_threads/hand_written" in tiny[0]["ratios"]
    for c in tiny[1:]:
        for record in c["methods"].values():
            assert record["us_per_node"] == pytest.approx(record["median_s"] / c["params"]["nodes"] * 1e6)
    assert "per_node_largest/per_node_1000" in tiny[-1]["ratios"]
    targets = {(t["source"], t["ratio"]) for s in results["scenarios"].values()
               for t in s.get("targets", [])}
    assert ("issue 12", "daskdag_threads/jacrev") in targets  # (K=16's are not in a quick run)

    md = (out / "latest.md").read_text()
    for name, scenario in results["scenarios"].items():
        assert scenario["title"] in md
        # A row per case; sweeps has one case, and a row per method.
        rows = list(scenario["cases"][0]["methods"]) if name == "sweeps" else [
            c["case"] for c in scenario["cases"]]
        assert all(f"| {row} |" in md for row in rows), (name, rows)
        png = (out / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000, name
        assert f"({name}.png)" in md.replace("./", "")
    assert md.count("Where each column ran:") == len(results["scenarios"])


def test_headline_clusters_are_default_ones(run):
    clusters = run[0]["clusters"]
    assert {"2w", "2w_tuned"} <= set(clusters)
    for name, c in clusters.items():
        tuned = name.endswith("_tuned")
        assert c["tuned"] is tuned
        for worker in c["workers"].values():
            if tuned:  # pinned, and glibc's adaptive threshold left on
                assert len(worker["cpus"]) == 1 and worker["MALLOC_TRIM_THRESHOLD_"] is None
            else:  # as distributed starts them
                assert worker["MALLOC_TRIM_THRESHOLD_"] == "65536"
                assert len(worker["cpus"]) == run[0]["machine"]["cpu_count"]


def test_targets_are_the_ratios_measured(run):
    results, out = run
    md = (out / "latest.md").read_text()
    wanted = {"k_heads": {"daskdag_2w/daskdag_threads"}, "overhead": {"daskdag_2w/dask_2w"},
              "sweeps": {"sweep_vmap_2w/jit_vmap", "sweep_1w/sweep_2w", "loop/sweep_2w"}}
    for name, ratios in wanted.items():
        s = results["scenarios"][name]
        assert ratios <= {t["ratio"] for t in s["targets"]}, name
        cases = {c["case"]: c for c in s["cases"]}
        for t in s["targets"]:
            assert t["measured"] == pytest.approx(cases[t["case"]]["ratios"][t["ratio"]])
            assert t["met"] is (t["measured"] <= t["bound"] if t["op"] == "<="
                                else t["measured"] >= t["bound"])
            assert f"`{t['ratio']}` = {t['measured']:.2f}" in md


def test_repeated_k_heads_call_resends_no_weight(run):
    sent = run[0]["scenarios"]["k_heads"]["bytes_per_call"]
    weight = sent["weight"]
    assert sent["first"]["daskdag"] >= sent["weights"]  # every weight went once
    assert sent["first"]["to_scheduler"] >= sent["weights"]
    for call in ("repeat", "repeat_after_change"):  # nothing kept is sent again
        assert sent[call]["daskdag"] == 0, call
        assert sent[call]["to_scheduler"] < weight / 4, call
    # weights[0] changed in place: it goes again, and nothing else of that size does
    assert weight <= sent["after_change"]["daskdag"] < weight + 64 * 1024
    assert weight <= sent["after_change"]["to_scheduler"] < 2 * weight
