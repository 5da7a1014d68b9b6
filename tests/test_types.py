"""The typed public API (issue 24): mypy, with pyproject.toml's [tool.mypy], finds no error in
daskdag/, and the installed package carries its py.typed marker."""

import importlib.resources
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
@pytest.mark.subprocess
def test_mypy_is_clean():
    pytest.importorskip("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                          text=True, timeout=280)
    assert done.returncode == 0, f"mypy found errors:\n{done.stdout}\n{done.stderr}"


def test_py_typed_is_shipped():
    assert (importlib.resources.files("daskdag") / "py.typed").is_file()
