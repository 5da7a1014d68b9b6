"""``daskdag run`` and ``daskdag sweep``: end to end as subprocesses (threads, a CLI-started
cluster), against plain JAX; their errors and exit codes."""

import inspect
import json
import os
import re
import signal
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

from daskdag.cli import main, write_certs

from .support.clusters import DaskCLI, eventually, free_port
from .support.numbers import seed_functions
from .test_deploy import CERT_FILES, TLS_FLAGS, certs  # noqa: F401 (the fixture certs)

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


# The pipeline for `--timeout`'s test: what the command would import before reaching for the
# scheduler (distributed, JAX's backend) done first, then the moment it was imported written.
STAMPED = textwrap.dedent('''
    import sys
    import time

    sys.path.insert(0, PIPELINE_DIR)
    import distributed  # noqa: F401
    import jax.numpy as jnp
    from pipeline import dag  # noqa: F401

    jnp.zeros(1).block_until_ready()
    with open("imported_at", "w") as f:
        f.write(repr(time.time()))
''')
# A DAG module that starts a distributed client (an in-process cluster) when imported.
CLIENT_AT_IMPORT = textwrap.dedent('''
    import sys

    from distributed import Client

    sys.path.insert(0, PIPELINE_DIR)
    from pipeline import dag  # noqa: F401

    client = Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0")
''')


def sans(path) -> list[str]:
    """The subject alternative names of the certificate in ``path``, as text."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(n.value) for n in names]


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


# `python -m daskdag.cli` with Ctrl-C as in a terminal (Command(interruptible=True)): a process
# started by a non-interactive shell's background job inherits SIGINT ignored, and Python then
# installs no handler of its own. (Not a preexec_fn: a fork of this multithreaded process.)
AS_IN_A_TERMINAL = ("import runpy, signal; "
                    "signal.signal(signal.SIGINT, signal.default_int_handler); "
                    "runpy.run_module('daskdag.cli', run_name='__main__', alter_sys=True)")


class Command:
    """``python -m daskdag.cli ARGS`` started in ``cwd``, with this checkout's daskdag; a thread
    collects its output and the moment it exits."""

    def __init__(self, *args, cwd, interruptible=False, env=None):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **(env or {})}
        self.args = [str(a) for a in args]
        start = ["-c", AS_IN_A_TERMINAL] if interruptible else ["-m", "daskdag.cli"]
        self.proc = subprocess.Popen([sys.executable, *start, *self.args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._collect, daemon=True)
        self.thread.start()

    def _collect(self):
        self.out, self.err = self.proc.communicate()
        self.ended = time.time()  # (wall-clock time: compared with a time the child wrote)

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
    """The commands of the tests below, all started at once (each spends seconds importing JAX;
    together they take less time than one after another: none of their tests times them from
    their start), each in a directory of its own: ``{name: (Command, its directory)}``."""
    base = tmp_path_factory.mktemp("cli")
    pipeline = write_pipeline(base / "pipeline_dir")
    negative = XS.copy()
    negative[4, 0] = -1.0  # F fails for item 4 alone
    unreachable = f"tcp://127.0.0.1:{free_port()}"
    for name, source in (("stamped", STAMPED), ("client_at_import", CLIENT_AT_IMPORT)):
        (base / f"{name}.py").write_text(source.replace("PIPELINE_DIR", repr(str(pipeline.parent))))
    write_certs(base / "certs" / "tls", ["before.example.org"])
    kept = {f: (base / "certs" / "tls" / f).read_bytes() for f in CERT_FILES}  # (before the run)
    commands = {  # name: (inputs file contents, command)
        "run": ({"x": X}, ["run", f"{pipeline}:make_dag", "--inputs", "in.npz", "--outputs", "D,E",
                            "--out", "res.npz"]),
        "sweep": ({"arr_0": XS}, ["sweep", pipeline, "--inputs", "in.npz", "--outputs", "D,E",
                                  "--chunk-size", "3", "--out", "res.npz"]),
        "collect": ({"x": negative}, ["sweep", f"{pipeline}:dag", "--inputs", "in.npz", "--outputs",
                                      "D,E,F", "--errors", "collect", "--quiet", "--out", "res.npz"]),
        "unreachable": ({"x": X}, ["run", base / "stamped.py", "--inputs", "in.npz", "--outputs",
                                   "D", "--scheduler", unreachable, "--timeout", "2", "--out",
                                   "res.npz"]),
        "client_at_import": ({"x": X}, ["run", base / "client_at_import.py", "--inputs", "in.npz",
                                        "--outputs", "D", "--out", "res.npz"]),
        "certs": (None, ["certs", "tls", "--host", "after.example.org"]),
        "raises": ({"x": -X}, ["run", f"{pipeline}:dag", "--inputs", "in.npz", "--outputs", "D,F",
                               "--out", "res.npz"]),
    }
    procs = {}
    for name, (inputs, command) in commands.items():
        d = base / name
        if inputs is None:
            d.mkdir(exist_ok=True)
        else:
            d.mkdir()
            np.savez(d / "in.npz", **inputs)
        procs[name] = (Command(*command, cwd=d), d)
    procs["certs"][0].kept = kept
    yield procs
    for command, _ in procs.values():
        if command.proc.poll() is None:
            command.proc.kill()
            command.thread.join()


@pytest.mark.timeout(150)
@pytest.mark.subprocess
def test_dag_module_that_starts_a_client_at_import_is_refused(launched):
    command, d = launched["client_at_import"]
    code, _, err = command.finish()
    assert code == 2, err
    assert "daskdag run: error: the DAG module started a distributed client" in err
    assert "pass its address there" in err and "Traceback" not in err
    assert not (d / "res.npz").exists()


@pytest.mark.timeout(150)
def test_certs_keeps_existing_files_and_exits_1_without_force(launched):
    command, d = launched["certs"]
    code, _, err = command.finish()
    assert code == 1, err
    assert "already exist; replace them with --force" in err and "Traceback" not in err
    assert {f: (d / "tls" / f).read_bytes() for f in CERT_FILES} == command.kept
    assert "after.example.org" not in sans(d / "tls" / "cert.pem")


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
    # Timed from the DAG module's import, the last thing before the attempt to connect (it
    # imports distributed and starts JAX's backend first, so that neither counts): the 2 s of
    # --timeout, the interpreter's teardown and a loaded machine's slowness, well short of the
    # default 30 s.
    waited = command.ended - float((d / "imported_at").read_text())
    assert 1.0 < waited < 20, waited
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
    # The CLI's JAX settings (here its environment's) travel to the workers, which have x64 off.
    np.savez(tmp_path / "in64.npz", x=X.astype(np.float64) * (1 + 1e-12))
    wide = Command("run", f"{pipeline}:dag", "--inputs", "in64.npz", "--outputs", "D,E",
                   "--scheduler", cli_cluster, "--out", "res64.npz", cwd=tmp_path,
                   env={"JAX_ENABLE_X64": "1"})
    code, out, err = run.finish(timeout=180)
    assert code == 0, err
    check_run(dict(np.load(tmp_path / "res.npz")))
    code, out, err = wide.finish(timeout=180)
    assert code == 0, err
    res = dict(np.load(tmp_path / "res64.npz"))
    with jax.enable_x64(True):
        x = jnp.asarray(X.astype(np.float64) * (1 + 1e-12))
        for o in ("D", "E"):
            value, grad = jax.value_and_grad(composed(o))(x)
            assert res[f"{o}.value"].dtype == res[f"{o}.grad.x"].dtype == np.float64
            np.testing.assert_allclose(res[f"{o}.value"], value, rtol=1e-12)
            np.testing.assert_allclose(res[f"{o}.grad.x"], grad, rtol=1e-12, atol=1e-14)
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


# -- the options the guide promises, against plain JAX (in this process, as the usage errors) ----

# Three free inputs, a dict-shaped one among them, and a node M between them and the outputs.
OPTIONS_DAG = textwrap.dedent('''
    import jax.numpy as jnp


    def m(a, b, params):
        return jnp.tanh(params["w"] * a + params["b"]) * b


    def q(m, c):
        return {"s": jnp.sin(m) * c, "t": jnp.sum(m ** 2)}


    dag = {"M": (m, ["a", "b", "params"]), "Q": (q, ["M", "c"]),
           "D": (lambda q: jnp.sum(q["s"] ** 2) + q["t"], ["Q"])}
''')
A = np.linspace(0.5, 1.5, 5).astype(np.float32)
B = np.linspace(-1.0, 2.0, 5).astype(np.float32)
PARAMS = {"w": np.linspace(0.2, 0.8, 5).astype(np.float32), "b": np.float32(0.3)}
C = np.float32(1.7)


def _m(a, b, params):
    return jnp.tanh(params["w"] * a + params["b"]) * b


def _q(m, c):
    return {"s": jnp.sin(m) * c, "t": jnp.sum(m ** 2)}


def _d_of_q(q):
    return jnp.sum(q["s"] ** 2) + q["t"]


def _d(a, b, params, c):
    return _d_of_q(_q(_m(a, b, params), c))


@pytest.fixture
def options_dag(tmp_path):
    (tmp_path / "options_dag.py").write_text(OPTIONS_DAG)
    np.savez(tmp_path / "in.npz", a=A, b=B, c=C, **{f"params.{k}": v for k, v in PARAMS.items()})
    return tmp_path


def run_main(*args, d, capsys):
    """``daskdag ARGS`` in this process, in directory ``d``'s terms: ``(code, stdout, stderr,
    RESULT.npz's arrays)``."""
    code = main([str(a) for a in args] + ["--out", str(d / "res.npz")])
    out, err = capsys.readouterr()
    assert code == 0, err
    return code, out, err, dict(np.load(d / "res.npz"))


@pytest.mark.timeout(60)
def test_wrt_names_the_inputs_differentiated_and_progress_shows_dasks_bar(options_dag, capsys):
    d = options_dag
    _, out, err, res = run_main("run", d / "options_dag.py", "--inputs", d / "in.npz", "--outputs",
                                "D", "--wrt", "a,b", "--progress", d=d, capsys=capsys)
    assert set(res) == {"D.value", "D.grad.a", "D.grad.b"}  # not c, nor params
    value, (ga, gb) = jax.value_and_grad(_d, argnums=(0, 1))(A, B, PARAMS, C)
    np.testing.assert_allclose(res["D.value"], value, rtol=1e-5)
    np.testing.assert_allclose(res["D.grad.a"], ga, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res["D.grad.b"], gb, rtol=1e-5, atol=1e-6)
    # --progress: Dask's bar, on stderr, to its end; stdout has the summary alone.
    assert "100% Completed" in err and "Completed" not in out
    assert out.startswith("output") and "a: float32[5], b: float32[5]" in out

    # A node in --wrt: d D / d M's value (M held as it is), by JAX on the tail of the DAG; and
    # without --progress, no bar.
    _, out, err, res = run_main("run", d / "options_dag.py", "--inputs", d / "in.npz", "--outputs",
                                "D", "--wrt", "c,M", d=d, capsys=capsys)
    assert set(res) == {"D.value", "D.grad.c", "D.grad.M"}
    m = _m(A, B, PARAMS)
    gm, gc = jax.grad(lambda m, c: _d_of_q(_q(m, c)), argnums=(0, 1))(m, C)
    np.testing.assert_allclose(res["D.grad.M"], gm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res["D.grad.c"], gc, rtol=1e-5, atol=1e-6)
    assert "Completed" not in err


@pytest.mark.timeout(60)
def test_dict_inputs_and_outputs_leaf_by_leaf_with_cotangents(options_dag, capsys):
    """params.w / params.b keys build the dict input; a dict output Q seeded by cotangents given
    leaf by leaf (Q.s, Q.t); results keyed D.grad.params.w, Q.value.s, Q.grad.params.b."""
    d = options_dag
    ct = {"s": np.linspace(-1.0, 1.0, 5).astype(np.float32), "t": np.float32(0.5)}
    np.savez(d / "ct.npz", **{f"Q.{k}": v for k, v in ct.items()})
    _, out, _, res = run_main("run", f"{d / 'options_dag.py'}:dag", "--inputs", d / "in.npz",
                                "--outputs", "D,Q", "--cotangents", d / "ct.npz", d=d,
                                capsys=capsys)
    grads = [f"{o}.grad.{i}" for o in "DQ" for i in ("a", "b", "c", "params.w", "params.b")]
    assert set(res) == {"D.value", "Q.value.s", "Q.value.t", *grads}
    value, grad = jax.value_and_grad(_d, argnums=(0, 1, 2, 3))(A, B, PARAMS, C)
    q, pullback = jax.vjp(lambda *x: _q(_m(*x[:3]), x[3]), A, B, PARAMS, C)
    seeded = pullback({k: jnp.asarray(v) for k, v in ct.items()})
    np.testing.assert_allclose(res["D.value"], value, rtol=1e-5)
    np.testing.assert_allclose(res["Q.value.s"], q["s"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res["Q.value.t"], q["t"], rtol=1e-5)
    for o, g in (("D", grad), ("Q", seeded)):
        for k, i in enumerate("abc"):
            np.testing.assert_allclose(res[f"{o}.grad.{i}"], g[(0, 1, 3)[k]], rtol=1e-5,
                                       atol=1e-6)
        for leaf in ("w", "b"):
            np.testing.assert_allclose(res[f"{o}.grad.params.{leaf}"], g[2][leaf], rtol=1e-5,
                                       atol=1e-6)
    assert "params.w: float32[5]" in out and "s: float32[5], t: float32[]" in out


@pytest.mark.timeout(60)
def test_sweep_cotangents_are_one_items_for_every_item(pipeline, tmp_path, capsys):
    """A vector output A of each item, seeded by one item's cotangent, the same for each."""
    ct = np.linspace(-2.0, 1.0, 5).astype(np.float32)
    np.savez(tmp_path / "items.npz", x=XS)
    np.savez(tmp_path / "ct.npz", A=ct)
    _, out, err, res = run_main("sweep", f"{pipeline}:dag", "--inputs", tmp_path / "items.npz",
                                "--outputs", "A,D", "--cotangents", tmp_path / "ct.npz",
                                "--chunk-size", "3", "--quiet", d=tmp_path, capsys=capsys)
    g = seed_functions()
    for i, x in enumerate(XS):
        a, pullback = jax.vjp(g["x_to_A"], jnp.asarray(x))
        np.testing.assert_allclose(res["A.value"][i], a, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(res["A.grad.x"][i], pullback(jnp.asarray(ct))[0], rtol=1e-5,
                                   atol=1e-6)
    values, grads = jax.vmap(jax.value_and_grad(composed("D")))(jnp.asarray(XS))
    np.testing.assert_allclose(res["D.value"], values, rtol=1e-5)
    np.testing.assert_allclose(res["D.grad.x"], grads, rtol=1e-5, atol=1e-6)
    assert out == "" and "items" not in err  # --quiet: no summary, no bar


@pytest.mark.timeout(60)
def test_certs_host_days_and_force(tmp_path, capsys):
    from cryptography import x509

    d = tmp_path / "certs"
    assert main(["certs", str(d), "--host", "dask.example.org", "--host", "10.0.0.5",
                 "--days", "90"]) == 0
    assert capsys.readouterr().out.split() == [str(d / f) for f in CERT_FILES]
    assert sans(d / "cert.pem") == ["localhost", "127.0.0.1", "::1", "scheduler",
                                    "daskdag-scheduler", "dask.example.org", "10.0.0.5"]
    for f in ("ca.pem", "cert.pem"):
        cert = x509.load_pem_x509_certificate((d / f).read_bytes())
        valid = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert abs(valid.total_seconds() - (90 * 86400 + 300)) < 5, (f, valid)  # (5 min back)
    assert (d / "key.pem").stat().st_mode & 0o777 == 0o600
    before = {f: (d / f).read_bytes() for f in CERT_FILES}
    # --force replaces all three (a new CA: the old key is gone), with the default 365 days.
    assert main(["certs", str(d), "--force"]) == 0
    assert all((d / f).read_bytes() != before[f] for f in CERT_FILES)
    cert = x509.load_pem_x509_certificate((d / "cert.pem").read_bytes())
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days == 365
    assert "dask.example.org" not in sans(d / "cert.pem")


@pytest.mark.timeout(60)
def test_a_tls_address_without_tls_files_is_exit_2(pipeline, tmp_path, capsys):
    np.savez(tmp_path / "in.npz", x=X)
    code = main(["run", str(pipeline), "--inputs", str(tmp_path / "in.npz"), "--outputs", "D",
                 "--scheduler", f"tls://127.0.0.1:{free_port()}", "--out",
                 str(tmp_path / "res.npz")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "speaks TLS: give --tls DIR" in err


# -- Ctrl-C, and a resumed sweep's progress bar ----------------------------------------------

SLOW_DAG = textwrap.dedent('''
    import time

    import jax.numpy as jnp


    def slow(x):  # each item: 0.25 s, noted in computed.log (in the command's directory)
        time.sleep(0.25)
        with open("computed.log", "a") as f:
            f.write("item\\n")
        return jnp.sum(jnp.sin(x) ** 2)


    def sleeper(x):
        open("started", "w").close()
        time.sleep(60)
        return jnp.sum(x)


    dag = {"L": (slow, ["x"]), "Z": (sleeper, ["x"])}
''')
N_ITEMS = 24  # 3 s of sleep on two threads: a margin for Ctrl-C to land before the last
ITEMS = (np.random.default_rng(1).random((N_ITEMS, 3)) + 0.1).astype(np.float32)


@pytest.fixture
def slow_dag(tmp_path):
    (tmp_path / "slow_dag.py").write_text(SLOW_DAG)
    np.savez(tmp_path / "in.npz", x=X)
    np.savez(tmp_path / "items.npz", x=ITEMS)
    return tmp_path


def _computed(d: Path) -> int:
    log = d / "computed.log"
    return len(log.read_text().split()) if log.exists() else 0


@pytest.mark.timeout(150)
@pytest.mark.subprocess
def test_ctrl_c_while_a_node_sleeps_is_exit_130(slow_dag):
    command = Command("run", "slow_dag.py", "--inputs", "in.npz", "--outputs", "Z", "--out",
                      "res.npz", cwd=slow_dag, interruptible=True)
    eventually(lambda: (slow_dag / "started").exists() or command.proc.poll() is not None, 120,
               "the node started")
    assert command.proc.poll() is None, command.finish()
    sent = time.time()
    command.proc.send_signal(signal.SIGINT)
    code, _, err = command.finish(timeout=60)
    assert code == 130, err
    assert err.strip().splitlines()[-1] == "daskdag run: error: interrupted"
    assert command.ended - sent < 30  # (the node sleeps 60 s: it is not waited for)
    assert not (slow_dag / "res.npz").exists()


@pytest.mark.timeout(240)
@pytest.mark.subprocess
def test_ctrl_c_says_what_is_stored_and_the_resumed_sweeps_bar_counts_it(slow_dag):
    """A sweep with --store, SIGINT once a piece of it is saved: exit 130 saying how many items
    the store holds. The same command again computes only the others, its bar counting the
    stored items as done from its first count on, and writes what JAX gives for all."""
    from .support.interrupts import pieces

    store = slow_dag / "store"
    args = ["sweep", "slow_dag.py:dag", "--inputs", "items.npz", "--outputs", "L", "--store",
            "store", "--out", "res.npz"]
    first = Command(*args, cwd=slow_dag, interruptible=True)
    eventually(lambda: pieces(store) or first.proc.poll() is not None, 120, "a piece saved")
    assert first.proc.poll() is None, first.finish()
    first.proc.send_signal(signal.SIGINT)
    code, _, err = first.finish(timeout=60)
    saved = sum(b - a for a, b in pieces(store))
    assert code == 130, err
    assert re.search(rf"daskdag sweep: error: interrupted: {saved} of {N_ITEMS} items saved in "
                     rf"\S*store; run the same call again to resume", err), err[-2000:]
    assert 0 < saved < N_ITEMS and not (slow_dag / "res.npz").exists()

    before = _computed(slow_dag)
    second = Command(*args, cwd=slow_dag)
    code, _, err = second.finish(timeout=120)
    assert code == 0, err
    assert _computed(slow_dag) - before == N_ITEMS - saved  # (none of the stored ones again)
    counts = [int(n) for n in re.findall(rf"(\d+)/{N_ITEMS} items", err)]
    # tqdm draws the bar at 0 as it opens; its first count after that is the stored items.
    assert counts[0] == 0 and counts[1] == saved, counts
    assert counts == sorted(counts) and counts[-1] == N_ITEMS, counts
    res = dict(np.load(slow_dag / "res.npz"))
    values, grads = jax.vmap(jax.value_and_grad(lambda x: jnp.sum(jnp.sin(x) ** 2)))(ITEMS)
    np.testing.assert_allclose(res["L.value"], values, rtol=1e-5)
    np.testing.assert_allclose(res["L.grad.x"], grads, rtol=1e-5, atol=1e-6)


STORED_DAG = textwrap.dedent('''
    import os
    import time

    import jax.numpy as jnp


    def first(x):  # noted in first.log (in the command's directory) each time it runs
        with open("first.log", "a") as f:
            f.write("ran\\n")
        return jnp.sin(x)


    def then(a):  # waits until the file "go" exists
        while not os.path.exists("go"):
            time.sleep(0.02)
        return jnp.sum(a ** 2)


    dag = {"A": (first, ["x"]), "L": (then, ["A"])}
''')


@pytest.mark.timeout(240)
@pytest.mark.subprocess
def test_run_with_a_store_killed_resumes_from_its_finished_nodes(tmp_path):
    """``daskdag run --store``, SIGKILLed while its second node waits, its first stored: the
    same command again runs only the second (the first one's log has one line), and writes
    what JAX gives; the same store with other inputs is exit 5, naming what changed."""
    (tmp_path / "stored_dag.py").write_text(STORED_DAG)
    np.savez(tmp_path / "in.npz", x=X)
    args = ["run", "stored_dag.py", "--inputs", "in.npz", "--outputs", "L", "--store", "store",
            "--out", "res.npz"]
    killed = Command(*args, cwd=tmp_path)
    marks = tmp_path / "store" / "stages"
    eventually(lambda: any("sha256" in m.read_text() for m in marks.glob("*%3AA%3A*/zarr.json"))
               or killed.proc.poll() is not None, 120, "node A stored")
    assert killed.proc.poll() is None, killed.finish()
    killed.proc.send_signal(signal.SIGKILL)
    killed.finish(timeout=60)
    (tmp_path / "go").touch()
    code, _, err = Command(*args, cwd=tmp_path).finish(timeout=120)
    assert code == 0, err
    assert (tmp_path / "first.log").read_text().split() == ["ran"]  # (A was read back)
    res = dict(np.load(tmp_path / "res.npz"))
    value, grad = jax.value_and_grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(X)
    np.testing.assert_allclose(res["L.value"], value, rtol=1e-5)
    np.testing.assert_allclose(res["L.grad.x"], grad, rtol=1e-5, atol=1e-6)
    np.savez(tmp_path / "in.npz", x=X + 1)
    code, _, err = Command(*args, cwd=tmp_path).finish(timeout=120)
    assert code == 5 and "holds another call" in err and "'x'" in err, err


# -- a TLS cluster, started with the `dask` command ------------------------------------------------

def _scheduler_address(path: Path, proc, timeout: float = 180) -> str:
    """The address in the scheduler file ``path``, read until it parses (a cold start imports a
    lot; the file may be seen half-written)."""
    def address():
        assert proc.poll() is None, f"the dask scheduler exited with {proc.returncode}"
        try:
            return json.loads(path.read_text())["address"]
        except (OSError, ValueError, KeyError):
            return None

    return eventually(address, timeout, "the scheduler wrote its address")


@pytest.fixture(scope="module")
def tls_cluster(certs, tmp_path_factory):  # noqa: F811
    """A scheduler and a worker that speak TLS alone, started with the ``dask`` command as on a
    remote cluster (nothing of this repository on their path), with the certificates ``daskdag
    certs`` wrote (test_deploy's fixture). Yields the scheduler's address."""
    cli = DaskCLI(tmp_path_factory.mktemp("tls-cluster"))
    tls = [a for flag, f in zip(TLS_FLAGS, CERT_FILES) for a in (flag, str(certs / f))]
    try:
        scheduler = cli.start("scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                              "--protocol", "tls", *tls,
                              "--scheduler-file", str(cli.scheduler_file))
        address = _scheduler_address(cli.scheduler_file, scheduler)
        cli.worker(*tls)
        yield address
    finally:
        cli.stop()


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_run_on_a_tls_cluster(tls_cluster, certs, pipeline, tmp_path):  # noqa: F811
    from distributed import Client

    from daskdag.cli import security

    assert tls_cluster.startswith("tls://127.0.0.1:")
    np.savez(tmp_path / "in.npz", x=X)
    # No scheme: --tls gives it tls://.
    run = Command("run", f"{pipeline}:dag", "--inputs", "in.npz", "--outputs", "D,E",
                  "--scheduler", tls_cluster.removeprefix("tls://"), "--tls", certs,
                  "--out", "res.npz", cwd=tmp_path)
    with Client(tls_cluster, security=security(certs), timeout=60, set_as_default=False) as c:
        c.wait_for_workers(1, timeout=120)  # (meanwhile)
        assert all(w.startswith("tls://") for w in c.scheduler_info()["workers"])
    code, _, err = run.finish(timeout=180)
    assert code == 0, err
    check_run(dict(np.load(tmp_path / "res.npz")))
