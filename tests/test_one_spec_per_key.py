"""One task spec per key: eager and lazy calls of the same DAG on one client, mixed as users mix
them, never send the scheduler one key with two different specs. distributed warns "Detected
different `run_spec` ... can cause failures and deadlocks" when they do (for every graph that
collides): conftest's ``distributed_log`` fails the test on that line."""

import threading

import dask
import distributed
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed import Client

import daskdag

from .support.clusters import eventually, scheduler_tasks, wait_only_kept_left
from .support.numbers import assert_tree_close, seed_functions

pytestmark = pytest.mark.cluster

F = seed_functions()
X = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
V = jnp.linspace(-1.0, 1.0, 5)
XS = jnp.asarray(np.random.default_rng(0).uniform(0.5, 5.0, (12, 5)).astype(np.float32))


def seed_dag():
    return {"A": (F["x_to_A"], ["x"]), "B": (F["A_to_B"], ["A"]), "C": (F["B_to_C"], ["B"]),
            "D": (F["C_to_D"], ["C"]), "E": (F["B_to_E"], ["B"])}


def composed(x):
    B = F["A_to_B"](F["x_to_A"](x))
    C = F["B_to_C"](B)
    return {"C": C, "D": F["C_to_D"](C), "E": F["B_to_E"](B)}


def check_grads(res, x=X):
    for o in ("D", "E"):
        value, grad = jax.value_and_grad(lambda x: composed(x)[o])(x)
        assert_tree_close(res[o].value, value, rtol=1e-5)
        assert_tree_close(res[o].grad, grad, rtol=1e-5)


def check_jacobian(res):
    assert_tree_close(res.value, composed(X)["C"], rtol=1e-5)
    assert_tree_close(res.grad, jax.jacrev(lambda x: composed(x)["C"])(X), rtol=1e-5)


@pytest.fixture
def client(cluster):  # (cluster: conftest's, one for the module)
    """A client of its own for each test (what daskdag keeps is kept per client), once the last
    test's tasks are gone."""
    with Client(cluster, set_as_default=False) as client:
        eventually(lambda: scheduler_tasks(client) == 0, 30, "the previous test's tasks gone",
                   lambda: f"the scheduler holds {scheduler_tasks(client)} tasks")
        yield client


@pytest.mark.timeout(120)
def test_a_persisted_call_then_the_eager_call(client, distributed_log):
    """``grads(...).persist()``, then ``compute_grads`` of the same DAG and input while the
    persisted results are held, then the persisted call computed."""
    dag = seed_dag()
    before = scheduler_tasks(client)
    with client.as_current():
        persisted = daskdag.grads(dag, X, ["D", "E"]).persist()
        distributed.wait(distributed.futures_of(persisted))
    check_grads(daskdag.compute_grads(dag, X, ["D", "E"], client=client))
    with client.as_current():
        check_grads(persisted.compute())
    distributed_log.check()
    del persisted
    wait_only_kept_left(client, before)


@pytest.mark.timeout(120)
def test_eager_calls_then_lazy_ones_then_jvps_and_a_sweep(client, distributed_log):
    """Eager ``compute_grads`` and ``jacobian``, then ``grads`` and ``jacobians`` computed
    together, then ``compute_jvps`` and ``sweep_grads``: one after another, same DAG."""
    dag = seed_dag()
    before = scheduler_tasks(client)
    for _ in range(2):
        check_grads(daskdag.compute_grads(dag, X, ["D", "E"], client=client))
        check_jacobian(daskdag.jacobian(dag, X, "C", client=client))
    with client.as_current():
        g, j = dask.compute(daskdag.grads(dag, X, ["D", "E"]), daskdag.jacobians(dag, X, "C"))
    check_grads(g)
    check_jacobian(j)
    jv = daskdag.compute_jvps(dag, X, V, ["D", "E"], client=client)
    for o in ("D", "E"):
        value, tangent = jax.jvp(lambda x: composed(x)[o], (X,), (V,))
        assert_tree_close(jv[o].value, value, rtol=1e-5)
        assert_tree_close(jv[o].tangent, tangent, rtol=1e-5)
    sw = daskdag.sweep_grads(dag, XS, ["D", "E"], client=client)
    for o in ("D", "E"):
        value, grad = jax.vmap(jax.value_and_grad(lambda x: composed(x)[o]))(XS)
        assert_tree_close(sw[o].value, value, rtol=1e-5)
        assert_tree_close(sw[o].grad, grad, rtol=1e-5)
        assert not sw[o].failed
    distributed_log.check()
    wait_only_kept_left(client, before)


@pytest.mark.timeout(120)
def test_eager_and_lazy_calls_at_once(client, distributed_log):
    """One thread calls ``compute_grads``, another computes ``grads`` and ``jacobians``
    together, at the same time, ten times each: the same forward tasks are in flight from
    both."""
    dag = seed_dag()
    before = scheduler_tasks(client)
    check_grads(daskdag.compute_grads(dag, X, ["D", "E"], client=client))  # (kept for the next)
    errors = []

    def eager():
        for _ in range(10):
            check_grads(daskdag.compute_grads(dag, X, ["D", "E"], client=client))

    def lazy():
        with client.as_current():
            for _ in range(10):
                g, j = dask.compute(daskdag.grads(dag, X, ["D", "E"]),
                                    daskdag.jacobians(dag, X, "C"))
                check_grads(g)
                check_jacobian(j)

    def run(fn):
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in (eager, lazy)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "the calls did not end within 90 s"
    if errors:
        raise errors[0]
    distributed_log.check()
    wait_only_kept_left(client, before)
