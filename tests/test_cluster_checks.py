"""Real clusters as users run them: closed clients, no workers, nodes that raise
KeyboardInterrupt, missing resources, replaced workers, progress and Ctrl-C."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import dask
import jax
import jax.numpy as jnp
import pytest
from distributed import Client, LocalCluster

import daskdag
from daskdag import ClusterError, Node, NodeError
from daskdag.cluster import workers as live_workers

from .conftest import assert_tree_close

pytestmark = pytest.mark.cluster

X = jnp.linspace(-1.0, 1.0, 5)


def _dag():
    # Made inside a function so cloudpickle ships them by value to worker processes.
    return {"A": (lambda x: jnp.sin(x) * 2, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}


def _grad(x):
    return jax.grad(lambda x: jnp.sum((jnp.sin(x) * 2) ** 2))(x)


def _tasks(client) -> dict:
    """``{key: state}`` of every task the scheduler holds."""
    return client.run_on_scheduler(
        lambda dask_scheduler: {str(k): ts.state for k, ts in dask_scheduler.tasks.items()})


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster:
        yield cluster


@pytest.fixture
def client(cluster):
    with Client(cluster, set_as_default=False) as client:
        yield client


@pytest.mark.timeout(60)
def test_closed_client_is_named(cluster):
    client = Client(cluster, set_as_default=False)
    client.close()
    with pytest.raises(ClusterError, match=f"client {client.id} \\(scheduler {cluster.scheduler_address}\\) "
                                           f"is closed: pass a running distributed.Client"):
        daskdag.compute_grads(_dag(), X, "B", client=client)
    with pytest.raises(ClusterError, match=f"client {client.id} .*is closed"):
        daskdag.sweep_grads(_dag(), jnp.stack([X, X]), "B", client=client)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_node_raising_keyboard_interrupt_or_system_exit_keeps_its_worker(client, kind):
    def node(a):
        raise kind("from the node")

    pid = client.run(os.getpid)
    with pytest.raises(NodeError, match=f"node 'A' failed in its forward pass: {kind.__name__}") as e:
        daskdag.compute_grads({"A": (node, ["x"]), "B": (jnp.sum, ["A"])}, X, "B", client=client)
    assert isinstance(e.value.__cause__, kind)
    assert client.run(os.getpid) == pid  # the same worker process, alive
    assert_tree_close(daskdag.compute_grads(_dag(), X, "B", client=client).grad, _grad(X))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("needs, flag", [({"TPU": 2}, "--resources TPU=2"),
                                         ({"GPU": 1, "MEM": 1e9}, '--resources "GPU=1 MEM=1e\\+09"')])
def test_missing_resource_suggests_the_resources_needed(client, needs, flag):
    dag = {"A": Node(jnp.sin, ["x"], resources=needs), "B": (jnp.sum, ["A"])}
    with pytest.raises(ClusterError, match=f"node 'A' needs resources .*`dask worker ADDRESS {flag}`"):
        daskdag.compute_grads(dag, X, "B", client=client)


@pytest.mark.timeout(120)
def test_no_worker_is_an_error_after_the_wait_and_an_adaptive_cluster_proceeds():
    with LocalCluster(n_workers=0, processes=True, host="127.0.0.1", dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as client:
        with dask.config.set({"daskdag.worker-wait": "2s"}):
            start = time.monotonic()
            with pytest.raises(ClusterError, match="the scheduler has no workers, and none joined "
                                                   "within 2 s.*'daskdag.worker-wait'"):
                daskdag.compute_grads(_dag(), X, "B", client=client)
            assert 2 <= time.monotonic() - start < 30  # waited, then gave up
            assert _tasks(client) == {}  # nothing left waiting for a worker
            with pytest.raises(ClusterError, match="no workers"):
                daskdag.sweep_grads(_dag(), jnp.stack([X, X]), "B", client=client)

        cluster.adapt(minimum=0, maximum=1)  # starts a worker only when a task waits for one
        with dask.config.set({"daskdag.worker-wait": "60s"}):
            res = daskdag.compute_grads(_dag(), X, "B", client=client)
        assert_tree_close(res.grad, _grad(X))


