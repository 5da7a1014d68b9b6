"""Every benchmark module imports, and the runner's command line answers: a change to the
package that breaks ``make bench`` fails here, in seconds, without running a scenario (the
scenarios themselves run in ``tests/test_benchmarks.py``, with ``DASKDAG_BENCH=1``). And the
accelerator check (``benchmarks/tools/accelerator_check.py``) runs at small sizes on the CPU."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> list[str]:
    """Every module of the benchmarks package, its subpackages' included (scenarios/, tools/)."""
    names = []
    for path in (ROOT / "benchmarks").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


@pytest.mark.parametrize("module", _modules())
def test_benchmark_module_imports(module):
    importlib.import_module(module)


@pytest.mark.subprocess
def test_runner_help():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--only" in out.stdout


@pytest.mark.timeout(900)
@pytest.mark.subprocess
def test_accelerator_check_runs_on_a_cpu(tmp_path):
    """``benchmarks/tools/accelerator_check.py --quick``, as it runs on an accelerator host but
    at small sizes: no compilation after the first round, the matrix's cells right, the ratios
    and the multi_head scenario measured (the figures themselves are for an accelerator: not checked here). The matrix of
    one kind, its 12 cells (3 forms x plain, reused, swept, stored): on a CPU the other kinds'
    cells are the same calls as tests/test_every_kind.py's threads cells."""
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "benchmarks/tools/accelerator_check.py", "--quick",
                           "--kinds", "hvps", "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["compiles"]["rounds"][1:] == [0, 0]
    assert got["matrix"]["count"] == 12 and all(got["matrix"]["cells"].values())
    assert got["hybrid"]["right"] and got["sweep"]["right"]
    assert {p["n"] for p in got["prepared"]} == {64, 256}
    # (each method checked against jax.jit before it is timed: a wrong one raises)
    assert [c["case"] for c in got["multi_head"]["cases"]] == ["gradients", "training step"]
