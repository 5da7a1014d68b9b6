"""compute_grads runs on the client it is given, else the active one, else Dask's threads."""

import os
import threading
import time

import dask
import distributed
import jax
import jax.numpy as jnp
import pytest
from distributed import Client

import daskdag

from .support.clusters import RunLog
from .support.numbers import assert_tree_close


def _dag(log: RunLog | None = None):
    """The DAG; with ``log``, each node notes its runs there."""
    # Defined inside a function so cloudpickle ships them by value to worker processes.
    dag = {"A": (lambda x: jnp.tanh(x) * 2, ["x"]), "B": (lambda a: a ** 2 + 1, ["A"]),
           "D": (lambda b: jnp.sum(jnp.log(b)), ["B"]), "E": (lambda b: jnp.sum(b ** 0.5), ["B"])}
    return dag if log is None else {n: (log.wrap(n, fn), deps) for n, (fn, deps) in dag.items()}


def _ran_once_each_on_the_workers(log: RunLog, client):
    runs = log.runs()
    assert sorted(name for name, _ in runs) == ["A", "B", "D", "E"], runs  # each node once
    assert {pid for _, pid in runs} <= set(client.run(os.getpid).values()), runs  # in a worker


def _check(res, x):
    D = lambda x: jnp.sum(jnp.log((jnp.tanh(x) * 2) ** 2 + 1))
    E = lambda x: jnp.sum(((jnp.tanh(x) * 2) ** 2 + 1) ** 0.5)
    for o, f in {"D": D, "E": E}.items():
        value, grad = jax.value_and_grad(f)(x)
        assert_tree_close(res[o].value, value)
        assert_tree_close(res[o].grad, grad)


X = jnp.linspace(-1.0, 1.0, 6)


def test_default_is_threads_and_starts_no_cluster():
    _check(daskdag.compute_grads(_dag(), X, ["D", "E"]), X)
    with pytest.raises(ValueError):
        distributed.default_client()  # none was created behind the user's back

    # Threads: two nodes that wait run side by side (a task that runs alone, or is known to be
    # short, runs in the calling thread: daskdag.running.local). Each waits until the other has
    # started (a barrier, not a time: on a loaded machine a thread may start late): run one
    # after the other, the first would wait for a second that never comes, and fail.
    both = threading.Barrier(2, timeout=60)
    ran = []  # (thread, start, end) of each wait

    def wait(x):
        start = time.perf_counter()
        both.wait()  # (BrokenBarrierError, the node's failure, if the other is not running)
        ran.append((threading.current_thread().name, start, time.perf_counter()))
        return x * 2.0

    dag = {"P": (wait, ["x"]), "Q": (lambda x: wait(x) + 1.0, ["x"]),
           "L": (lambda p, q: jnp.sum(p * q), ["P", "Q"])}
    r = daskdag.compute_grads(dag, X, "L")
    (a, a0, a1), (b, b0, b1) = ran
    assert a != b and max(a0, b0) < min(a1, b1)  # two threads, each started before the other ended
    assert_tree_close(r.grad, jax.grad(lambda x: jnp.sum(2 * x * (2 * x + 1)))(X))


def test_what_a_node_function_takes_is_learned_once_for_all_its_nodes(monkeypatch):
    """Tiny nodes run in the calling thread once known to be short (daskdag.running.local); what
    a function takes is learned by the function, not per node, so a DAG of more nodes than the
    durations kept (``local.KNOWN``, here made 16) of a few functions runs there from its
    second call: no thread hand-offs, which cost tiny nodes as much as their work."""
    from daskdag.caches import Cache
    from daskdag.running import local

    monkeypatch.setattr(local, "_durations", Cache("test: learned durations", 16))
    ran: list = []

    def step(x):
        ran.append(threading.get_ident())
        return jnp.sin(x)

    n = 64
    dag = {f"n{i}": (step, ["x"]) for i in range(n)}
    dag["L"] = (lambda *a: sum(jnp.sum(v) for v in a), list(dag))
    daskdag.compute_grads(dag, X, "L")  # (learns what step takes)
    ran.clear()
    r = daskdag.compute_grads(dag, X, "L")
    assert ran == [threading.get_ident()] * n  # every node here, in the calling thread
    assert_tree_close(r.grad, jax.grad(lambda x: n * jnp.sum(jnp.sin(x)))(X))


def test_a_function_made_where_a_gone_one_was_is_not_taken_for_it():
    """Durations are learned by function (daskdag.running.local), held weakly: a function made
    later at the address of a gone one (the same ``id``) is not known to be short, so two nodes
    that wait for each other still run side by side (test_default_is_threads_...)."""
    from daskdag.running import local

    def make():
        return lambda x: x

    gone = make()
    key = local.Functions([gone])
    local._remember(key, 1e-6)
    assert local._known_short(local.Functions([gone]))
    address = id(gone)
    del gone
    for _ in range(1000):  # (CPython makes a new function where a freed one was, soon)
        new = make()
        if id(new) == address:
            break
    else:
        pytest.skip("no function was made at the gone one's address")
    assert not local._known_short(local.Functions([new]))
    assert key != local.Functions([new]) and hash(key) == hash(local.Functions([new]))


# cluster: conftest's fixture, one two-worker LocalCluster for the module

@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_explicit_client_runs_every_task_on_the_cluster(cluster, tmp_path):
    log = RunLog(tmp_path / "runs")
    with Client(cluster, set_as_default=False) as client:
        with distributed.get_task_stream(client) as ts:
            res = daskdag.compute_grads(_dag(log), X, ["D", "E"], client=client)
        _check(res, X)
        _ran_once_each_on_the_workers(log, client)
        with client.as_current():  # the same call not computed: its tasks, under the same keys
            tasks = list(dict(daskdag.grads(_dag(log), X, ["D", "E"]).__dask_graph__()))
        assert sorted(t["key"] for t in ts.data) == sorted(tasks)  # each ran once, on the cluster


def _tasks_by_kind(keys) -> dict:
    kinds: dict = {}
    for k in keys:  # (daskdag's keys say what each task is: fwd:, val:, bwd:, grad:, program:)
        kind = str(k).split(":")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_the_scheduler_runs_about_one_task_per_node(cluster, one_task_in_reach):
    """What the scheduler ran for a call, counted: a stage's nodes share its tasks, and a closed
    stage's forward task runs its backward pass too, so a fan-out of 50 tiny nodes costs one task
    a node and three for the call, a chain of 12 four tasks in all, and a call of the same chain
    once run in one task (``Spreading``) one task; never three a node."""
    x = jnp.linspace(-1.0, 1.0, 8)
    n = 50
    fan = {f"n{i}": ((lambda x, i=i: jnp.sin(x) * i), ["x"]) for i in range(n)}
    fan["L"] = (lambda *a: sum(jnp.sum(v) for v in a), [f"n{i}" for i in range(n)])
    chain = {"n0": (jnp.sin, ["x"]), **{f"n{i}": ((lambda a: jnp.tanh(a) * 1.01), [f"n{i - 1}"])
                                        for i in range(1, 12)},
             "L": (lambda a: jnp.sum(a ** 2), ["n11"])}
    ran: dict = {}
    with Client(cluster, set_as_default=False) as client:
        for name, dag, calls in (("fan", fan, 1), ("chain", chain, 6)):
            for _ in range(calls):
                with distributed.get_task_stream(client) as ts:
                    r = daskdag.compute_grads(dag, x, "L", client=client)
                ran.setdefault(name, []).append(_tasks_by_kind(t["key"] for t in ts.data))
    want_fan = jax.grad(lambda x: sum(jnp.sum(jnp.sin(x) * i) for i in range(n)))(x)
    assert_tree_close(daskdag.compute_grads(fan, x, "L").grad, want_fan)

    def chained(x):
        h = jnp.sin(x)
        for _ in range(11):
            h = jnp.tanh(h) * 1.01
        return jnp.sum(h ** 2)

    assert_tree_close(r.grad, jax.grad(chained)(x))  # (the chain's last call, in one task)
    fan_tasks = ran["fan"][0]
    assert fan_tasks == {"fwd": n + 1, "val": 1, "grad": 1}, fan_tasks  # 53 tasks, 51 nodes
    assert ran["chain"][0] == {"fwd": 1, "val": 1, "bwd": 1, "grad": 1}, ran["chain"]
    assert sum(ran["chain"][-1].values()) == 1, ran["chain"]  # (the whole call in one task)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_active_client_is_used_by_default(cluster, tmp_path):
    log = RunLog(tmp_path / "runs")
    with Client(cluster) as client:
        with distributed.get_task_stream(client) as ts:
            res = daskdag.compute_grads(_dag(log), X, ["D", "E"])
        _check(res, X)
        assert ts.data  # tasks ran on the cluster
        _ran_once_each_on_the_workers(log, client)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_node_error_travels_back_from_a_worker(cluster):
    def bad(b):
        raise FloatingPointError("negative pressure")

    dag = {**_dag(), "E": (bad, ["B"])}
    with Client(cluster, set_as_default=False) as client:
        with pytest.raises(daskdag.NodeError, match="node 'E' failed in its forward pass") as e:
            daskdag.compute_grads(dag, X, ["D", "E"], client=client)
    assert e.value.node == "E" and isinstance(e.value.__cause__, FloatingPointError)


@pytest.mark.timeout(180)
@pytest.mark.subprocess
def test_dask_multiprocessing_scheduler_pickles_pullbacks(tmp_path):
    # Every task result travels back to the parent process by pickle: pullbacks included.
    log = RunLog(tmp_path / "runs")
    with dask.config.set(scheduler="processes", num_workers=2):
        res = daskdag.compute_grads(_dag(log), X, ["D", "E"])
    assert res["D"].info.where == "Dask's multiprocessing scheduler (processes)"  # not threads
    # ... and so it ran: every node in a process of Dask's pool, none in this one
    runs = log.runs()
    assert sorted(name for name, _ in runs) == ["A", "B", "D", "E"], runs
    assert os.getpid() not in {pid for _, pid in runs}, runs
    _check(res, X)
