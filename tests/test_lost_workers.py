"""Workers lost under a call: what happens to a call when its cluster's workers die while it runs.

1. Chaos: a 6-worker cluster under nannies, one random worker SIGKILLed every 2 s (the nanny
   restarts it), through a long sweep_grads and then a loop of compute_grads calls. Every item
   and every call must come out right, none lost, no call may hang or mistake a dead worker for
   a version mismatch, and afterwards the scheduler holds nothing but the values daskdag keeps
   for later calls. (First in the file: it runs before the module's restarting cluster starts.)
2. Every worker SIGKILLed at once, with nannies, which restart the workers: every entry point
   (compute_grads, jacobian, compute_jvps, sweep_grads over NumPy, JAX and dask-array items)
   completes, right, in bounded time, without mistaking the dead workers for a version mismatch,
   and leaves on the scheduler nothing but what daskdag keeps for later calls. Every worker is
   killed early in the call (~0.4 s: in the first nodes) or later (~1.25 s: the last nodes, after
   the first ones' results were made, and lost); a dask-array sweep is also computed after its
   workers were killed.
3. Without nannies, so no worker ever comes back: the call raises ClusterError, saying that the
   workers left, within ``daskdag.worker-wait`` and some slack, instead of waiting forever.

Each call under test in 2 and 3 is a repeated call (a warm-up call of the same DAG came first, as
users call), so it finds the values daskdag keeps on the cluster, and loses them with the
workers. Every test also fails when distributed logs a defect (conftest's ``distributed_log``).
"""

import os
import time

import dask
import dask.array as da
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed import Client

import daskdag

from .support.clusters import (DaskCLI, eventually, live_workers, local_client, local_cluster,
                               scheduler_tasks, wait_only_kept_left)
from .support.faults import KEEP_NANNIES, Chaos, KillAt, bounded, not_a_mismatch, sigkill, worker_pids
from .support.numbers import assert_tree_close

CALL_BOUND = 60.0  # seconds a call may take, killed workers and their restart included


# -- 1. chaos: one random worker killed every 2 s -------------------------------------------------

CHAOS_WORKERS = 6
KILL_EVERY = 2.0  # seconds between two kills
CHAOS_ITEMS = 1000
CHAOS_ITEM_PAUSE = 0.1  # seconds per item: 1000 items on 6 workers, 17 s of sleeping per worker
CHAOS_CHUNK = 5  # items per chunk: ~0.5 s each, so a chunk is seldom caught by several kills in a row
SWEEP_BOUND = 150.0  # seconds the sweep may take
LOOP_FOR = 10.0  # seconds of compute_grads calls at least, each bounded by CALL_BOUND
LOOP_KILLS = 5  # ... and until this many kills landed meanwhile (restarts slow on a busy machine)
LOOP_MOST = 60.0  # seconds of calls at most


def slow_encode(x, w):
    time.sleep(CHAOS_ITEM_PAUSE)
    return jnp.tanh(w * x)


def loss(h):
    return jnp.sum(h ** 2)


def sleeping(seconds):
    def node(v):
        time.sleep(seconds)
        return jnp.sin(v) + 1.5

    return node


def loop_dag():
    return {"A": (sleeping(0.2), ["x"]), "B": (sleeping(0.2), ["A"]),
            "C": (lambda B: jnp.sum(jnp.log(B)), ["B"]),
            "E": (lambda B: jnp.sum(B * jnp.arange(B.shape[0])), ["B"])}


def loop_ref(x):
    B = jnp.sin(jnp.sin(x) + 1.5) + 1.5
    return {"C": jnp.sum(jnp.log(B)), "E": jnp.sum(B * jnp.arange(B.shape[0]))}


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_random_worker_killed_every_2s_through_a_sweep_and_a_loop_of_calls(distributed_log):
    w = np.linspace(0.5, 1.5, 4).astype(np.float32)
    xs = np.random.default_rng(0).uniform(-1.0, 1.0, (CHAOS_ITEMS, 4)).astype(np.float32)
    sweep_dag = {"H": (slow_encode, ["x", "w"]), "L": (loss, ["H"])}
    with dask.config.set(KEEP_NANNIES), local_client(CHAOS_WORKERS) as client:
        before = scheduler_tasks(client)
        # a warm-up sweep (the workers import JAX), then the sweep under chaos
        daskdag.sweep_grads(sweep_dag, {"x": xs[:2 * CHAOS_WORKERS], "w": w}, "L", batched=["x"],
                            chunk_size=2, client=client)
        chaos = Chaos(client, KILL_EVERY)
        chaos.start()
        try:
            res, took = bounded(lambda: not_a_mismatch(lambda: daskdag.sweep_grads(
                sweep_dag, {"x": xs, "w": w}, "L", batched=["x"], chunk_size=CHAOS_CHUNK,
                errors="collect", client=client)), SWEEP_BOUND, "the sweep under chaos")
            swept = len(chaos.kills)
            print(f"sweep of {CHAOS_ITEMS} items: {took:.1f} s, {swept} workers killed")
            assert swept >= 5, "too few kills landed during the sweep to test anything"
            assert not res.failed, {i: str(e) for i, e in list(res.failed.items())[:5]}
            assert not np.isnan(res.value).any() and not np.isnan(res.grad["x"]).any()
            value, grad = jax.vmap(jax.value_and_grad(lambda x: loss(jnp.tanh(w * x))))(xs)
            assert_tree_close(res.value, value, rtol=1e-5)
            assert_tree_close(res.grad["x"], grad, rtol=1e-5)
            del res
            distributed_log.check()

            # compute_grads calls, one after another, for LOOP_FOR seconds and LOOP_KILLS kills:
            # the same input again and again (what the cluster keeps is lost and recomputed)
            # and new ones
            dag, x0 = loop_dag(), jnp.linspace(-1.0, 1.0, 5)
            calls, slowest, start = 0, 0.0, time.monotonic()
            while time.monotonic() - start < LOOP_MOST and (
                    time.monotonic() - start < LOOP_FOR or len(chaos.kills) - swept < LOOP_KILLS):
                x = x0 if calls % 2 else x0 + 0.01 * calls
                r, took = bounded(lambda: not_a_mismatch(lambda: daskdag.compute_grads(
                    dag, x, ["C", "E"], client=client)), CALL_BOUND, f"call {calls} under chaos")
                for o in ("C", "E"):
                    value, grad = jax.value_and_grad(lambda x: loop_ref(x)[o])(x)
                    assert_tree_close(r[o].value, value, rtol=1e-5)
                    assert_tree_close(r[o].grad, grad, rtol=1e-5)
                calls, slowest = calls + 1, max(slowest, took)
            print(f"{calls} compute_grads calls in {time.monotonic() - start:.1f} s (slowest "
                  f"{slowest:.1f} s), {len(chaos.kills) - swept} workers killed meanwhile")
        finally:
            chaos.stop()
        assert len(chaos.kills) - swept >= LOOP_KILLS, "too few kills landed during the calls"
        client.wait_for_workers(CHAOS_WORKERS, timeout=120)
        distributed_log.check()
        wait_only_kept_left(client, before, timeout=60, what="the sweep and the calls")


# -- 2. every worker lost at once, restarted by nannies ------------------------------------------

NODE_PAUSE = 0.5  # seconds each node of an eager call sleeps: A+B, then C and E, ~1.5 s in all
ITEM_PAUSE = 0.05  # seconds each node sleeps per sweep item: 0.2 s an item, ~2.4 s a sweep
MOMENTS = {"early": 0.4, "later": 1.25}  # seconds into the call when every worker is killed
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
ITEMS = 24
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


# -- 3. a cluster that never comes back -----------------------------------------------------------

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
