"""Workers lost mid-call: every worker of the cluster SIGKILLed at once while a call runs.

1. With nannies, which restart the workers: every entry point (compute_grads, jacobian,
   compute_jvps, sweep_grads over NumPy, JAX and dask-array items) completes, right, in bounded
   time, without mistaking the dead workers for a version mismatch, and leaves on the scheduler
   nothing but what daskdag keeps for later calls. Every worker is killed early in the call
   (~0.8 s: in the first nodes) or later (~2.5 s: the last nodes, after the first ones' results
   were made, and lost); a dask-array sweep is also computed after its workers were killed.
2. Without nannies, so no worker ever comes back: the call raises ClusterError, saying that the
   workers left, within ``daskdag.worker-wait`` and some slack, instead of waiting forever.

Each call under test is a repeated call (a warm-up call of the same DAG came first, as users
call), so it finds the values daskdag keeps on the cluster, and loses them with the workers.
Every test also fails when distributed logs a defect (conftest's ``distributed_log``).
"""

import os
import threading
import time

import dask
import dask.array as da
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed import Client

import daskdag

from .support.clusters import DaskCLI, eventually, live_workers, local_cluster, scheduler_tasks, wait_only_kept_left
from .support.faults import KEEP_NANNIES, bounded, not_a_mismatch, sigkill, worker_pids
from .support.numbers import assert_tree_close

CALL_BOUND = 60.0  # seconds a call may take, killed workers and their restart included
NODE_PAUSE = 1.0  # seconds each node of an eager call sleeps: A+B, then C and E, ~3 s in all
ITEM_PAUSE = 0.05  # seconds each node sleeps per sweep item: 0.2 s an item, ~4 s a sweep
MOMENTS = {"early": 0.8, "later": 2.5}  # seconds into the call when every worker is killed
ATTEMPTS = 2  # times a worker is killed just as a call starts (a race: see the test)


def make_dag(pause):
    """x, w -> A -> B -> C, B -> E; every node sleeps ``pause`` seconds, then computes."""

    def a(x, w):
        time.sleep(pause)
        return jnp.sin(x) * w

    def b(A):
        time.sleep(pause)
        return A ** 2 + 1.0

    def c(B):
        time.sleep(pause)
        return jnp.sum(jnp.log(jnp.cumsum(B) / 3.0))

    def e(B):
        time.sleep(pause)
        return jnp.sum(jnp.sqrt(B) * jnp.arange(B.shape[0]))

    return {"A": (a, ["x", "w"]), "B": (b, ["A"]), "C": (c, ["B"]), "E": (e, ["B"])}


def composed_B(x, w):
    return (jnp.sin(x) * w) ** 2 + 1.0


REF = {"B": composed_B,
       "C": lambda x, w: jnp.sum(jnp.log(jnp.cumsum(composed_B(x, w)) / 3.0)),
       "E": lambda x, w: jnp.sum(jnp.sqrt(composed_B(x, w)) * jnp.arange(x.shape[0]))}

X = jnp.linspace(0.2, 1.4, 6)
W = jnp.linspace(0.5, 1.5, 6)
VX, VW = jnp.linspace(1.0, -1.0, 6), jnp.full(6, 0.5)
ITEMS = 40
XS = np.asarray(jax.random.uniform(jax.random.key(0), (ITEMS, 6), minval=0.1, maxval=1.5))


# -- the calls, and what they must give -----------------------------------------------------------

def check_grads(res):
    for o in ("C", "E"):
        value, (gx, gw) = jax.value_and_grad(REF[o], argnums=(0, 1))(X, W)
        assert_tree_close(res[o].value, value, rtol=1e-5)
        assert_tree_close(res[o].grad, {"x": gx, "w": gw}, rtol=1e-5)


def check_jacobian(res):
    for o in ("B", "C"):
        jx, jw = jax.jacrev(REF[o], argnums=(0, 1))(X, W)
        assert_tree_close(res[o].value, REF[o](X, W), rtol=1e-5)
        assert_tree_close(res[o].grad, {"x": jx, "w": jw}, rtol=1e-5)


def check_jvps(res):
    for o in ("C", "E"):
        value, tangent = jax.jvp(REF[o], (X, W), (VX, VW))
        assert_tree_close(res[o].value, value, rtol=1e-5)
        assert_tree_close(res[o].tangent, tangent, rtol=1e-5)


def check_sweep(res, xs=XS):
    for o in ("C", "E"):
        value, grad = jax.vmap(jax.value_and_grad(REF[o]), in_axes=(0, None))(jnp.asarray(xs), W)
        assert_tree_close(res[o].value, value, rtol=1e-5)
        assert_tree_close(res[o].grad, {"x": grad}, rtol=1e-5)
        assert not res[o].failed


def sweep(client, xs, w):
    return daskdag.sweep_grads(make_dag(ITEM_PAUSE), {"x": xs, "w": w}, ["C", "E"], batched=["x"],
                               client=client)


def dask_sweep(client, xs):
    """The lazy sweep over a dask array of items, computed on ``client``: ``{output:
    Result(value, {"x": grad}, failed={})}`` of NumPy arrays."""
    lazy = sweep(client, da.from_array(xs, chunks=4), np.asarray(W))
    (computed,) = dask.compute({o: (r.value, r.grad) for o, r in lazy.items()}, scheduler=client)
    return {o: daskdag.Result(v, g, lazy[o].failed) for o, (v, g) in computed.items()}


CASES = {  # name: (call(client, warm-up?), check(result, warm-up?))
    "compute_grads": (lambda client, warm: daskdag.compute_grads(
        make_dag(NODE_PAUSE), {"x": X, "w": W}, ["C", "E"], client=client),
        lambda res, warm: check_grads(res)),
    "jacobian": (lambda client, warm: daskdag.jacobian(
        make_dag(NODE_PAUSE), {"x": X, "w": W}, ["B", "C"], client=client),
        lambda res, warm: check_jacobian(res)),
    "compute_jvps": (lambda client, warm: daskdag.compute_jvps(
        make_dag(NODE_PAUSE), {"x": X, "w": W}, {"x": VX, "w": VW}, ["C", "E"], client=client),
        lambda res, warm: check_jvps(res)),
    # a warm-up sweep of a few items: the same DAG and shared input, kept for the next sweep
    "sweep_numpy": (lambda client, warm: sweep(client, XS[:4] if warm else XS, np.asarray(W)),
                    lambda res, warm: check_sweep(res, XS[:4] if warm else XS)),
    "sweep_jax": (lambda client, warm: sweep(client, jnp.asarray(XS[:4] if warm else XS), W),
                  lambda res, warm: check_sweep(res, XS[:4] if warm else XS)),
    "sweep_dask": (lambda client, warm: dask_sweep(client, XS[:8] if warm else XS),
                   lambda res, warm: check_sweep(res, XS[:8] if warm else XS)),
}


class KillAt(threading.Thread):
    """SIGKILLs ``pids`` together, ``delay`` seconds after it starts; ``killed``: those it
    found, ``at``: when (``time.monotonic()``)."""

    def __init__(self, pids, delay):
        super().__init__(daemon=True, name="kill-workers")
        self.pids, self.delay, self.killed, self.at = list(pids), delay, [], None

    def run(self):
        time.sleep(self.delay)
        self.killed = sigkill(self.pids)
        self.at = time.monotonic()


def call_while_killing(client, call, delay):
    """``call()`` (bounded by :data:`CALL_BOUND`), with every worker SIGKILLed ``delay`` s
    after it started; checks that they were killed while it still ran. Returns its result and
    the seconds it took."""
    pids = worker_pids(client)
    killer = KillAt(pids.values(), delay)
    killer.start()
    res, took = bounded(lambda: not_a_mismatch(call), CALL_BOUND, "the call whose workers died")
    killer.join()
    assert sorted(killer.killed) == sorted(pids.values()), (killer.killed, pids)
    assert took > delay, f"the call ended after {took:.2f} s, before its workers were killed"
    return res, took


@pytest.fixture(scope="module")
def restarting_cluster():
    """Two workers under nannies, which restart them when killed; one cluster for the module's
    kill tests (each kills and gets back both workers; starting a cluster costs 5-15 s here)."""
    with dask.config.set(KEEP_NANNIES), local_cluster() as cluster:
        yield cluster


@pytest.fixture
def fresh_client(restarting_cluster):
    """A client of its own (daskdag keeps values per client) once both workers are back and
    the previous test's tasks are gone."""
    with Client(restarting_cluster, set_as_default=False) as client:
        client.wait_for_workers(2, timeout=90)
        eventually(lambda: scheduler_tasks(client) == 0, 30, "the previous test's tasks gone",
                   lambda: f"the scheduler holds {scheduler_tasks(client)} tasks")
        yield client


@pytest.mark.cluster
@pytest.mark.timeout(150)
@pytest.mark.parametrize("moment", list(MOMENTS))
@pytest.mark.parametrize("case", list(CASES))
def test_every_worker_lost_mid_call_the_call_completes(case, moment, fresh_client, distributed_log):
    client = fresh_client
    call, check = CASES[case]
    before = scheduler_tasks(client)
    check(call(client, True), True)  # the warm-up call
    res, took = call_while_killing(client, lambda: call(client, False), MOMENTS[moment])
    print(f"{case}: every worker killed {MOMENTS[moment]} s in; the call took {took:.1f} s")
    check(res, False)
    del res
    wait_only_kept_left(client, before, what="the call whose workers died")


@pytest.mark.cluster
@pytest.mark.timeout(150)
def test_lazy_sweep_computed_after_every_worker_was_lost(fresh_client, distributed_log):
    """The dask-array sweep prepared (``sweep_grads`` checks the workers and prepares the graph
    then), every worker killed, and only then computed, while the nannies restart them."""
    client = fresh_client
    before = scheduler_tasks(client)
    check_sweep(dask_sweep(client, XS[:8]), XS[:8])  # the warm-up call
    lazy = sweep(client, da.from_array(XS, chunks=4), np.asarray(W))
    pids = worker_pids(client)
    assert sorted(sigkill(pids.values())) == sorted(pids.values())

    def compute():
        (computed,) = dask.compute({o: (r.value, r.grad) for o, r in lazy.items()},
                                   scheduler=client)
        return {o: daskdag.Result(v, g) for o, (v, g) in computed.items()}

    res, took = bounded(lambda: not_a_mismatch(compute), CALL_BOUND, "the lazy sweep's compute")
    print(f"computed {took:.1f} s after every worker was killed")
    check_sweep(res)
    res = lazy = None  # (holding no future of the graph)
    wait_only_kept_left(client, before, what="the lazy sweep")


@pytest.mark.cluster
@pytest.mark.timeout(150)
def test_a_worker_dying_as_a_call_starts_is_no_version_mismatch(fresh_client, distributed_log):
    """A worker that joined since the last call (so daskdag has not checked its versions yet)
    dies just as a call starts: the call completes on the worker left, right, instead of
    reporting the dead worker as one whose versions differ."""
    client = fresh_client
    dag = make_dag(0.0)
    before = scheduler_tasks(client)
    check_grads(daskdag.compute_grads(dag, {"x": X, "w": W}, ["C", "E"], client=client))
    for attempt in range(ATTEMPTS):
        client.wait_for_workers(2, timeout=90)
        pids = worker_pids(client)
        sigkill([min(pids.values())])  # its nanny starts a new worker, at a new address

        def replacement_killed():
            now = client.run(os.getpid, on_error="return")
            return sigkill([p for a, p in now.items() if isinstance(p, int) and a not in pids])

        # Killed as soon as it answers, and the call follows at once. When the kill lands
        # before the worker's stream to the scheduler is up, the scheduler goes on listing the
        # dead worker, and whatever asks it something (a version check) waits out distributed's
        # 30-s connect timeout. A race: some attempts find it listed, others not.
        eventually(replacement_killed, 90, "a worker replacing the killed one, killed in turn")
        res, took = bounded(lambda: not_a_mismatch(lambda: daskdag.compute_grads(
            dag, {"x": X, "w": W}, ["C", "E"], client=client)), CALL_BOUND,
            "the call that found a worker dead")
        print(f"attempt {attempt}: the call took {took:.1f} s")
        check_grads(res)
        del res
    wait_only_kept_left(client, before)


# -- 2. a cluster that never comes back -----------------------------------------------------------

@pytest.fixture
def cli_no_nanny(tmp_path, distributed_log):
    """A scheduler and two workers started with ``dask worker --no-nanny``: a killed worker
    stays dead. Yields ``(address, DaskCLI)``; its log is watched by ``distributed_log``."""
    cli = DaskCLI(tmp_path)
    distributed_log.watch(tmp_path / "cluster.log")
    try:
        address = cli.scheduler()
        cli.worker("--no-nanny")
        cli.worker("--no-nanny")
        yield address, cli
    finally:
        cli.stop()


NEVER_BACK = {
    "compute_grads": (lambda client: daskdag.compute_grads(
        make_dag(NODE_PAUSE), {"x": X, "w": W}, ["C", "E"], client=client),
        lambda res: check_grads(res)),
    "sweep_grads": (lambda client: sweep(client, XS, np.asarray(W)), lambda res: check_sweep(res)),
}


@pytest.mark.cluster
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(NEVER_BACK))
def test_every_worker_lost_for_good_raises_cluster_error(case, cli_no_nanny):
    """No worker comes back: with ``daskdag.worker-wait`` 3 s, ClusterError (saying that the
    workers were lost, not that they differ) well within :data:`CALL_BOUND`."""
    address, _ = cli_no_nanny
    call, check = NEVER_BACK[case]
    with Client(address, set_as_default=False, timeout=60) as client, \
            dask.config.set({"daskdag.worker-wait": "3s"}):
        client.wait_for_workers(2, timeout=120)
        before = scheduler_tasks(client)
        check(call(client))  # the warm-up call
        pids = worker_pids(client)
        killer = KillAt(pids.values(), MOMENTS["early"])
        killer.start()
        with pytest.raises(daskdag.ClusterError) as raised:
            bounded(lambda: call(client), CALL_BOUND, "the call whose workers died for good")
        killer.join()
        message = str(raised.value)
        print(f"{case}: {message}")
        assert sorted(killer.killed) == sorted(pids.values())
        assert "differ" not in message, message
        assert "worker" in message.lower(), message
        eventually(lambda: not live_workers(client), 30,
                   "the killed workers gone from the scheduler", lambda: list(live_workers(client)))
        wait_only_kept_left(client, before, what="the call whose workers died for good")
