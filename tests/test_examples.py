"""The examples in examples/ (the gallery and the guides point to them) run, and agree with plain JAX
(each exits non-zero if not)."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
@pytest.mark.subprocess
def test_example_runs_and_agrees_with_jax(example):
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "JAX" in done.stdout  # (each prints its comparison with plain JAX)
