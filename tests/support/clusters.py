"""Clusters for the tests: ``LocalCluster`` set-ups, the ``dask scheduler`` / ``dask worker``
commands (:class:`DaskCLI`), what a cluster keeps between calls, where nodes ran. Their processes
preload :mod:`.hangs`' module, and they are registered there while they live: a test that times
out shows the stacks of each."""

import contextlib
import functools
import socket
import time
from pathlib import Path


from . import hangs
from .keys import key_kind


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


def task_states(client) -> dict:
    """``{key: state}`` of every task the scheduler holds."""
    return client.run_on_scheduler(
        lambda dask_scheduler: {str(k): ts.state for k, ts in dask_scheduler.tasks.items()})


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

#: What the forkserver of :func:`fork_workers` imports once, beside distributed's own list:
#: JAX, whose import is most of a worker's start. (Not daskdag: a worker imports it when a
#: task or a plugin of daskdag's comes, as a user's worker does.)
PRELOADED = ("jax", "jax.numpy", "scipy.linalg")


_forking = False


def fork_workers() -> None:
    """The ``LocalCluster`` workers that this process starts from now on (nannies restarting
    them too) fork from one forkserver, started now, that imported distributed's packages and
    :data:`PRELOADED` once: a worker starts in a fraction of a second instead of importing
    them anew (distributed's own test suite does the same). The forkserver has this process's
    environment and ``sys.path`` as they are now; a test whose workers must start as a user's
    do (reading the environment or ``sys.path`` at their start, their malloc tuned from the
    environment, JAX not imported yet) is marked ``spawn`` (``tests/conftest.py``). Once a
    process: later calls do nothing."""
    global _forking
    if _forking:
        return
    _forking = True
    import importlib.util
    import multiprocessing.forkserver

    import dask
    from distributed.utils import get_mp_context
    from distributed.versions import optional_packages, required_packages

    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    context = get_mp_context()  # (it sets distributed's own preload list: replaced here)
    packages = ["distributed", *required_packages, *optional_packages, *PRELOADED]
    context.set_forkserver_preload(
        [p for p in dict.fromkeys(packages) if importlib.util.find_spec(p.split(".")[0])])
    multiprocessing.forkserver.ensure_running()

# (The dashboard on a free port: dashboard_address=None means distributed's default :8787, and
# every cluster after the first warned that the port was taken.)
LOCAL_CLUSTER = dict(threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0")


@contextlib.contextmanager
def local_cluster(n_workers: int = 2, **kw):
    """A ``distributed.LocalCluster`` of ``n_workers`` single-threaded worker processes (under
    nannies) on 127.0.0.1, its dashboard on a free port (:data:`LOCAL_CLUSTER`); ``kw`` adds or overrides
    LocalCluster's arguments (``resources=``, ``memory_limit=``, ``threads_per_worker=``...).
    Worker processes preload :func:`.hangs.preload_file` too (after those of ``preload=``, else
    of ``distributed.worker.preload``), and the cluster is registered with :mod:`.hangs` while
    it lives."""
    import dask
    from distributed import LocalCluster

    kw = {**LOCAL_CLUSTER, **kw}
    if kw.get("processes"):
        preload = kw.get("preload")
        if preload is None:
            preload = dask.config.get("distributed.worker.preload", None) or []
        kw["preload"] = [*([preload] if isinstance(preload, str) else preload),
                         hangs.preload_file()]
    with LocalCluster(n_workers=n_workers, **kw) as cluster, \
            hangs.watching(cluster, f"LocalCluster {cluster.scheduler_address}",
                           lambda: hangs.local_cluster_processes(cluster)):
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


#: The kinds of a forward task's key: ``jvp`` where it pushes tangents (a Hessian-vector
#: product's forward tasks, on the lifted DAG).
FORWARD = ("fwd", "jvp")


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
    fwd_keys = [k for k in dsk if key_kind(k) in FORWARD + ("val",)]
    with distributed.get_task_stream(client) as ts:
        held = client.get(dsk, fwd_keys, workers=[fwd_on], sync=False)
        with client.as_current():
            distributed.wait(held)
        computed = client.compute(call, workers=[bwd_on], sync=True)
    del held
    ran = {t["key"]: t["worker"] for t in ts.data}
    assert {w for k, w in ran.items() if key_kind(k) in FORWARD} == {fwd_on}
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
    in ``directory/cluster.log``. ``stop()`` ends them, workers first. Schedulers, nannies and
    workers preload :func:`.hangs.preload_file`; the processes are registered with
    :mod:`.hangs` from the first start to ``stop()``."""

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
        if args and args[0] in ("scheduler", "worker"):  # (so that a hang shows their stacks)
            preload = hangs.preload_file()
            nanny = ["--preload-nanny", preload] if args[0] == "worker" else []
            args = (args[0], "--preload", preload, *nanny, *args[1:])
        proc = subprocess.Popen([dask, *args], cwd=self.directory, env=self.env, stdout=self.log,
                                stderr=self.log)
        self.procs.append(proc)
        hangs.watch(self, f"DaskCLI in {self.directory}", lambda: hangs.cli_processes(self))
        return proc

    def scheduler(self) -> str:
        """Start the scheduler; its address, once it wrote it (a cold start imports a lot)."""
        import json
        import time

        self.scheduler_file.unlink(missing_ok=True)  # (a file left from before: not this one's)
        proc = self.start("scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                          "--scheduler-file", str(self.scheduler_file))
        deadline = time.monotonic() + 180
        while True:  # until the file is there and whole: JSON with the address (not half-written)
            try:
                address = json.loads(self.scheduler_file.read_text())["address"]
            except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
                address = None
            if address:
                return address
            assert proc.poll() is None, f"the dask scheduler exited ({proc.returncode}): see {self.log.name}"
            assert time.monotonic() < deadline, "the dask scheduler did not start in 180 s"
            time.sleep(0.05)

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
        hangs.unwatch(self)
        self.log.close()
