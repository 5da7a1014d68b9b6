import contextlib
import functools
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def assert_tree_close(actual, expected, rtol=1e-5, atol=1e-6):
    """Same pytree structure, leaves equal within tolerance."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


class TraceLog(list):
    """A list that node functions append to as they are traced. It pickles as a reference to
    itself in this process, so its growing does not change the content token of the functions
    that close over it (a plain list would: daskdag would then rightly trace them anew on the
    next call, as after any in-place change to what a function closes over)."""

    def __reduce__(self):
        _TRACE_LOGS[id(self)] = self
        return _trace_log, (id(self),)


_TRACE_LOGS: "weakref.WeakValueDictionary[int, TraceLog]" = weakref.WeakValueDictionary()


def _trace_log(key: int):
    # Looked up through the module: a global read here would travel, by value, with the log.
    # In another process (a worker), a list of its own: traces there are not counted.
    return getattr(sys.modules.get(__name__), "_TRACE_LOGS", {}).get(key, [])


class Counted:
    """Wraps a node function and counts its calls: ``calls`` on values (JAX's vjp and jvp
    tracers carry them), ``abstract`` on shapes alone (``jax.eval_shape``, ``jax.jit``'s trace)."""

    def __init__(self, fn):
        self.fn, self.calls, self.abstract = fn, 0, 0

    def __call__(self, *args):
        if any(type(a).__name__ == "DynamicJaxprTracer" for a in jax.tree.leaves(args)):
            self.abstract += 1
        else:
            self.calls += 1
        return self.fn(*args)


def seed_functions():
    """The seed question's DAG with concrete functions (x -> A -> B -> C -> D, B -> E)."""
    return {
        "x_to_A": lambda x: jnp.sin(x) * 2.0,
        "A_to_B": lambda A: A ** 2 + 1.0,
        "B_to_C": lambda B: jnp.cumsum(B) / 3.0,
        "C_to_D": lambda C: jnp.sum(jnp.log(C)),
        "B_to_E": lambda B: jnp.sum(jnp.sqrt(B) * jnp.arange(B.shape[0])),
    }


@pytest.fixture
def seed():
    f = {k: Counted(v) for k, v in seed_functions().items()}
    dag = {"A": (f["x_to_A"], ["x"]), "B": (f["A_to_B"], ["A"]), "C": (f["B_to_C"], ["B"]),
           "D": (f["C_to_D"], ["C"]), "E": (f["B_to_E"], ["B"])}
    g = seed_functions()
    composed = {"D": lambda x: g["C_to_D"](g["B_to_C"](g["A_to_B"](g["x_to_A"](x)))),
                "E": lambda x: g["B_to_E"](g["A_to_B"](g["x_to_A"](x)))}
    return dag, f, composed


@pytest.fixture
def x64():
    """Float64 everywhere, dask's worker threads included (jax.experimental.enable_x64 is a
    context of the calling thread only); restored after."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.fixture
def x5():
    return jnp.array([1.0, 2.0, 3.0, 4.0, 5.0], dtype=jnp.float32)


def key_kind(key) -> str:
    """The kind of a daskdag task key, ``fwd:B+C-<token>`` -> ``fwd`` (``bwd``, ``val``,
    ``grad``, ``jvp``, ``tan``, ``input``, ``node``, ...); ``""`` for another key."""
    head = str(key).partition("-")[0]
    return head.partition(":")[0] if ":" in head else ""


def key_label(key) -> str:
    """What a daskdag task key names: ``fwd:B+C-<token>`` -> ``B+C`` (a stage's nodes);
    ``bwd:B+C[D+E]-<token>`` -> ``B+C`` (and :func:`key_outputs` -> ``D+E``)."""
    return str(key).rpartition("-")[0].partition(":")[2].partition("[")[0]


def key_outputs(key) -> str:
    """The bracketed part of a daskdag key's label: a backward task's outputs, a gradient's
    input (``grad:D[x]-<token>`` -> ``x``)."""
    return str(key).rpartition("-")[0].partition("[")[2].rstrip("]")


def eventually(check, timeout=30.0, what=None, details=None):
    """Poll ``check()`` until it returns something true (the scheduler and client release keys
    asynchronously), and return that. If it is still false after ``timeout`` seconds, fail with
    an AssertionError naming ``what`` was waited for (default: the source of ``check``) and for
    how long, followed by ``details()`` (called then) when given."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            message = f"still not true after {timeout:g} s: {what or _described(check)}"
            if details is not None:
                message += f" ({details()})"
            raise AssertionError(message)
        time.sleep(0.05)
    return result


def _described(check) -> str:
    """``check``'s source (a lambda's line, trimmed), else its name."""
    import inspect

    try:
        return " ".join(inspect.getsource(check).split())
    except (OSError, TypeError):
        return getattr(check, "__qualname__", repr(check))


def live_workers(client) -> dict:
    """``{address: info}`` of the cluster's workers, asked of the scheduler now (its cached
    ``scheduler_info()`` may not have them yet)."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def scheduler_tasks(client) -> int:
    """How many tasks the scheduler holds."""
    return client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))


def kept_keys(client) -> set:
    """The keys of the values ``client`` keeps on the cluster for later calls
    (:mod:`daskdag.running.resident`)."""
    from daskdag.running import resident
    kept = resident.of(client)
    return {f.key for f in kept.futures.values()} if kept else set()


def only_kept_left(client, before: int) -> bool:
    """The scheduler holds its ``before`` tasks and the values ``client`` keeps for later calls,
    and the client holds futures of those values alone: nothing else of the calls stayed."""
    kept = kept_keys(client)
    return scheduler_tasks(client) == before + len(kept) and set(client.futures) == kept


def wait_only_kept_left(client, before: int, timeout: float = 30.0, what: str = "the calls"):
    """Wait until :func:`only_kept_left`; else fail, saying what the scheduler and the client
    still held."""
    eventually(lambda: only_kept_left(client, before), timeout,
               f"{what} left nothing on the scheduler or in the client but the kept values",
               lambda: f"the scheduler holds {scheduler_tasks(client)} tasks, {before} before the "
                       f"calls and {len(kept_keys(client))} kept values; the client holds "
                       f"{len(client.futures)} futures")


# -- clusters: one set-up for the tests that start a LocalCluster ----------------------------------

# (The dashboard on a free port: dashboard_address=None means distributed's default :8787, and
# every cluster after the first warned that the port was taken.)
LOCAL_CLUSTER = dict(threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0")


@contextlib.contextmanager
def local_cluster(n_workers: int = 2, **kw):
    """A ``distributed.LocalCluster`` of ``n_workers`` single-threaded worker processes (under
    nannies) on 127.0.0.1, its dashboard on a free port (:data:`LOCAL_CLUSTER`); ``kw`` adds or overrides
    LocalCluster's arguments (``resources=``, ``memory_limit=``, ``threads_per_worker=``...)."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=n_workers, **{**LOCAL_CLUSTER, **kw}) as cluster:
        yield cluster


@contextlib.contextmanager
def local_client(n_workers: int = 2, *, client_options: dict | None = None,
                 workers_timeout: float = 120, **kw):
    """A client of a new :func:`local_cluster` (``n_workers``, ``kw``), once its workers are all
    there; not the default client unless ``client_options`` says ``set_as_default=True``.
    ``client.cluster`` is the cluster."""
    from distributed import Client

    with local_cluster(n_workers, **kw) as cluster, \
            Client(cluster, **{"set_as_default": False, **(client_options or {})}) as client:
        if n_workers:
            client.wait_for_workers(n_workers, timeout=workers_timeout)
        yield client


@pytest.fixture(scope="module")
def cluster(request):
    """One :func:`local_cluster` for the test module, two workers unless the module sets
    ``CLUSTER = {...}``: :func:`local_cluster`'s arguments."""
    with local_cluster(**getattr(request.module, "CLUSTER", {})) as cluster:
        yield cluster


@pytest.fixture
def client(cluster):
    """A client of its own for the test (what daskdag keeps, it keeps per client), of the
    module's :func:`cluster`."""
    from distributed import Client

    with Client(cluster, set_as_default=False) as client:
        yield client


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunLog:
    """Where node functions note each run, with the process they ran in: a file, which worker
    processes on this machine append to as well. :meth:`wrap` gives a function that notes its
    name, then runs ``fn`` (for an eager node, each run; under ``jax.jit``, each trace); it
    travels to workers by value (functions of this module are not installed code)."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.touch()

    def wrap(self, name: str, fn):
        return _noting(str(self.path), name, fn)

    def runs(self) -> list[tuple[str, int]]:
        """``(name, pid)`` of each run so far, in order."""
        return [(name, int(pid)) for name, pid in
                (line.rsplit(" ", 1) for line in self.path.read_text().splitlines())]

    def pids(self, name: str) -> list[int]:
        """The process of each run of ``name``."""
        return [pid for n, pid in self.runs() if n == name]


def _noting(path: str, name: str, fn):
    @functools.wraps(fn)
    def noting(*args, **kwargs):
        import os

        with open(path, "a") as log:
            log.write(f"{name} {os.getpid()}\n")
        return fn(*args, **kwargs)

    return noting


def compute_split(client, dag, x, outputs, fwd_on, bwd_on, lazy=None, field="grad", **kw):
    """Forward tasks on worker ``fwd_on``, then everything else on ``bwd_on``.

    The second submission finds the forward keys in memory and reuses them, so every backward
    task must fetch its pullback from the other process (an output's stage keeps its backward
    task apart: ``daskdag.close-stages`` off). ``lazy``: the lazy call, ``daskdag.grads``
    (default) or ``daskdag.jacobians``, given ``kw``. Returns ``({output: (value, {input:
    grad})}, {key: worker it ran on})``; ``field``: the result's field that stands for ``grad``
    (``"hvp"`` for ``daskdag.hvps``).
    """
    import dask
    import distributed

    import daskdag

    with dask.config.set({"daskdag.close-stages": False}):
        call = (lazy or daskdag.grads)(dag, x, outputs, **kw)
    dsk = dict(call.__dask_graph__())
    fwd_keys = [k for k in dsk if key_kind(k) in ("fwd", "val")]
    with distributed.get_task_stream(client) as ts:
        held = client.get(dsk, fwd_keys, workers=[fwd_on], sync=False)
        with client.as_current():
            distributed.wait(held)
        computed = client.compute(call, workers=[bwd_on], sync=True)
    del held
    ran = {t["key"]: t["worker"] for t in ts.data}
    assert {w for k, w in ran.items() if key_kind(k) == "fwd"} == {fwd_on}
    assert {w for k, w in ran.items() if key_kind(k) == "bwd"} == {bwd_on}
    computed = {outputs: computed} if isinstance(outputs, str) else computed
    inputs = [d for _, deps in map(_entry, dag.values()) for d in deps if d not in dag]
    grads = {o: getattr(r, field) for o, r in computed.items()}
    return {o: (r.value, grads[o] if isinstance(grads[o], dict) and len(set(inputs)) > 1
                else {inputs[0]: grads[o]}) for o, r in computed.items()}, ran


def _entry(entry):
    """A DAG entry as ``(fn, deps)``."""
    return (entry.fn, entry.deps) if hasattr(entry, "deps") else entry


class DaskCLI:
    """Processes started with the ``dask`` command, as on a remote cluster: in ``directory``,
    with nothing of this repository on their path (daskdag itself is installed), their logs
    in ``directory/cluster.log``. ``stop()`` ends them, workers first."""

    def __init__(self, directory):
        import os

        self.directory, self.procs = directory, []
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.env["JAX_PLATFORMS"] = "cpu"
        self.scheduler_file = directory / "scheduler.json"
        self.log = open(directory / "cluster.log", "ab")

    def start(self, *args):
        import shutil
        import subprocess
        import sys
        from pathlib import Path

        dask = shutil.which("dask", path=str(Path(sys.executable).parent)) or shutil.which("dask")
        proc = subprocess.Popen([dask, *args], cwd=self.directory, env=self.env, stdout=self.log,
                                stderr=self.log)
        self.procs.append(proc)
        return proc

    def scheduler(self) -> str:
        """Start the scheduler; its address, once it wrote it (a cold start imports a lot)."""
        import json
        import time

        self.start("scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                   "--scheduler-file", str(self.scheduler_file))
        deadline = time.time() + 180
        while not self.scheduler_file.exists():
            assert time.time() < deadline, "the dask scheduler did not start in 180 s"
            time.sleep(0.2)
        time.sleep(0.2)  # (written, not half-written)
        return json.loads(self.scheduler_file.read_text())["address"]

    def worker(self, *args):
        return self.start("worker", "--scheduler-file", str(self.scheduler_file), "--nthreads", "1",
                          "--no-dashboard", "--host", "127.0.0.1", *args)

    def stop(self):
        import subprocess

        for p in reversed(self.procs):  # workers first, while the scheduler sees them go
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        self.log.close()


@pytest.fixture(scope="session")
def cli_cluster(tmp_path_factory):
    """A scheduler and two single-threaded workers started with the ``dask`` command
    (:class:`DaskCLI`), that cannot import this repository's modules. Yields its address."""
    cli = DaskCLI(tmp_path_factory.mktemp("cli-cluster"))
    try:
        address = cli.scheduler()
        cli.worker()
        cli.worker()
        yield address
    finally:
        cli.stop()


@pytest.fixture
def cli_client(cli_cluster):
    """A client of :func:`cli_cluster`, once its two workers are there."""
    from distributed import Client

    with Client(cli_cluster, set_as_default=False, timeout=60) as client:
        client.wait_for_workers(2, timeout=60)
        yield client


CTRL_C_CHILD = Path(__file__).with_name("ctrl_c_child.py")


def interrupt(target: str, tmp_path, progress: bool = False):
    """Start ``ctrl_c_child.py`` on ``target``, send it SIGINT once its first slow node runs.

    Returns ``(seconds until KeyboardInterrupt reached it, nodes started by then, nodes started
    1.5 s later, the process)``; the process waits on its stdin, which the caller closes.
    """
    log = tmp_path / f"starts-{target.replace('/', '_').replace(':', '_')}-{progress}"
    proc = subprocess.Popen([sys.executable, str(CTRL_C_CHILD), target, str(log)]
                            + (["progress"] if progress else []),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("ready")
    deadline = time.monotonic() + 60
    while not log.exists():  # the first node has started: the call is under way
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    time.sleep(0.2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    line = ""
    while not any(w in line for w in ("interrupted", "finished", "Error")):  # past progress bars
        line = proc.stdout.readline()
        assert line, "the child exited without a word"
    took = time.monotonic() - sent
    assert "interrupted" in line, line
    started = log.read_text().count("start")
    time.sleep(1.5)
    return took, started, log.read_text().count("start"), proc


# -- faults: distributed's log, calls that must end, workers killed ----------------------------------

class DistributedLog:
    """What distributed logged while a test ran: the records of the ``distributed`` loggers of
    this process (a ``LocalCluster``'s scheduler runs here), and the lines that files given to
    :meth:`watch` (a :class:`DaskCLI` cluster's ``cluster.log``) gained meanwhile.

    :data:`DEFECTS` are lines that mean daskdag misused distributed: one key submitted with two
    different task specs, or data placed with ``Client.scatter`` lost with its only holder.
    (distributed logs a graph's first ``run_spec`` collision in each task group at WARNING, the
    others of that group in the same graph at DEBUG: every colliding submission shows.)"""

    DEFECTS = ("different `run_spec`", "lose scattered data")

    def __init__(self):
        import logging

        self.records: list = []
        self.files: list = []  # (path, offset when watched)
        log = self

        class Handler(logging.Handler):
            def emit(self, record):
                try:
                    log.records.append(f"{record.name} {record.levelname}: {record.getMessage()}")
                except Exception:  # a message that cannot be formatted is no reason to fail here
                    log.records.append(f"{record.name} {record.levelname}: {record.msg!r}")

        self.handler = Handler(logging.DEBUG)
        self.reported: set = set()  # defects a check already failed on

    def watch(self, path) -> None:
        """Read ``path``'s lines from its current end, too."""
        path = Path(path)
        self.files.append((path, path.stat().st_size if path.exists() else 0))

    def lines(self) -> list[str]:
        lines = list(self.records)
        for path, offset in self.files:
            if path.exists():
                with open(path, "rb") as f:
                    f.seek(offset)
                    lines.extend(f.read().decode(errors="replace").splitlines())
        return lines

    def defects(self) -> list[str]:
        return [line for line in self.lines() if any(d in line for d in self.DEFECTS)]

    def check(self) -> None:
        """Fail, quoting them (shortened), if distributed logged a defect."""
        found = [d for d in self.defects() if d not in self.reported]  # each fails one check
        if found:
            self.reported.update(found)
            pytest.fail(f"distributed logged {len(found)} defect(s) (daskdag misused it):\n"
                        + "\n".join(line[:1500] for line in found[:5]), pytrace=False)


def _watching_distributed():
    """Yield a :class:`DistributedLog` attached to distributed's logger, then check it."""
    import logging

    log = DistributedLog()
    logger = logging.getLogger("distributed")
    logger.addHandler(log.handler)
    try:
        yield log
    finally:
        logger.removeHandler(log.handler)
    log.check()


@pytest.fixture
def distributed_log():
    """A :class:`DistributedLog` over the test; the test fails (at teardown) if distributed
    logged one of :data:`DistributedLog.DEFECTS`. Tests may call ``check()`` themselves, earlier."""
    yield from _watching_distributed()


@pytest.fixture(autouse=True)
def _no_distributed_defects(request):
    """Every cluster test (marker ``cluster``) fails on a line of
    :data:`DistributedLog.DEFECTS` that distributed logs in this process during it: treated as
    the defects they are, not as noise. (Tests that watch a cluster's log file too ask for
    :func:`distributed_log` themselves.)"""
    if request.node.get_closest_marker("cluster") is None or \
            "distributed_log" in request.fixturenames:
        yield
        return
    yield from _watching_distributed()


class Hung(AssertionError):
    """A call that did not return within its bound."""


def bounded(fn, seconds: float, what: str = "the call"):
    """``fn()``'s result, or what it raised, if it ends within ``seconds``; else fail with
    :class:`Hung`. ``fn`` runs in a daemon thread, so a hang costs ``seconds``, not the test's
    timeout (the thread stays stuck until its client closes). Returns ``(result, seconds
    taken)``."""
    import threading

    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True, name=f"bounded {what}")
    thread.start()
    thread.join(seconds)
    took = time.monotonic() - start
    if thread.is_alive():
        raise Hung(f"{what} did not return within {seconds:g} s: it hangs")
    if "error" in out:
        raise out["error"]
    return out["result"], took


def worker_pids(client) -> dict:
    """``{address: pid}`` of the cluster's worker processes."""
    import os

    return client.run(os.getpid)


def sigkill(pids) -> list:
    """SIGKILL each of ``pids``; returns those that were still there."""
    import os

    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def not_a_mismatch(call):
    """``call()``; a ClusterError saying the workers differ from this client (as a worker that
    died during daskdag's version check was reported) fails the test, plainly."""
    import daskdag

    try:
        return call()
    except daskdag.ClusterError as e:
        if "differ" in str(e):
            pytest.fail(f"workers that were killed were reported as a version mismatch: {e}")
        raise


# A LocalCluster closes for good the nanny of a worker whose name has been missing from the
# scheduler for this long (default 15 s): under repeated kills, or a restart slower than that on
# a loaded machine, the cluster shrinks for good. Tests that kill workers keep their nannies.
KEEP_NANNIES = {"distributed.deploy.lost-worker-timeout": "1 hour"}
