"""Every benchmark module imports, and the runner's command line answers: a change to the
package that breaks ``make bench`` fails here, in seconds, without running a scenario (the
scenarios themselves run in ``tests/test_benchmarks.py``, with ``DASKDAG_BENCH=1``)."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")))
def test_benchmark_module_imports(module):
    importlib.import_module(f"benchmarks.{module}")


def test_runner_help():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--only" in out.stdout
