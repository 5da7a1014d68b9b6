"""Calls as Dask collections (daskdag.grads, jacobians, jvps): nothing runs until computed, they
compute with other Dask work and share forward tasks, persist on a cluster, are checked against
the cluster at compute time; and scheduler= runs a call here while a default client exists."""

import os
import tomllib
from pathlib import Path

import dask
import dask.array as da
import distributed
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed import Client

import daskdag
from daskdag import ClusterError, DAGError, Node
from .support.clusters import RunLog
from .support.numbers import Counted, assert_tree_close, seed_functions

F = seed_functions()
X = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])


def seed_dag():
    f = {k: Counted(v) for k, v in F.items()}
    return {"A": (f["x_to_A"], ["x"]), "B": (f["A_to_B"], ["A"]), "C": (f["B_to_C"], ["B"]),
            "D": (f["C_to_D"], ["C"]), "E": (f["B_to_E"], ["B"])}, f


def composed(x):
    B = F["A_to_B"](F["x_to_A"](x))
    return {"C": F["B_to_C"](B), "D": F["C_to_D"](F["B_to_C"](B)), "E": F["B_to_E"](B)}


def test_nothing_runs_until_computed_and_then_as_the_eager_call():
    dag, f = seed_dag()
    calls = {"grads": daskdag.grads(dag, X, ["D", "E"]), "jacobians": daskdag.jacobians(dag, X, "C"),
             "jvps": daskdag.jvps(dag, X, jnp.ones(5), ["D", "E"])}
    assert all(fn.calls == 0 for fn in f.values())
    assert "daskdag.Call(outputs=['D', 'E'], wrt=['x']" in repr(calls["grads"])
    res = calls["grads"].compute()
    for o in ("D", "E"):
        value, grad = jax.value_and_grad(lambda x: composed(x)[o])(X)
        assert_tree_close(res[o].value, value, rtol=1e-6)
        assert_tree_close(res[o].grad, grad, rtol=1e-5)
    assert_tree_close(calls["jacobians"].compute().grad, jax.jacrev(lambda x: composed(x)["C"])(X),
                      rtol=1e-5)
    jv = calls["jvps"].compute()
    assert_tree_close(jv["D"].tangent, jax.jvp(lambda x: composed(x)["D"], (X,), (jnp.ones(5),))[1],
                      rtol=1e-5)


def test_two_calls_and_a_dask_array_in_one_compute_share_forward_tasks():
    dag, f = seed_dag()
    g, j = daskdag.grads(dag, X, ["D", "E"]), daskdag.jacobians(dag, X, ["D", "E"])
    total = da.from_array(np.arange(12.0), chunks=4).sum()
    assert set(dict(g.__dask_graph__())) & set(dict(j.__dask_graph__()))  # tasks in common
    res_g, res_j, s = dask.compute(g, j, total)
    assert s == 66.0
    assert f["x_to_A"].calls == 1 and f["A_to_B"].calls == 1  # once, for both calls (the trunk)
    for o in ("D", "E"):
        grad = jax.grad(lambda x: composed(x)[o])(X)
        assert_tree_close(res_g[o].grad, grad, rtol=1e-5)
        assert_tree_close(res_j[o].grad, grad, rtol=1e-5)  # a scalar's Jacobian is its gradient


@pytest.mark.subprocess
def test_scheduler_names_a_local_scheduler_or_a_client():
    dag, _ = seed_dag()
    with pytest.raises(DAGError, match="scheduler must be one of .*'sync'.*'threads'.* or a "
                                       "distributed.Client, got 'gpus'"):
        daskdag.compute_grads(dag, X, "D", scheduler="gpus")
    # Dask's multiprocessing scheduler, as dask.compute runs on it (issue 42: it was refused).
    res = daskdag.compute_grads(dag, X, "D", scheduler="processes")
    assert "multiprocessing" in res.info.where
    assert_tree_close(res.grad, jax.grad(lambda x: composed(x)["D"])(X), rtol=1e-5)
    with pytest.raises(DAGError, match="scheduler='threads' runs in this process, but client= "
                                       "names a cluster"):
        daskdag.compute_grads(dag, X, "D", scheduler="threads", client=object())
    assert_tree_close(daskdag.compute_grads(dag, X, "D", scheduler="sync").grad,
                      jax.grad(lambda x: composed(x)["D"])(X), rtol=1e-5)


SERIALIZERS_LATE = """
import daskdag, jax.numpy as jnp, numpy as np
dag = {"y": (lambda x: (x ** 2).sum(), ["x"])}
call = daskdag.grads(dag, jnp.arange(3.0), "y")
from distributed.protocol import deserialize, serialize  # a client made after daskdag's import
call.__dask_graph__()  # what client.compute(call) asks of it, whichever client it is
header, frames = serialize(daskdag.compute_grads(dag, jnp.arange(3.0), "y"))
assert header["serializer"] == "dask", header
np.testing.assert_array_equal(deserialize(header, frames).grad, [0.0, 2.0, 4.0])
"""


@pytest.mark.subprocess
def test_a_client_made_after_daskdag_was_imported_reads_its_results(tmp_path):
    # (distributed imported after daskdag, a client not the default: the results' classes
    # must still be registered with distributed's serializers where they arrive)
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", SERIALIZERS_LATE], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def default_client(cluster):  # (cluster: conftest's, one for the module)
    with Client(cluster) as client:  # the default client
        yield client


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_persist_on_a_cluster_then_compute_twice_without_running_forward_again(default_client,
                                                                               tmp_path):
    log = RunLog(tmp_path / "runs")  # each node's runs, in the workers
    dag = {name: (log.wrap(name, fn.fn), deps) for name, (fn, deps) in seed_dag()[0].items()}
    call = daskdag.grads(dag, X, ["D", "E"])
    tasks = set(dict(call.__dask_graph__()))
    assert repr(call).endswith("not computed)")
    persisted = call.persist()
    assert repr(persisted).endswith(", persisted)") and repr(call).endswith("not computed)")
    distributed.wait(list(dict(persisted.__dask_graph__()).values()))
    ran = log.runs()
    assert sorted(name for name, _ in ran) == sorted("ABCDE")  # each node once, to persist
    assert {pid for _, pid in ran} <= set(default_client.run(os.getpid).values())
    with distributed.get_task_stream(default_client) as ts:
        first, second = persisted.compute(), persisted.compute()
    assert log.runs() == ran  # no node ran again
    assert not tasks & {t["key"] for t in ts.data}  # nor any task of the call
    for res in (first, second):
        assert_tree_close(res["D"].grad, jax.grad(lambda x: composed(x)["D"])(X), rtol=1e-5)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_threads_with_a_default_client_present_run_here(default_client):
    dag, f = seed_dag()
    with distributed.get_task_stream(default_client) as ts:
        res = daskdag.compute_grads(dag, X, ["D", "E"], scheduler="threads")
        sweep = daskdag.sweep_grads(dag, jnp.stack([X, X + 1.0]), "D", scheduler="threads")
    assert ts.data == []  # nothing went to the cluster
    assert f["x_to_A"].calls == 3  # ran in this process: once for the call, once per item
    assert_tree_close(res["E"].grad, jax.grad(lambda x: composed(x)["E"])(X), rtol=1e-5)
    assert_tree_close(sweep.grad[1], jax.grad(lambda x: composed(x)["D"])(X + 1.0), rtol=1e-5)
    # without it, the default client runs the call: the counters here stay put
    daskdag.compute_grads(dag, X, ["D", "E"])
    assert f["x_to_A"].calls == 3


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_cluster_checks_run_at_compute_time(default_client):
    dag = {"A": Node(F["x_to_A"], ["x"], resources={"TPU": 1}), "D": (jnp.sum, ["A"])}
    call = daskdag.grads(dag, X, "D")  # built: no cluster asked yet
    with dask.config.set({"daskdag.worker-wait": "0.5s"}):
        with pytest.raises(ClusterError, match="node 'A' needs resources {'TPU': 1}"):
            call.compute()
        with pytest.raises(ClusterError, match="node 'A'"):
            dask.compute(call, da.ones(3).sum())


def test_version_is_the_projects():
    """``daskdag.__version__`` is the version pyproject.toml gives the project (through the
    installed package's metadata): not a copy that a release could forget to bump."""
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert daskdag.__version__ == pyproject["project"]["version"]


@pytest.mark.skipif(__import__("shutil").which("dot") is None,
                    reason="graphviz's `dot` program is not installed (apt-get install graphviz)")
@pytest.mark.subprocess
def test_visualize_draws_each_task_labelled_by_its_key(tmp_path):
    dag, _ = seed_dag()
    call = daskdag.grads(dag, X, ["D", "E"])
    out = tmp_path / "seed.svg"
    call.visualize(filename=str(out))
    svg = out.read_text().replace("&#45;", "-")
    tasks = [str(k) for k in dict(call.__dask_graph__())]
    assert len(tasks) >= 6
    for key in tasks:  # each task drawn, labelled by its key less the token
        label = key.rsplit("-", 1)[0]
        assert label and f">{label}<" in svg, (key, svg[:2000])
    assert "#b9d3ee" in svg and "#f6c89f" in svg  # forward tasks blue, backward ones orange


def test_calls_computed_together_share_the_stages_they_both_need(tmp_path):
    """Gradients of D and E and the Jacobian of C, computed together: the stages are cut by the
    DAG's own structure (B feeds C and E), not by what each call asks for, so A and B run once
    for both calls (here or on the module's default client, whichever is in effect)."""
    log = RunLog(tmp_path / "runs")
    dag = {name: (log.wrap(name, fn.fn), deps) for name, (fn, deps) in seed_dag()[0].items()}
    # (mode="rev": "auto" would first trace each node once on shapes, which the log notes.)
    grads, jacs = dask.compute(daskdag.grads(dag, X, ["D", "E"]),
                               daskdag.jacobians(dag, X, "C", mode="rev"))
    ran = [name for name, _ in log.runs()]
    assert ran.count("A") == 1 and ran.count("B") == 1, ran
    assert_tree_close(jacs.grad, jax.jacrev(lambda x: composed(x)["C"])(X), rtol=1e-5)
    assert_tree_close(grads["E"].grad, jax.grad(lambda x: composed(x)["E"])(X), rtol=1e-5)
