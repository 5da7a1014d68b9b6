"""Interrupts: Ctrl-C stops a sweep and a call promptly, on threads and on a cluster, and leaves
the cluster idle, holding none of the call's tasks; a KeyboardInterrupt or SystemExit that a node
raises is that node's failure (a NodeError), not an interrupt, and its worker lives on.

Ctrl-C is SIGINT sent to a child process running the call (``tests/support/interrupts.py``). The
tests on a cluster of their own come first: the module's one-worker cluster (conftest's
``cluster`` and ``client`` fixtures) starts at the first test that asks for it."""

import os
import threading
import time

import jax.numpy as jnp
import pytest

import daskdag
from daskdag import NodeError
from .support.clusters import eventually, local_client, task_states
from .support.interrupts import (assert_ctrl_c_says_what_is_saved, assert_stopped_by_ctrl_c,
                                 interrupt, start_stored_sweep_child, start_sweep_child)
from .support.numbers import assert_tree_close, two_node_dag, two_node_grad

CLUSTER = {"n_workers": 1}  # the module's cluster (conftest's cluster and client fixtures)
X3 = jnp.arange(3.0)
X5 = jnp.linspace(-1.0, 1.0, 5)


# -- Ctrl-C stops a sweep ---------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.subprocess
def test_ctrl_c_stops_a_threaded_sweep():
    child = start_sweep_child()
    try:
        while not child.stdout.readline().startswith("item "):  # an item done: chunks are running
            assert child.poll() is None, child.stderr.read()
        assert_stopped_by_ctrl_c(child)
    finally:
        child.kill()


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_ctrl_c_stops_a_sweep_on_a_cluster():
    with local_client() as client:
        def processing():
            return client.run_on_scheduler(
                lambda dask_scheduler: sum(len(ws.processing) for ws in dask_scheduler.workers.values()))

        def executing():
            return sum(client.run(lambda dask_worker: len(dask_worker.state.executing)).values())

        child = start_sweep_child(client.cluster.scheduler_address)
        try:
            eventually(lambda: processing() > 0 and executing() > 0, 90,
                       "the child's sweep processing and executing on the workers")
            time.sleep(1.0)  # into the chunks' items
            assert_stopped_by_ctrl_c(child, here=False)
            stopped = time.monotonic()
            eventually(lambda: processing() == 0 and executing() == 0, 10,
                       "the workers idle after the sweep's process ended",
                       lambda: f"processing {processing()}, executing {executing()}")
            print(f"workers idle {time.monotonic() - stopped:.2f} s after the sweep's process ended")
        finally:
            child.kill()


# -- Ctrl-C in a sweep with a store: what is saved ----------------------------------------------------

@pytest.mark.timeout(180)
@pytest.mark.subprocess
def test_ctrl_c_in_a_stored_sweep_says_how_much_is_saved(tmp_path):
    child = start_stored_sweep_child(tmp_path / "store", tmp_path / "log")
    try:
        assert_ctrl_c_says_what_is_saved(child, tmp_path / "store", tmp_path / "log")
    finally:
        child.kill()


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_ctrl_c_in_a_stored_sweep_on_a_cluster_says_how_much_is_saved(tmp_path):
    with local_client() as client:
        child = start_stored_sweep_child(tmp_path / "store", tmp_path / "log",
                                         client.cluster.scheduler_address)
        try:
            assert_ctrl_c_says_what_is_saved(child, tmp_path / "store", tmp_path / "log")
        finally:
            child.kill()


# -- Ctrl-C stops a call ----------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheduler", ["threads", "sync"])
@pytest.mark.parametrize("progress", [False, True], ids=["", "progress"])
@pytest.mark.subprocess
def test_ctrl_c_stops_at_the_next_node(tmp_path, scheduler, progress):
    # The scheduler is given only as Dask's setting (ctrl_c_child.py), where the nodes run here.
    ctrl_c = interrupt(scheduler, tmp_path, progress)
    final = ctrl_c.end()  # the child has exited: no node of its call can start any more
    print(f"KeyboardInterrupt reached the user {ctrl_c.took:.2f} s after Ctrl-C; "
          f"{ctrl_c.started} nodes started")
    assert len(final) == ctrl_c.started < 8, final  # no node of the chain started after it
    # ... nor between Ctrl-C and it, but the next node where Ctrl-C came as one ended (an event
    # order, not a time: a loaded machine delays the child, not the order of its events)
    assert sum(s.time > ctrl_c.sent for s in final) <= 1, (ctrl_c.sent, final)
    if scheduler == "sync":  # every node in the main thread: where a Dask callback watches
        # (the progress bar), by Dask's synchronous scheduler, else by the call's own Schedule
        # (daskdag.running.local), which runs its tasks in the same order
        assert all(s.main and s.scheduler == ("sync" if progress else "-") for s in final), final
    else:
        assert not any(s.scheduler == "sync" for s in final), final


@pytest.mark.cluster
@pytest.mark.timeout(120)
@pytest.mark.parametrize("progress", [False, True], ids=["", "progress"])
def test_ctrl_c_cancels_the_call_on_the_cluster(client, tmp_path, progress):
    ctrl_c = interrupt(client.scheduler.address, tmp_path, progress)
    try:
        print(f"KeyboardInterrupt reached the user {ctrl_c.took:.2f} s after Ctrl-C; "
              f"{ctrl_c.started} nodes started")
        # Timed from SIGINT sent to the child's own except (not to this process reading it)
        assert ctrl_c.took < 2  # KeyboardInterrupt reached the user
        # ... and the scheduler comes to hold none of the call's tasks, though its client is still
        # there (the child's release travels to the scheduler as it may: waited for, not slept)
        def left():
            return {k: s for k, s in task_states(client).items()
                    if s in ("processing", "waiting", "queued", "no-worker")}

        eventually(lambda: not left(), 30, "the scheduler holding none of the call's tasks",
                   lambda: str(left()))
        # Once the worker runs nothing, no node of the call can start any more.
        eventually(lambda: not worker_busy(client), 30, "the worker idle after Ctrl-C",
                   lambda: str(worker_busy(client)))
    finally:
        final = ctrl_c.end()
    assert len(final) == ctrl_c.started < 8, final  # no node started after it
    assert not any(s.main for s in final), final  # (on the worker)


def worker_busy(client) -> dict:
    """``{key: state}`` of the tasks the workers run or will run."""
    busy = ("waiting", "ready", "constrained", "executing", "long-running", "cancelled", "resumed")
    return {k: s for states in client.run(lambda dask_worker: {
        str(k): ts.state for k, ts in dask_worker.state.tasks.items()}).values()
        for k, s in states.items() if s in busy}


# -- a KeyboardInterrupt or SystemExit raised by a node --------------------------------------------

def raises(kind):
    def node(a):
        raise kind("from the node")
    return node


# KeyboardInterrupt only off the main thread: in the user's main thread, where nodes run on
# "sync" (and on "threads" a task that runs alone), it may be a real Ctrl-C, and stays one
# (test_ctrl_c_stops_at_the_next_node).
@pytest.mark.parametrize("kind, scheduler, thread", [(SystemExit, "threads", "main"),
                                                     (SystemExit, "sync", "main"),
                                                     (KeyboardInterrupt, "threads", "other")])
def test_node_raising_keyboard_interrupt_or_system_exit_is_a_node_error(kind, scheduler, thread):
    dag = {"A": (raises(kind), ["x"]), "B": (jnp.sum, ["A"])}
    raised = []

    def call():
        try:
            daskdag.compute_grads(dag, X3, "B", scheduler=scheduler)
        except BaseException as e:
            raised.append(e)

    if thread == "main":
        call()
    else:
        other = threading.Thread(target=call)
        other.start()
        other.join()
    (e,) = raised
    assert isinstance(e, NodeError) and isinstance(e.__cause__, kind)
    assert str(e).startswith(f"node 'A' failed in its forward pass: {kind.__name__}")


@pytest.mark.cluster
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_node_raising_keyboard_interrupt_or_system_exit_keeps_its_worker(client, kind):
    pid = client.run(os.getpid)
    with pytest.raises(NodeError, match=f"node 'A' failed in its forward pass: {kind.__name__}") as e:
        daskdag.compute_grads({"A": (raises(kind), ["x"]), "B": (jnp.sum, ["A"])}, X5, "B",
                              client=client)
    assert isinstance(e.value.__cause__, kind)
    assert client.run(os.getpid) == pid  # the same worker process, alive
    assert_tree_close(daskdag.compute_grads(two_node_dag(), X5, "B", client=client).grad,
                      two_node_grad(X5))
