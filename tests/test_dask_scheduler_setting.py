"""Dask's ``scheduler`` setting (``dask.config.set(scheduler=...)``) decides where a call runs, as
it does for ``dask.compute``: an explicit ``scheduler=``/``client=`` first, then the setting,
then the default ``distributed`` client, else threads. The cluster's dashboard answers with the
``dashboard`` extra installed, and a call on threads never imports ``distributed``."""

import os
import subprocess
import sys
import threading
import time
import urllib.request

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag

from .support.clusters import RunLog
from .support.numbers import assert_tree_close

X = jnp.linspace(-1.0, 1.0, 6)


def _waiting_dag(threads: list):
    """Two branches that wait side by side on threads; each notes the thread it ran in."""
    def wait(x):
        threads.append(threading.get_ident())
        time.sleep(0.2)
        return x * 2.0

    return {"P": (wait, ["x"]), "Q": (lambda x: wait(x) + 1.0, ["x"]),
            "L": (lambda p, q: jnp.sum(p * q), ["P", "Q"])}


def _grad(x):
    return jax.grad(lambda x: jnp.sum(2 * x * (2 * x + 1)))(x)


@pytest.mark.parametrize("name", ["sync", "synchronous", "single-threaded"])
def test_the_sync_setting_runs_every_node_in_the_calling_thread(name):
    threads: list = []
    with dask.config.set(scheduler=name):
        r = daskdag.compute_grads(_waiting_dag(threads), X, "L")
    assert r.info.where == "this process (sync)"
    assert threads == [threading.get_ident()] * 2
    assert_tree_close(r.grad, _grad(X))


def test_the_sync_setting_runs_a_sweeps_nodes_in_the_calling_thread():
    threads: list = []
    xs = jnp.stack([X, X + 1.0, X - 1.0])
    with dask.config.set(scheduler="sync"):
        r = daskdag.sweep_grads(_waiting_dag(threads), xs, "L", chunk_size=1)
    assert set(threads) == {threading.get_ident()} and len(threads) == 6
    assert_tree_close(r.grad, jax.vmap(_grad)(xs))


def test_a_scheduler_given_to_the_call_wins_over_the_setting():
    threads: list = []
    with dask.config.set(scheduler="sync"):
        inline = daskdag.compute_grads(_waiting_dag(threads), X, "L")
        assert inline.info.where == "this process (sync)"
        threads.clear()
        r = daskdag.compute_grads(_waiting_dag(threads), X, "L", scheduler="threads")
    assert r.info.where == "this process (threads)"
    assert len(set(threads)) == 2  # the two branches on two threads, side by side


def test_the_threads_setting_and_dask_s_own_functions():
    threads: list = []
    with dask.config.set(scheduler=dask.local.get_sync):
        assert daskdag.compute_grads(_waiting_dag(threads), X, "L").info.where == \
            "this process (sync)"
    assert threads == [threading.get_ident()] * 2
    with dask.config.set(scheduler="threads"):
        assert daskdag.compute_grads(_waiting_dag([]), X, "L").info.where == \
            "this process (threads)"


def test_a_setting_daskdag_cannot_run_on_is_refused_by_name():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool, dask.config.set(scheduler=pool):
        with pytest.raises(daskdag.DAGError, match="dask.config's scheduler is <concurrent"):
            daskdag.compute_grads(_waiting_dag([]), X, "L")


def test_a_node_error_on_sync_carries_the_nodes_frame_for_a_debugger():
    def bad(x):
        raise FloatingPointError(f"in thread {threading.get_ident()}")

    dag = {"A": (bad, ["x"]), "L": (jnp.sum, ["A"])}
    with dask.config.set(scheduler="sync"), pytest.raises(daskdag.NodeError) as e:
        daskdag.compute_grads(dag, X, "L")
    assert str(threading.get_ident()) in str(e.value.__cause__)
    tb = e.value.__cause__.__traceback__
    while tb.tb_next is not None:  # (where pdb.post_mortem stops: the node's own frame)
        tb = tb.tb_next
    assert tb.tb_frame.f_code is bad.__code__


# -- Dask's multiprocessing scheduler ------------------------------------------------------------

def _pid_dag(log: RunLog):
    # Defined inside a function so that cloudpickle ships them by value to the processes.
    dag = {"A": (lambda x: jnp.tanh(x) * 2, ["x"]), "L": (lambda a: jnp.sum(a ** 2), ["A"])}
    return {n: (log.wrap(n, fn), deps) for n, (fn, deps) in dag.items()}


@pytest.mark.timeout(180)
@pytest.mark.subprocess
def test_the_processes_setting_runs_eager_calls_in_other_processes(tmp_path):
    log = RunLog(tmp_path / "runs")
    with dask.config.set(scheduler="processes", num_workers=2):
        r = daskdag.compute_grads(_pid_dag(log), X, "L")
    assert r.info.where == "Dask's multiprocessing scheduler (processes)"
    assert log.pids("A") and os.getpid() not in log.pids("A")
    assert_tree_close(r.grad, jax.grad(lambda x: jnp.sum((jnp.tanh(x) * 2) ** 2))(X))


@pytest.mark.timeout(180)
@pytest.mark.subprocess
def test_the_processes_setting_runs_sweeps_and_prepared_calls_and_refuses_what_cannot_run_there(
        tmp_path):
    log = RunLog(tmp_path / "runs")
    dag = _pid_dag(log)
    composed = lambda x: jnp.sum((jnp.tanh(x) * 2) ** 2)  # noqa: E731
    xs = jnp.stack([X, X + 1.0])
    with dask.config.set(scheduler="processes", num_workers=2):
        swept = daskdag.sweep_grads(dag, xs, "L")
        f = daskdag.value_and_grad(dag, "L")
        value, grad = f(X)
        with pytest.raises(daskdag.DAGError, match="sweep_grads with store= cannot run on "
                                                   "Dask's multiprocessing scheduler"):
            daskdag.sweep_grads(dag, xs, "L", store=str(tmp_path / "store"))
        with pytest.raises(daskdag.DAGError, match="check_grads cannot run on Dask's "
                                                   "multiprocessing scheduler"):
            daskdag.check_grads(dag, X, "L")
    assert_tree_close(swept.grad, jax.vmap(jax.grad(composed))(xs))
    assert_tree_close((value, grad), jax.value_and_grad(composed)(X))
    assert f.info.where == "Dask's multiprocessing scheduler (processes)"
    assert set(log.pids("A")) - {os.getpid()}  # (a sweep traces its nodes here first)


# -- with a cluster --------------------------------------------------------------------------------

@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_the_setting_wins_over_the_default_client(cluster):
    from distributed import Client

    threads: list = []
    with Client(cluster):  # the default client: Dask's setting is "dask.distributed" now
        with dask.config.set(scheduler="sync"):
            r = daskdag.compute_grads(_waiting_dag(threads), X, "L")
        assert r.info.where == "this process (sync)"
        assert threads == [threading.get_ident()] * 2
        assert daskdag.compute_grads(_waiting_dag([]), X, "L").info.where.startswith(
            "the cluster at")


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_local_clusters_dashboard_answers():
    pytest.importorskip("bokeh", reason="the dashboard extra: pip install '.[dashboard]'")
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=":0") as cluster:
        link = cluster.dashboard_link
        with urllib.request.urlopen(link, timeout=30) as answer:
            assert answer.status == 200


# -- what a call imports ----------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.subprocess
def test_import_and_a_call_on_threads_leave_distributed_unimported():
    code = ("import sys, jax.numpy as jnp, daskdag\n"
            "print('distributed' in sys.modules, 'jax' in sys.modules)\n"
            "dag = {'A': (jnp.sin, ['x']), 'L': (jnp.sum, ['A'])}\n"
            "daskdag.compute_grads(dag, jnp.arange(3.0), 'L')\n"
            "daskdag.sweep_grads(dag, jnp.ones((4, 3)), 'L')\n"
            "print('distributed' in sys.modules, 'dask.array' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100, check=True).stdout.split()
    assert out == ["False", "True", "False", "False"]
    bare = subprocess.run([sys.executable, "-c", "import sys, daskdag; "
                           "print(sorted({'jax', 'distributed'} & set(sys.modules)))"],
                          capture_output=True, text=True, timeout=100, check=True).stdout
    assert bare.strip() == "[]"


@pytest.mark.timeout(120)
@pytest.mark.subprocess
def test_a_daskdag_setting_set_before_the_first_call_leaves_the_others_in_place():
    """``with dask.config.set({"daskdag.reuse": ...})`` around a program's first call: on leaving
    it, Dask restores what it found, which must include daskdag's defaults (they join Dask's
    config at ``import daskdag``), or every later call finds no daskdag settings at all."""
    code = ("import dask, jax.numpy as jnp, daskdag\n"
            "dag = {'A': (jnp.sin, ['x']), 'L': (jnp.sum, ['A'])}\n"
            "with dask.config.set({'daskdag.reuse': 'all'}):\n"
            "    daskdag.compute_grads(dag, jnp.arange(3.0), 'L')\n"
            "print(dask.config.get('daskdag.reuse'))\n"
            "print(daskdag.compute_grads(dag, jnp.arange(3.0), 'L').grad.tolist())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    reuse, grad = out.stdout.splitlines()
    assert reuse == "jit"  # the default, back in place
    np.testing.assert_allclose(eval(grad), np.cos(np.arange(3.0)), rtol=1e-6)  # jax.grad's


@pytest.mark.timeout(120)
@pytest.mark.subprocess
def test_daskdag_version():
    for args in (["--version"], ["-V"]):
        out = subprocess.run([sys.executable, "-m", "daskdag.cli", *args], capture_output=True,
                             text=True, timeout=100, check=True).stdout
        assert out.strip() == f"daskdag {daskdag.__version__}"
