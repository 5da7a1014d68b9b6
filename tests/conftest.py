"""Fixtures, and the hooks that show every cluster process's stacks before pytest-timeout ends
a test; the harnesses they use are in ``tests/support/``."""


import jax
import jax.numpy as jnp
import pytest

from .support import hangs
from .support.clusters import DaskCLI, local_cluster
from .support.faults import watching_distributed
from .support.numbers import Counted, seed_functions


@pytest.hookimpl(optionalhook=True, wrapper=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's timer, and a few seconds before it fires, the stacks of every process of
    the test's clusters (a ``cluster`` test), written to its stderr (:func:`hangs.arm`)."""
    hangs.arm(item, settings.timeout)
    return (yield)


@pytest.hookimpl(optionalhook=True, wrapper=True)
def pytest_timeout_cancel_timer(item):
    hangs.disarm(item)
    return (yield)


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


@pytest.fixture(autouse=True)
def _spawned_workers(request):
    """A test marked ``spawn`` starts its clusters' workers as a user's are started, spawned,
    not forked from the tests' forkserver (:func:`.support.clusters.fork_workers`)."""
    if request.node.get_closest_marker("spawn") is None:
        yield
        return
    import dask

    with dask.config.set({"distributed.worker.multiprocessing-method": "spawn"}):
        yield


@pytest.fixture
def one_task_in_reach(monkeypatch):
    """A call on a cluster tries one task once a spread call took less than
    ``Spreading.TRY_WHOLE`` (a quarter second); on a loaded machine (two test processes on two
    cores) a call of microsecond stages may take longer. Tests that wait for the switch raise
    the threshold; the rule's other half, the faster way wins, is as it is."""
    from daskdag.running.jobs import Spreading

    monkeypatch.setattr(Spreading, "TRY_WHOLE", 5.0)


@pytest.fixture
def distributed_log():
    """A :class:`DistributedLog` over the test; the test fails (at teardown) if distributed
    logged one of :data:`DistributedLog.DEFECTS`. Tests may call ``check()`` themselves, earlier."""
    yield from watching_distributed()


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
    yield from watching_distributed()
