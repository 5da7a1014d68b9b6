"""An unchanged node never compiles twice, wherever JAX is installed: every kind in every form
(eager, lazy, prepared, swept) over a DAG of jit, eager and vmap nodes, three rounds at new
points, counting XLA compilations (tests/compiles_child.py): none after the first round. With
JAX from the virtual environment's ``site-packages``, and with a copy of it first on
``PYTHONPATH``, as accelerator images, HPC modules and containers install it; with prepared
calls kept, and with none kept (``daskdag.prepared-calls: 0``: every call prepared anew; sweeps
aside).

And the one rule for which code travels by value (``daskdag.transport.whose``), as the
processes that decide it see their installs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

CHILD = Path(__file__).with_name("compiles_child.py")


def _run(script: Path, env: dict, cwd: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, str(script), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def jax_on_pythonpath(tmp_path_factory) -> Path:
    """A folder holding a copy of the installed ``jax`` package (no metadata of its own): first
    on ``PYTHONPATH``, it is the ``jax`` that Python imports."""
    folder = tmp_path_factory.mktemp("opt") / "python"
    shutil.copytree(Path(jax.__file__).parent, folder / "jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def _env(pythonpath: Path | None = None, **settings: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return {**env, **settings}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("where", ["site-packages", "PYTHONPATH"])
@pytest.mark.parametrize("prepared", ["kept", "none kept"])
@pytest.mark.subprocess
def test_no_compilation_after_the_first_round(where, prepared, jax_on_pythonpath, tmp_path):
    path = jax_on_pythonpath if where == "PYTHONPATH" else None
    settings = {"DASK_DASKDAG__PREPARED_CALLS": "0"} if prepared == "none kept" else {}
    # (with none kept, a sweep of a lifted kind is prepared anew and compiles its chunk's program
    # again: sweeps are counted with prepared calls kept)
    args = ("--no-sweeps",) if prepared == "none kept" else ()
    got = json.loads(_run(CHILD, _env(path, **settings), tmp_path, *args))
    assert got["jax"].startswith(str(jax_on_pythonpath)) == (where == "PYTHONPATH")
    first, *later = got["compiles"]
    assert first > 0 and later == [0, 0], got
    assert got["grad_error"] < 1e-6


WHOSE = textwrap.dedent("""
    import json, sys
    import cloudpickle
    import jax, mine, owned, tests
    from daskdag.transport.whose import users_module
    before = users_module("registered")
    import registered
    cloudpickle.register_pickle_by_value(registered)
    print(json.dumps({"jax": jax.__file__, "jax.numpy": users_module("jax.numpy"),
                      "json": users_module("json"), "__main__": users_module("__main__"),
                      "mine": users_module("mine"), "owned": users_module("owned"),
                      "tests": users_module("tests"), "registered": users_module("registered"),
                      "daskdag": users_module("daskdag.api")}))
""")


def _distribution(folder: Path, name: str, top: str) -> None:
    """An installed distribution ``name`` in ``folder`` owning the package ``top``, as
    ``pip install --target folder`` leaves it."""
    info = folder / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(f"{top}\n")
    (info / "RECORD").write_text(f"{top}/__init__.py,,\n")


@pytest.mark.timeout(300)
@pytest.mark.subprocess
def test_which_modules_travel_by_value(jax_on_pythonpath, tmp_path):
    """Installed code travels by reference wherever its files are (a copy of jax first on
    PYTHONPATH; a ``pip --target`` folder); the user's own modules, ``__main__`` and what is
    given to ``cloudpickle.register_pickle_by_value`` by value; so is the user's ``tests``
    package in their working directory, though an installed distribution claims ``tests``."""
    target, work = tmp_path / "target", tmp_path / "work"
    _distribution(target, "owned-dist", "owned")
    (target / "owned").mkdir()
    (target / "owned" / "__init__.py").write_text("X = 1\n")
    _distribution(target, "sloppy-dist", "tests")  # (a distribution that ships "tests")
    (work / "tests").mkdir(parents=True)
    (work / "tests" / "__init__.py").write_text("")
    (work / "mine.py").write_text("def f(x):\n    return x\n")
    (work / "registered.py").write_text("Y = 2\n")
    (work / "script.py").write_text(WHOSE)
    got = json.loads(_run(work / "script.py", _env(Path(f"{jax_on_pythonpath}{os.pathsep}"
                                                        f"{target}")), work))
    assert got.pop("jax").startswith(str(jax_on_pythonpath))
    assert got == {"jax.numpy": False, "json": False, "__main__": True, "mine": True,
                   "owned": False, "tests": True, "registered": True, "daskdag": False}
