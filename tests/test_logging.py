"""daskdag's log: silent unless configured; at INFO each call and sweep as submitted (what,
where, how big, bytes placed on a cluster), at DEBUG each task."""

import logging
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest
from distributed import Client, LocalCluster

import daskdag

DAG = {"A": (jnp.sin, ["x"]), "B": (jnp.cumsum, ["A"]), "L": (jnp.sum, ["B"])}
X = jnp.arange(3.0)


def test_silent_by_default():
    code = textwrap.dedent("""
        import jax.numpy as jnp, daskdag
        daskdag.compute_grads({"A": (jnp.sin, ["x"]), "L": (jnp.sum, ["A"])}, jnp.ones(3), "L")
        daskdag.sweep_grads({"A": (jnp.sin, ["x"]), "L": (jnp.sum, ["A"])}, jnp.ones((2, 3)), "L")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "" and done.stdout == ""


def test_info_says_what_went_where_and_debug_each_task(caplog):
    with caplog.at_level(logging.DEBUG, logger="daskdag"):
        daskdag.compute_grads(DAG, X, "L")
        daskdag.sweep_grads(DAG, jnp.stack([X, X]), "L", chunk_size=1)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "daskdag"]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and r.name == "daskdag"]
    assert info[0].startswith("compute_grads: outputs ['L'], wrt ['x']: 1 stages, ")
    assert info[0].endswith("on this process (threads)")
    assert info[1] == ("sweep_grads: outputs ['L'], wrt ['x']: 2 items in chunks of 1, 2 at a "
                       "time, on this process (threads)")
    assert any(m.startswith("  task fwd:A+B+L-") and m.endswith(": forward_backward") for m in debug)
    assert any(m.startswith("  task grad:L[x]-") for m in debug)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_on_a_cluster_it_names_the_scheduler_and_the_bytes_placed(caplog):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster, set_as_default=False) as client:
        big = jnp.arange(40_000.0)  # 160 kB: kept on the cluster (small values travel inline)
        with caplog.at_level(logging.INFO, logger="daskdag"):
            daskdag.compute_grads(DAG, big, "L", client=client)
            daskdag.compute_grads(DAG, big, "L", client=client)  # placed already: nothing sent
        first, second = (r.getMessage() for r in caplog.records if r.name == "daskdag")
        assert f"on the cluster at {client.scheduler.address}; placed " in first
        assert not first.endswith("placed 0 bytes on the cluster")
        assert second.endswith("placed 0 bytes on the cluster")
