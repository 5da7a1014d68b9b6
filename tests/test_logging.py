"""daskdag's log: silent unless configured; at INFO each call and sweep as submitted (what,
where, how big, bytes placed on a cluster), at DEBUG each task."""

import logging
import re
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

import daskdag

from .support.clusters import local_client

DAG = {"A": (jnp.sin, ["x"]), "B": (jnp.cumsum, ["A"]), "L": (jnp.sum, ["B"])}
X = jnp.arange(3.0)


@pytest.mark.subprocess
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
    summary = re.fullmatch(r"compute_grads: outputs \['L'\], wrt \['x'\]: 1 stages, (\d+) tasks, "
                           r"on this process \(threads\)", info[0])
    assert summary, info[0]
    assert info[1] == ("sweep_grads: outputs ['L'], wrt ['x']: 2 items in chunks of 1, 2 at a "
                       "time, on this process (threads)")
    # at DEBUG, each task of the call's graph: its key, and the function it runs
    named = [re.fullmatch(r"  task (\S+): (\S+)", m) for m in debug]
    assert all(named), debug
    assert len(debug) == len({m[1] for m in named}) == int(summary[1]) >= 2, (info[0], debug)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_on_a_cluster_it_names_the_scheduler_and_the_bytes_placed(caplog):
    with local_client(1) as client:
        big = jnp.arange(40_000.0)  # 160 kB: kept on the cluster (small values travel inline)
        with caplog.at_level(logging.INFO, logger="daskdag"):
            daskdag.compute_grads(DAG, big, "L", client=client)
            daskdag.compute_grads(DAG, big, "L", client=client)  # placed already: nothing sent
        first, second = (r.getMessage() for r in caplog.records if r.name == "daskdag")
        assert f"on the cluster at {client.scheduler.address}; placed " in first
        assert not first.endswith("placed 0 bytes on the cluster")
        assert second.endswith("placed 0 bytes on the cluster")
