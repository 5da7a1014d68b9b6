"""What a call checks of its cluster, and the errors that say what is wrong, on real clusters as
users run them: a closed client, a node's resources that no worker offers (an error after
``daskdag.worker-wait``; a worker that joins meanwhile runs the node), no workers (an error
after the wait too; an adaptive cluster scales up instead), a worker replaced by one
with another daskdag version; and the progress bar a call shows there. (Lost workers:
test_lost_workers.py; Ctrl-C: test_interrupts.py.)"""

import os
import threading
import time

import dask
import jax
import jax.numpy as jnp
import pytest
from distributed import Client

import daskdag
from daskdag import ClusterError, Node
from .support.clusters import (DaskCLI, RunLog, eventually, free_port, live_workers, local_client,
                               task_states)
from .support.numbers import assert_tree_close, two_node_dag, two_node_grad

pytestmark = pytest.mark.cluster

CLUSTER = {"n_workers": 1}  # the module's cluster (conftest's cluster and client fixtures)
X = jnp.linspace(-1.0, 1.0, 5)


@pytest.mark.timeout(60)
def test_closed_client_is_named(cluster):
    client = Client(cluster, set_as_default=False)
    client.close()
    with pytest.raises(ClusterError, match=f"client {client.id} \\(scheduler {cluster.scheduler_address}\\) "
                                           f"is closed: pass a running distributed.Client"):
        daskdag.compute_grads(two_node_dag(), X, "B", client=client)
    with pytest.raises(ClusterError, match=f"client {client.id} .*is closed"):
        daskdag.sweep_grads(two_node_dag(), jnp.stack([X, X]), "B", client=client)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("needs, flag", [({"TPU": 2}, "--resources TPU=2"),
                                         ({"GPU": 1, "MEM": 1e9}, '--resources "GPU=1 MEM=1e\\+09"')])
def test_missing_resource_suggests_the_resources_needed(client, needs, flag):
    dag = {"A": Node(jnp.sin, ["x"], resources=needs), "B": (jnp.sum, ["A"])}
    with dask.config.set({"daskdag.worker-wait": "0.5s"}), \
            pytest.raises(ClusterError, match=f"node 'A' needs resources .*joined within 0.5 s "
                                              f"\\(daskdag.worker-wait\\).*`dask worker ADDRESS {flag}`"):
        daskdag.compute_grads(dag, X, "B", client=client)


@pytest.mark.timeout(60)
def test_progress_bar_on_a_cluster(client, capsys):
    res = daskdag.compute_grads(two_node_dag(), X, "B", client=client, progress=True)
    assert "100% Completed" in capsys.readouterr().out  # distributed.progress's text bar
    assert_tree_close(res.grad, two_node_grad(X))


@pytest.mark.timeout(120)
def test_no_worker_is_an_error_after_the_wait_and_an_adaptive_cluster_proceeds():
    # (threads_per_worker: LocalCluster's own default, for the worker adapt() starts)
    with local_client(0, threads_per_worker=None) as client:
        cluster = client.cluster
        with dask.config.set({"daskdag.worker-wait": "2s"}):
            start = time.monotonic()
            with pytest.raises(ClusterError, match="the scheduler has no workers, and none joined "
                                                   "within 2 s.*'daskdag.worker-wait'"):
                daskdag.compute_grads(two_node_dag(), X, "B", client=client)
            assert 2 <= time.monotonic() - start < 30  # waited, then gave up
            assert task_states(client) == {}  # nothing left waiting for a worker
            with pytest.raises(ClusterError, match="no workers"):
                daskdag.sweep_grads(two_node_dag(), jnp.stack([X, X]), "B", client=client)

        cluster.adapt(minimum=0, maximum=1)  # starts a worker only when a task waits for one
        with dask.config.set({"daskdag.worker-wait": "60s"}):
            res = daskdag.compute_grads(two_node_dag(), X, "B", client=client)
        assert_tree_close(res.grad, two_node_grad(X))


@pytest.mark.timeout(240)
def test_a_node_waits_for_a_resource_that_appears_after_the_call_starts(tmp_path):
    """A GPU worker that joins after the call started (an adaptive cluster or a batch queue
    starting it) runs the node that needs it: the call waits, then runs there."""
    log = RunLog(tmp_path / "runs")
    dag = {"A": Node(log.wrap("A", lambda x: jnp.sin(x) * 2.0), ["x"], resources={"GPU": 1}),
           "B": (log.wrap("B", jnp.sum), ["A"])}
    cli = DaskCLI(tmp_path)
    try:
        address = cli.scheduler()
        cli.worker("--no-nanny")  # a worker without the resource
        with Client(address, set_as_default=False, timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            joined: list = []
            later = threading.Timer(2.0, lambda: joined.append(
                cli.worker("--no-nanny", "--resources", "GPU=1")))
            started = time.monotonic()
            later.start()
            try:
                with dask.config.set({"daskdag.worker-wait": "120s"}):
                    res = daskdag.compute_grads(dag, X, "B", client=client)
            finally:
                later.cancel()
            assert time.monotonic() - started > 2.0  # (it waited for the worker)
            assert_tree_close(res.grad, jax.grad(lambda x: jnp.sum(jnp.sin(x) * 2.0))(X))
            assert log.pids("A") == [joined[0].pid]  # (on the worker that joined, once)
            assert set(live_workers(client)) == set(client.run(os.getpid))  # (both there)
    finally:
        cli.stop()


@pytest.mark.timeout(180)
def test_worker_replaced_at_the_same_address_is_version_checked(tmp_path):
    """A worker restarted at its address with another daskdag: the next call names it."""
    other = tmp_path / "other_version.py"  # a --preload module, imported by the worker at start
    other.write_text("import daskdag\ndaskdag.__version__ = '0.0.0-other'\n")
    port = free_port()
    cli = DaskCLI(tmp_path)
    try:
        address = cli.scheduler()
        worker = cli.worker("--no-nanny", "--worker-port", str(port))
        with Client(address, set_as_default=False, timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            (first,) = live_workers(client)
            assert first == f"tcp://127.0.0.1:{port}"
            assert_tree_close(daskdag.compute_grads(two_node_dag(), X, "B", client=client).grad,
                              two_node_grad(X))

            worker.terminate()
            worker.wait(timeout=30)
            eventually(lambda: not live_workers(client), 60,
                       "the stopped worker gone from the scheduler", lambda: list(live_workers(client)))
            cli.worker("--no-nanny", "--worker-port", str(port), "--preload", str(other))
            client.wait_for_workers(1, timeout=60)
            assert list(live_workers(client)) == [first]  # the same address, a new process
            with pytest.raises(ClusterError, match=f"workers differ.*{first}.*0.0.0-other"):
                daskdag.compute_grads(two_node_dag(), X, "B", client=client)
    finally:
        cli.stop()
