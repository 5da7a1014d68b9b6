"""Calls share what did not change (issue 41, item 2): in a loop of calls, the nodes no gradient
passes through (a trunk over fixed data) run again only when their inputs change.

Each result is checked against ``jax.value_and_grad`` of the composed function. A ``jit=True``
node's runs are counted by a ``jax.debug.callback`` inside it (its Python runs only when it is
traced), an eager node's by the call itself; both append to a file, which worker processes on
a cluster started by the ``dask`` CLI append to as well.
"""

from functools import partial

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag

from .support.clusters import RunLog
from .support.numbers import assert_tree_close

D = jnp.linspace(-1.0, 1.0, 3)


def _note(path, name):
    import os

    with open(path, "a") as log:
        log.write(f"{name} {os.getpid()}\n")


def jit_trunk(path):
    """A jittable trunk that notes each run, compiled or not."""
    def trunk(d):
        jax.debug.callback(partial(_note, path, "T"))
        return jnp.tanh(d) * 2.0
    return trunk


def head(p, t):
    return jnp.sum(jnp.sin(p * t))


def composed(p, d):
    return head(p, jnp.tanh(d) * 2.0)


def _dag(log, **trunk_options):
    trunk = jit_trunk(str(log.path)) if trunk_options.get("jit", True) else log.wrap(
        "T", lambda d: jnp.tanh(d) * 2.0)
    return {"T": daskdag.Node(trunk, ["d"], **trunk_options), "H": (head, ["p", "T"])}


def _check(res, p, d):
    value, grad = jax.value_and_grad(composed)(p, d)
    assert_tree_close(res.value, value, rtol=1e-5)
    assert_tree_close(res.grad["p"], grad, rtol=1e-5)


def _loop(dag, d, steps=5, **kw):
    infos = []
    for k in range(steps):
        p = jnp.ones(3) * (0.3 * k + 0.1)
        res = daskdag.compute_grads(dag, {"p": p, "d": d}, "H", wrt=["p"], **kw)
        _check(res, p, d)
        infos.append(res.info)
    return infos


def test_a_jit_trunk_over_fixed_data_runs_once_in_a_loop(tmp_path):
    """Five steps whose parameters change and whose data does not: the trunk runs at the first
    only; each later call says it reused it; the numbers are JAX's."""
    log = RunLog(tmp_path / "runs")
    infos = _loop(_dag(log, jit=True), D)
    assert len(log.pids("T")) == 1
    assert infos[0].reused == () and all(i.reused == ("T",) for i in infos[1:])
    assert "reused T" in repr(infos[1])


def test_the_same_step_through_value_and_grad(tmp_path):
    """A prepared function (``value_and_grad``) reuses the trunk in its loop too."""
    log = RunLog(tmp_path / "runs")
    f = daskdag.value_and_grad(_dag(log, jit=True), "H", wrt=["p"])
    for k in range(4):
        p = jnp.ones(3) * k
        value, grads = f({"p": p, "d": D})
        want = jax.value_and_grad(composed)(p, D)
        assert_tree_close(value, want[0], rtol=1e-5)
        assert_tree_close(grads["p"], want[1], rtol=1e-5)
    assert len(log.pids("T")) == 1


def test_data_changed_in_place_or_replaced_is_seen(tmp_path):
    """NumPy data are compared by content: changed in place, the trunk runs again, and the
    numbers follow; the same content in a new array is the same data. A JAX array is compared
    by identity: a new one (the same numbers) runs the trunk again."""
    log = RunLog(tmp_path / "runs")
    dag = _dag(log, jit=True)
    d = np.asarray(D).copy()
    _loop(dag, d, steps=2)
    assert len(log.pids("T")) == 1
    d[0] = 0.75  # in place
    _loop(dag, d, steps=2)
    assert len(log.pids("T")) == 2
    _loop(dag, d.copy(), steps=1)  # the same content
    assert len(log.pids("T")) == 2
    _loop(dag, jnp.asarray(d), steps=2)  # a new JAX array, then the same one
    assert len(log.pids("T")) == 3


def test_a_weight_the_trunk_closes_over_changed_in_place_runs_it_again(tmp_path):
    """The trunk reads a NumPy weight it closes over: changed in place between two calls, the
    trunk runs again (its program changed), and the gradient is the new one's."""
    log = RunLog(tmp_path / "runs")
    scale = np.array([2.0])

    def trunk(d):
        jax.debug.callback(partial(_note, str(log.path), "T"))
        return jnp.tanh(d) * scale[0]

    dag = {"T": daskdag.Node(trunk, ["d"], jit=True), "H": (head, ["p", "T"])}
    p = jnp.ones(3)
    daskdag.compute_grads(dag, {"p": p, "d": D}, "H", wrt=["p"])
    daskdag.compute_grads(dag, {"p": p, "d": D}, "H", wrt=["p"])
    assert len(log.pids("T")) == 1
    scale[0] = -3.0
    res = daskdag.compute_grads(dag, {"p": p, "d": D}, "H", wrt=["p"])
    assert len(log.pids("T")) == 2 and res.info.reused == ()
    want = jax.grad(lambda p: head(p, jnp.tanh(D) * -3.0))(p)
    assert_tree_close(res.grad["p"], want, rtol=1e-5)


def test_a_replaced_dag_entry_runs_again(tmp_path):
    """Another trunk under the same name: the new one runs, and its numbers come back."""
    log = RunLog(tmp_path / "runs")
    dag = _dag(log, jit=True)
    _loop(dag, D, steps=2)
    dag["T"] = daskdag.Node(lambda d: jnp.cos(d), ["d"], jit=True)
    p = jnp.ones(3)
    res = daskdag.compute_grads(dag, {"p": p, "d": D}, "H", wrt=["p"])
    assert res.info.reused == ()
    assert_tree_close(res.grad["p"], jax.grad(lambda p: head(p, jnp.cos(D)))(p), rtol=1e-5)


def test_eager_nodes_are_reused_only_when_asked(tmp_path):
    """An eager trunk may print or read a file: by default it runs at every call; with
    ``daskdag.reuse: all`` it is kept as a jit one; with ``none`` not even a jit one is."""
    log = RunLog(tmp_path / "runs")
    _loop(_dag(log, jit=False), D, steps=3)
    assert len(log.pids("T")) == 3
    with dask.config.set({"daskdag.reuse": "all"}):
        infos = _loop(_dag(log, jit=False), D, steps=3)
    assert len(log.pids("T")) == 4 and infos[-1].reused == ("T",)
    with dask.config.set({"daskdag.reuse": "none"}):
        _loop(_dag(log, jit=True), D, steps=3)
    assert len(log.pids("T")) == 4 + 3


def test_what_is_kept_is_bounded(tmp_path):
    """``daskdag.reuse-bytes`` under the trunk's value: nothing is kept, the trunk runs at every
    call."""
    log = RunLog(tmp_path / "runs")
    with dask.config.set({"daskdag.reuse-bytes": 8}):
        infos = _loop(_dag(log, jit=True), D, steps=3)
    assert len(log.pids("T")) == 3 and all(i.reused == () for i in infos)


def test_a_node_that_writes_into_a_kept_value_fails_naming_itself(tmp_path):
    """With ``reuse: all``, a kept NumPy value is read-only: a node that would change it in
    place (and so change what the next call reuses) fails, naming itself."""
    def scribble(p, t):
        t += 1.0
        return jnp.sum(p * t)

    dag = {"T": (lambda d: np.asarray(d) * 2.0, ["d"]), "H": (scribble, ["p", "T"])}
    with dask.config.set({"daskdag.reuse": "all"}), \
            pytest.raises(daskdag.NodeError, match="'H'") as e:
        daskdag.compute_grads(dag, {"p": jnp.ones(3), "d": np.ones(3)}, "H", wrt=["p"])
    assert "read-only" in str(e.value)


def test_lazy_calls_reuse_what_an_earlier_call_kept(tmp_path):
    """A lazy call (``grads``) is a graph Dask computes later: the first computes the trunk in
    its graph and keeps its value once computed; the next takes it as an input, and runs no
    trunk. The numbers are JAX's."""
    log = RunLog(tmp_path / "runs")
    dag = _dag(log, jit=True)
    for step in range(2):
        call = daskdag.grads(dag, {"p": jnp.ones(3), "d": D}, "H", wrt=["p"])
        res = call.compute()
        _check(res, jnp.ones(3), D)
        assert res.info.reused == (() if step == 0 else ("T",))
    assert len(log.pids("T")) == 1


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_a_trunk_runs_once_in_a_loop_on_a_cluster(cli_client, tmp_path):
    """On a cluster started by the ``dask`` CLI: five steps, the trunk once, the numbers
    JAX's."""
    log = RunLog(tmp_path / "runs")
    infos = _loop(_dag(log, jit=True), D, client=cli_client)
    assert len(log.pids("T")) == 1
    assert all(i.reused == ("T",) for i in infos[1:])


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_a_loop_with_kept_nodes_beside_one_of_the_head_alone_on_a_cluster(cli_client):
    """Two prepared functions on one cluster, called in turn: one whose trunk is kept (its call
    runs the head alone, the trunk's value an input) and the head alone. Their calls come to
    run whole in one task each, their graphs alike but for their inputs: each gets its own
    numbers."""
    T = jnp.tanh(D) * 2.0
    f = daskdag.value_and_grad({"T": daskdag.Node(lambda d: jnp.tanh(d) * 2.0, ["d"], jit=True),
                                "H": daskdag.Node(head, ["p", "T"], jit=True)}, "H", wrt=["p"],
                               client=cli_client)
    g = daskdag.value_and_grad({"H": daskdag.Node(head, ["p", "T"], jit=True)}, "H", wrt=["p"],
                               client=cli_client)
    for k in range(10):
        p = jnp.ones(3) * (0.2 * k)
        want = jax.value_and_grad(head)(p, T)
        for value, grads in (f({"p": p, "d": D}), g({"p": p, "T": T})):
            assert_tree_close(value, want[0], rtol=1e-5)
            assert_tree_close(grads["p"], want[1], rtol=1e-5)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_kept_values_outlive_every_worker_killed_between_two_calls(tmp_path):
    """Every worker SIGKILLed between two calls (nannies restart them): the next call still
    reuses the trunk (its value is kept in this process, placed on the cluster again), runs it
    nowhere, and returns JAX's numbers; afterwards the trunk's value changes and the call
    after follows it."""
    from .support.clusters import local_client
    from .support.faults import KEEP_NANNIES, sigkill, worker_pids

    log = RunLog(tmp_path / "runs")
    dag = _dag(log, jit=True)
    with dask.config.set(KEEP_NANNIES), local_client(2) as client:
        _loop(dag, D, steps=2, client=client)
        assert len(log.pids("T")) == 1
        sigkill(worker_pids(client).values())
        client.wait_for_workers(2, timeout=120)
        infos = _loop(dag, D, steps=2, client=client)
        assert len(log.pids("T")) == 1 and infos[0].reused == ("T",)
        _loop(dag, D + 1.0, steps=1, client=client)
        assert len(log.pids("T")) == 2


SCALE = 2.0


def test_a_global_the_trunk_reads_rebound_runs_it_again(tmp_path):
    """The trunk reads a module global: rebound between two calls, the trunk runs again and the
    numbers follow it; rebound to the same value, nothing changed, and the trunk is reused."""
    global SCALE
    log = RunLog(tmp_path / "runs")

    def trunk(d):
        jax.debug.callback(partial(_note, str(log.path), "T"))
        return jnp.tanh(d) * SCALE

    dag = {"T": daskdag.Node(trunk, ["d"], jit=True), "H": (head, ["p", "T"])}
    p = jnp.ones(3)
    try:
        daskdag.compute_grads(dag, {"p": p, "d": D}, "H", wrt=["p"])
        SCALE = 2.0
        assert daskdag.compute_grads(dag, {"p": p, "d": D}, "H", wrt=["p"]).info.reused == ("T",)
        SCALE = 5.0
        res = daskdag.compute_grads(dag, {"p": p, "d": D}, "H", wrt=["p"])
        assert len(log.pids("T")) == 2 and res.info.reused == ()
        want = jax.grad(lambda p: head(p, jnp.tanh(D) * 5.0))(p)
        assert_tree_close(res.grad["p"], want, rtol=1e-5)
    finally:
        SCALE = 2.0
