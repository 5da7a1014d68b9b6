"""``daskdag run`` and ``daskdag sweep``: end to end as subprocesses (threads, a CLI-started
cluster), against plain JAX; their errors and exit codes."""

import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from daskdag.cli import main

from .support.clusters import free_port
from .support.numbers import seed_functions

ROOT = Path(__file__).resolve().parent.parent  # this checkout, whose daskdag the CLI must run

# The seed DAG (tests/conftest.py), as a module's source, plus a node that fails on negative
# input; one of its functions comes from a neighbouring module (its directory goes on sys.path).
DAG_MODULE = inspect.getsource(seed_functions) + textwrap.dedent('''
    import jax.numpy as jnp
    from cli_helpers import positive


    def _dag():
        f = seed_functions()
        return {"A": (f["x_to_A"], ["x"]), "B": (f["A_to_B"], ["A"]), "C": (f["B_to_C"], ["B"]),
                "D": (f["C_to_D"], ["C"]), "E": (f["B_to_E"], ["B"]), "F": (positive, ["x"])}


    dag = _dag()
    make_dag = _dag
''')
HELPERS = textwrap.dedent('''
    import jax.numpy as jnp


    def positive(x):
        if jnp.min(x) < 0:
            raise ValueError("x must be positive")
        return jnp.sum(x ** 2)
''')


def composed(name):
    g = seed_functions()
    return {"D": lambda x: g["C_to_D"](g["B_to_C"](g["A_to_B"](g["x_to_A"](x)))),
            "E": lambda x: g["B_to_E"](g["A_to_B"](g["x_to_A"](x)))}[name]


def write_pipeline(d: Path) -> Path:
    """A DAG module file in ``d`` that nothing can import by name, and its neighbour."""
    d.mkdir(exist_ok=True)
    (d / "cli_helpers.py").write_text(HELPERS)
    path = d / "pipeline.py"
    path.write_text("import jax\n" + DAG_MODULE)
    return path


@pytest.fixture
def pipeline(tmp_path):
    return write_pipeline(tmp_path / "pipeline_dir")


class Command:
    """``python -m daskdag.cli ARGS`` started in ``cwd``, with this checkout's daskdag; a thread
    collects its output and the moment it exits."""

    def __init__(self, *args, cwd):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        self.args = [str(a) for a in args]
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "daskdag.cli", *self.args], cwd=cwd,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.thread = threading.Thread(target=self._collect, daemon=True)
        self.thread.start()

    def _collect(self):
        self.out, self.err = self.proc.communicate()
        self.took = time.monotonic() - self.started

    def finish(self, timeout=120):
        """``(exit code, stdout, stderr)``, once it exited."""
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.proc.kill()
            self.thread.join()
            pytest.fail(f"daskdag {' '.join(self.args)} did not finish in {timeout} s: {self.err}")
        return self.proc.returncode, self.out, self.err


X = np.array([1.0, 2.0, 3.0, 4.0, 5.0], dtype=np.float32)
XS = (np.random.default_rng(0).random((7, 5)) + 0.5).astype(np.float32)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The commands of the tests below on threads, all started at once (each spends seconds
    importing JAX; together they take about as long as two), each in a directory of its own:
    ``{name: (Command, its directory)}``."""
    base = tmp_path_factory.mktemp("cli")
    pipeline = write_pipeline(base / "pipeline_dir")
    negative = XS.copy()
    negative[4, 0] = -1.0  # F fails for item 4 alone
    unreachable = f"tcp://127.0.0.1:{free_port()}"
    commands = {  # name: (inputs file contents, command)
        "run": ({"x": X}, ["run", f"{pipeline}:make_dag", "--inputs", "in.npz", "--outputs", "D,E",
                            "--out", "res.npz"]),
        "sweep": ({"arr_0": XS}, ["sweep", pipeline, "--inputs", "in.npz", "--outputs", "D,E",
                                  "--chunk-size", "3", "--out", "res.npz"]),
        "collect": ({"x": negative}, ["sweep", f"{pipeline}:dag", "--inputs", "in.npz", "--outputs",
                                      "D,E,F", "--errors", "collect", "--quiet", "--out", "res.npz"]),
        "unreachable": ({"x": X}, ["run", pipeline, "--inputs", "in.npz", "--outputs", "D",
                                   "--scheduler", unreachable, "--timeout", "2", "--out", "res.npz"]),
        "raises": ({"x": -X}, ["run", f"{pipeline}:dag", "--inputs", "in.npz", "--outputs", "D,F",
                               "--out", "res.npz"]),
    }
    procs = {}
    for name, (inputs, command) in commands.items():
        d = base / name
        d.mkdir()
        np.savez(d / "in.npz", **inputs)
        procs[name] = (Command(*command, cwd=d), d)
    yield procs
    for command, _ in procs.values():
        if command.proc.poll() is None:
            command.proc.kill()
            command.thread.join()


def check_run(res):
    for o in ("D", "E"):
        value, grad = jax.value_and_grad(composed(o))(jnp.asarray(X))
        np.testing.assert_allclose(res[f"{o}.value"], value, rtol=1e-5)
        np.testing.assert_allclose(res[f"{o}.grad.x"], grad, rtol=1e-5, atol=1e-6)


def check_sweep(res, rows=slice(None)):
    for o in ("D", "E"):
        values, grads = map(np.asarray, jax.vmap(jax.value_and_grad(composed(o)))(jnp.asarray(XS)))
        assert res[f"{o}.value"].shape == (len(XS),) and res[f"{o}.grad.x"].shape == XS.shape
        np.testing.assert_allclose(res[f"{o}.value"][rows], values[rows], rtol=1e-5)
        np.testing.assert_allclose(res[f"{o}.grad.x"][rows], grads[rows], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(150)
def test_run_on_threads_agrees_with_jax(launched):
    command, d = launched["run"]
    code, out, err = command.finish()
    assert code == 0, err
    res = dict(np.load(d / "res.npz"))
    assert set(res) == {"D.value", "D.grad.x", "E.value", "E.grad.x"}
    check_run(res)
    assert "D" in out and "float32[5]" in out  # the summary table


@pytest.mark.timeout(150)
def test_sweep_on_threads_agrees_with_vmap(launched):
    command, d = launched["sweep"]  # its file's one key is arr_0: the DAG has one free input
    code, out, err = command.finish()
    assert code == 0, err
    check_sweep(dict(np.load(d / "res.npz")))
    assert "7/7" in err  # the progress bar, on stderr


@pytest.mark.timeout(150)
def test_sweep_collects_failed_items(launched):
    command, d = launched["collect"]
    code, out, err = command.finish()
    assert code == 4, err
    assert "item 4: node 'F' failed" in err and "x must be positive" in err
    res = dict(np.load(d / "res.npz"))
    for o in ("D", "E", "F"):
        assert res[f"{o}.failed"].tolist() == [4]
    assert np.isnan(res["F.value"][4]) and not np.isnan(res["F.value"][:4]).any()
    check_sweep(res, rows=[0, 1, 2, 3, 5, 6])
    assert out == ""  # --quiet


@pytest.mark.timeout(150)
def test_scheduler_that_does_not_answer_is_exit_3(launched):
    command, d = launched["unreachable"]
    code, out, err = command.finish()
    assert code == 3, err
    address = command.args[command.args.index("--scheduler") + 1]
    assert f"cannot reach the scheduler at {address} within 2 s" in err
    assert command.took < 30  # JAX's import, slowed by the others, and 2 s (not the default 30)
    assert not (d / "res.npz").exists()


@pytest.mark.timeout(150)
def test_node_that_raises_is_exit_1_naming_it(launched):
    command, d = launched["raises"]
    code, out, err = command.finish()
    assert code == 1, err
    assert "node 'F' failed" in err and "x must be positive" in err
    assert "Traceback" not in err and "--traceback" in err
    assert not (d / "res.npz").exists()


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_run_and_sweep_on_a_cli_started_cluster(cli_client, cli_cluster, pipeline, tmp_path):
    np.savez(tmp_path / "in.npz", x=X)
    np.savez(tmp_path / "items.npz", x=XS)
    # A scheduler file (as `dask scheduler --scheduler-file` writes it) names the cluster too.
    (tmp_path / "scheduler.json").write_text(json.dumps({"address": cli_cluster}))
    run = Command("run", f"{pipeline}:dag", "--inputs", "in.npz", "--outputs", "D,E",
                "--scheduler", cli_cluster, "--out", "res.npz", cwd=tmp_path)
    sweep = Command("sweep", f"{pipeline}:dag", "--inputs", "items.npz", "--outputs", "D,E",
                  "--scheduler", "scheduler.json", "--out", "sweep.npz", cwd=tmp_path)
    code, out, err = run.finish(timeout=180)
    assert code == 0, err
    check_run(dict(np.load(tmp_path / "res.npz")))
    code, out, err = sweep.finish(timeout=180)
    assert code == 0, err
    check_sweep(dict(np.load(tmp_path / "sweep.npz")))
    assert "7/7" in err


# Usage errors: in this process (main() returns what the command exits with), to keep the file
# short; the subprocesses above show that the codes reach the shell.

@pytest.mark.timeout(60)
@pytest.mark.parametrize("target, inputs, outputs, culprit", [
    ("{dir}/no_such_pipeline.py:dag", {"x": X}, "D", "no_such_pipeline.py"),
    ("no_such_package.pipeline:dag", {"x": X}, "D", "no_such_package"),
    ("{pipeline}:dga", {"x": X}, "D", "'dga'"),  # a misspelled attribute
    ("{pipeline}:jnp", {"x": X}, "D", "not the DAG dict"),
    ("{pipeline}:dag", {"y": X}, "D", "no value for 'x'"),
    ("{pipeline}:dag", {"x": X, "extra": X}, "D", "extra"),
    ("{pipeline}:dag", {"x": X}, "D,Q", "'Q'"),
    ("{pipeline}:dag", {"x": X}, "A", "output 'A' is not a real scalar"),  # (DAGError.argument)
], ids=["file missing", "module missing", "attribute missing", "not a dict", "input missing",
        "extra input", "unknown output", "cotangents needed"])
def test_usage_errors_are_exit_2_naming_the_culprit(pipeline, tmp_path, capsys, target, inputs,
                                                    outputs, culprit):
    np.savez(tmp_path / "in.npz", **inputs)
    target = target.format(dir=tmp_path, pipeline=pipeline)
    code = main(["run", target, "--inputs", str(tmp_path / "in.npz"), "--outputs", outputs,
                 "--out", str(tmp_path / "res.npz")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("daskdag run: error: ") and culprit in err and "Traceback" not in err
    if "missing" in culprit or "no value" in culprit:
        assert "its keys: y" in err  # and what the file has
    if "scalar" in culprit:  # the call's argument, as the command line names it
        assert "(here: --cotangents FILE.npz, one key per output)" in err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", [[], ["run"], ["sweep"]])
def test_help_lists_commands_and_exit_codes(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([*command, "--help"])
    assert exit.value.code == 0
    out = capsys.readouterr().out
    assert "exit codes" in out and "130" in out and "ClusterError" in out
    if not command:
        assert all(c in out for c in ("certs", "run", "sweep"))
    else:
        assert "<output>.grad.<input" in out  # the npz layout
