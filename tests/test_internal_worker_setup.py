"""daskdag's worker plugin (daskdag/running/workers.py): glibc's malloc thresholds raised in workers
that distributed's nanny started with MALLOC_TRIM_THRESHOLD_, on every worker, later ones too,
when turned on (daskdag.tune-workers: true), and not at all by default or when turned off."""

import os
import platform
import time

import dask
import jax
import jax.numpy as jnp
import pytest

import daskdag
from daskdag.running import workers as worker_setup
from daskdag.transport import malloc
from .support.clusters import DaskCLI, local_client
from .support.numbers import assert_tree_close

# Workers started as a user's are: their environment, malloc and imports read at their start.
pytestmark = pytest.mark.spawn

X = jnp.linspace(-1.0, 1.0, 5)
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
EXPECTED = {"M_MMAP_THRESHOLD": malloc.MMAP_THRESHOLD,
            "M_TRIM_THRESHOLD": malloc.TRIM_THRESHOLD}


def _dag():
    # Made inside a function so cloudpickle ships them by value to worker processes.
    return {"A": (lambda x: jnp.tanh(x) * 3, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}


def _grad(x):
    return jax.grad(lambda x: jnp.sum((jnp.tanh(x) * 3) ** 2))(x)


def _states(client) -> dict:
    """Per worker: its MALLOC_TRIM_THRESHOLD_ and what the plugin applied there, if it has it."""
    def state(dask_worker, name=worker_setup.NAME):  # nested: travels by value to any worker
        import os
        plugin = dask_worker.plugins.get(name)
        return {"env": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
                "applied": None if plugin is None else plugin.applied,
                "reason": None if plugin is None else plugin.reason}
    return client.run(state)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_every_worker_tuned_later_ones_too_and_results_unchanged():
    with local_client(1) as client, dask.config.set({"daskdag.tune-workers": True}):
        res = daskdag.compute_grads(_dag(), X, "B", client=client)
        assert_tree_close(res.grad, _grad(X))
        states = _states(client)
        assert len(states) == 1
        for state in states.values():
            assert state["env"] == "65536"  # the nanny's setting, which the plugin works around
            assert state["applied"] == (EXPECTED if GLIBC else None), state["reason"]

        client.cluster.scale(2)  # a worker that joins after the call gets it from the scheduler
        client.wait_for_workers(2, timeout=120)
        states = _states(client)
        assert len(states) == 2
        for state in states.values():
            assert state["applied"] == (EXPECTED if GLIBC else None), state["reason"]

        # A second call and a sweep on the tuned workers: same gradients as jax.grad.
        assert_tree_close(daskdag.compute_grads(_dag(), X, "B", client=client).grad, _grad(X))
        xs = jnp.stack([X, X * 0.5, -X])
        swept = daskdag.sweep_grads(_dag(), xs, "B", client=client, chunk_size=1)
        assert_tree_close(swept.grad, jax.vmap(_grad)(xs))


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_worker_without_this_module_still_starts_and_is_tuned(tmp_path):
    """The plugin travels by value: a worker joining with a daskdag that lacks daskdag.running.workers
    (an older release) unpickles it at start instead of failing to start."""
    blocker = tmp_path / "no_workers_module.py"  # a --preload module, imported at the worker's start
    blocker.write_text("import sys\nsys.modules['daskdag.running.workers'] = None  # import fails\n")
    cli = DaskCLI(tmp_path)
    try:
        with local_client(1) as client, dask.config.set({"daskdag.tune-workers": True}):
            assert_tree_close(daskdag.compute_grads(_dag(), X, "B", client=client).grad, _grad(X))
            cli.start("worker", client.cluster.scheduler_address, "--nthreads", "1",
                      "--no-dashboard", "--host", "127.0.0.1", "--preload", str(blocker))
            client.wait_for_workers(2, timeout=180)
            states = _states(client)
            assert len(states) == 2
            for state in states.values():
                assert state["applied"] == (EXPECTED if GLIBC else None), state["reason"]
    finally:
        cli.stop()


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_off_by_default_the_users_workers_are_left_as_distributed_started_them():
    """Nothing of daskdag's changes the malloc of the user's workers unless asked to."""
    with local_client(1) as client:
        res = daskdag.compute_grads(_dag(), X, "B", client=client)
        assert_tree_close(res.grad, _grad(X))
        assert worker_setup.NAME not in client.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.worker_plugins))
        assert all(s["env"] == "65536" and s["applied"] is None and s["reason"] is None
                   for s in _states(client).values())


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_switched_off_nothing_is_registered():
    with local_client(1) as client, dask.config.set({"daskdag.tune-workers": False}):
        res = daskdag.compute_grads(_dag(), X, "B", client=client)
        assert_tree_close(res.grad, _grad(X))
        assert worker_setup.NAME not in client.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.worker_plugins))
        assert all(s["applied"] is None and s["reason"] is None for s in _states(client).values())


@pytest.mark.timeout(30)
def test_setup_is_a_no_op_where_there_is_nothing_to_restore(monkeypatch):
    # In this process, without touching its malloc: not glibc, or no nanny setting to undo.
    def not_glibc(name):
        raise ValueError("unrecognized configuration name")

    with monkeypatch.context() as m:
        m.setattr(os, "confstr", not_glibc)
        m.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
        plugin = worker_setup.TuneMalloc()
        plugin.setup(worker=None)
        assert (plugin.applied, plugin.reason) == (None, "not glibc")
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    plugin = worker_setup.TuneMalloc()
    plugin.setup(worker=None)
    assert plugin.applied is None


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_worker_joining_later_takes_in_jax_arrays_from_the_others():
    """daskdag's serializers send a JAX array between workers as zero-copy frames, which only a
    worker that knows them can take in: a worker that joins after the first call, and has run
    none of daskdag's tasks, is given them by the scheduler (daskdag-serializers)."""
    with local_client(1) as client:
        assert_tree_close(daskdag.compute_grads(_dag(), X, "B", client=client).grad, _grad(X))
        (first,) = client.scheduler_info(n_workers=-1)["workers"]
        client.cluster.scale(2)
        client.wait_for_workers(2, timeout=120)
        (later,) = set(client.scheduler_info(n_workers=-1)["workers"]) - {first}

        def make():  # nested: travels by value
            import jax.numpy as jnp
            return jnp.arange(4.0)

        def took(a):
            return type(a).__module__.split(".")[0], float(a.sum())

        made = client.submit(make, workers=[first], pure=False)
        assert client.submit(took, made, workers=[later]).result(timeout=60) == ("jaxlib", 6.0)
        assert worker_setup.SERIALIZERS in client.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.worker_plugins))


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_worker_without_daskdag_still_starts(tmp_path):
    """daskdag-serializers travels by value: a worker of the same cluster that cannot import
    daskdag (one serving other work) starts, and the plugin does nothing there."""
    blocker = tmp_path / "no_daskdag.py"  # a --preload module, imported at the worker's start
    blocker.write_text("import sys\nsys.modules['daskdag.transport.protocol'] = None\n")
    cli = DaskCLI(tmp_path)
    try:
        with local_client(1) as client:
            assert_tree_close(daskdag.compute_grads(_dag(), X, "B", client=client).grad, _grad(X))
            cli.start("worker", client.cluster.scheduler_address, "--nthreads", "1",
                      "--no-dashboard", "--host", "127.0.0.1", "--preload", str(blocker))
            client.wait_for_workers(2, timeout=180)

            def registered(dask_worker, name=worker_setup.SERIALIZERS):  # nested: by value
                return dask_worker.plugins[name].registered
            assert sorted(client.run(registered).values()) == [False, True]
    finally:
        cli.stop()


def _allocation_probe():
    """A function (nested: it travels by value) giving the bytes glibc mmapped for a 1 MiB
    allocation made then in its process (mallinfo2's ``hblkhd``, before and while it lives): 0
    where it came from the heap."""
    def mapped() -> int:
        import ctypes

        import numpy as np

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost")]

        mallinfo2 = ctypes.CDLL(None).mallinfo2
        mallinfo2.restype = Info
        before = mallinfo2().hblkhd
        block = np.ones(2 ** 20, np.uint8)
        grew = mallinfo2().hblkhd - before
        del block
        return int(grew)

    return mapped


@pytest.mark.cluster
@pytest.mark.timeout(180)
@pytest.mark.skipif(not GLIBC, reason="glibc's malloc thresholds")
def test_malloc_is_tuned_while_daskdags_tasks_run_and_the_workers_own_after(tmp_path):
    """On a default cluster (the nanny sets MALLOC_TRIM_THRESHOLD_), a 1 MiB allocation inside
    a daskdag task comes from the heap; in the worker's other work, before and once no daskdag
    task has run for malloc.GRACE seconds, it is mmapped, as distributed's setting has it.
    Nothing is registered on the cluster for it."""
    seen, mapped = tmp_path / "seen", _allocation_probe()

    def probe(x, mapped=mapped, seen=str(seen)):  # travels by value
        with open(seen, "a") as f:
            f.write(f"{mapped()}\n")
        return x

    dag = {"A": (probe, ["x"]), "B": (lambda a: jnp.sum(jnp.tanh(a) ** 2), ["A"])}
    with local_client(1) as client:
        assert client.submit(mapped, pure=False).result(timeout=60) >= 2 ** 20  # (before)
        assert_tree_close(daskdag.compute_grads(dag, X, "B", client=client).grad,
                          jax.grad(lambda x: jnp.sum(jnp.tanh(x) ** 2))(X))
        inside = [int(n) for n in seen.read_text().split()]
        assert inside and all(n == 0 for n in inside), inside
        time.sleep(malloc.GRACE + 1.0)
        outside = client.submit(mapped, pure=False).result(timeout=60)
        assert outside >= 2 ** 20, outside
        assert worker_setup.NAME not in client.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.worker_plugins))
