"""A prepared call's graph run in order in this process (:class:`daskdag.running.local.Schedule`):
the same values as Dask's own schedulers, each value let go after its last taker, the wrapper
every task shares entered once a call; and Python's full collections held off while a call runs
here (:class:`daskdag.running.local.FullCollectionsHeld`)."""

import gc
import operator
import os
import threading
import warnings

import dask
import jax
import jax.numpy as jnp
import pytest
from dask.callbacks import Callback
from dask.task_spec import DataNode, List, Task, TaskRef

import daskdag
from daskdag.running.local import HELD, Schedule
from daskdag.transport import scope

from .support.numbers import assert_tree_close

DAG = {"A": (lambda x: jnp.sin(x) * 2.0, ["x"]), "B": (lambda a: a ** 2 + 1.0, ["A"]),
       "C": (lambda b: jnp.cumsum(b) / 3.0, ["B"]), "D": (lambda c: jnp.sum(jnp.log(c)), ["C"]),
       "E": (lambda b: jnp.sum(jnp.sqrt(b)), ["B"])}
X = jnp.linspace(0.5, 2.0, 5)


def composed(x):
    b = (jnp.sin(x) * 2.0) ** 2 + 1.0
    return {"D": jnp.sum(jnp.log(jnp.cumsum(b) / 3.0)), "E": jnp.sum(jnp.sqrt(b))}


def check(res):
    for out in ("D", "E"):
        value, grad = jax.value_and_grad(lambda x: composed(x)[out])(X)
        assert_tree_close(res[out].value, value)
        assert_tree_close(res[out].grad, grad)


def test_a_schedule_computes_what_dask_computes():
    """Tasks with values, nested tasks, containers, data nodes and keyword arguments."""
    def scaled(a, by=1):
        return [v * by for v in a]

    dsk = {"a": Task("a", operator.add, TaskRef("slot"), 2),
           "b": Task("b", scaled, List(TaskRef("a"), Task(None, operator.mul, TaskRef("a"), 3)),
                     by=TaskRef("slot")),
           "c": Task("c", lambda d: (d["p"], d["q"]), {"p": TaskRef("b"), "q": DataNode(None, 5)}),
           "d": Task("d", operator.add, TaskRef("b"), [TaskRef("a")])}
    filled = {"slot": DataNode("slot", 4), **dsk}
    assert Schedule(dsk, ["c", "d"]).run({"slot": 4}) == list(dask.get(filled, ["c", "d"]))


def test_a_value_is_let_go_after_its_last_taker_unless_asked_for():
    dsk = {"a": Task("a", object), "b": Task("b", id, TaskRef("a")), "k": Task("k", object),
           "c": Task("c", operator.is_not, TaskRef("b"), TaskRef("k")),
           "d": Task("d", id, TaskRef("k"))}
    schedule = Schedule(dsk, ["c", "d", "k"])
    held = {}  # the values there as each task runs

    def watching(key, call):
        def call_watched(values):
            held[key] = sorted(values)
            return call(values)
        return call_watched

    schedule.steps = [(key, watching(key, call), *rest) for key, call, *rest in schedule.steps]
    c, d, k = schedule.run({})
    assert c is True and d == id(k)
    assert held == {"a": [], "b": ["a"], "k": ["b"], "c": ["b", "k"], "d": ["c", "k"]}


def test_a_prepared_call_enters_the_tasks_wrapper_once(monkeypatch):
    """Each task that computes is wrapped in ``scope.within`` (the call's JAX settings,
    malloc); run in order here, a prepared call enters it once, not once per task; on the
    threaded and the sync scheduler alike, with the same values; with gradients that are zeros
    (E does not read y: tasks that pick them apart, not wrapped) too."""
    entered = []
    applied = scope.JaxSettings.applied
    monkeypatch.setattr(scope.JaxSettings, "applied",
                        lambda self: entered.append(1) or applied(self))
    scaled = {**DAG, "D": (lambda c, y: jnp.sum(jnp.log(c)) * y, ["C", "y"])}
    y = jnp.float32(2.0)
    for scheduler in ("threads", "sync"):
        for _ in range(3):  # (a call like the last is a prepared one: its graph is a template)
            entered.clear()
            res = daskdag.compute_grads(DAG, X, ["D", "E"], scheduler=scheduler)
        check(res)
        assert len(entered) == 1, (scheduler, len(entered))
        for _ in range(3):
            entered.clear()
            res = daskdag.compute_grads(scaled, {"x": X, "y": y}, ["D", "E"],
                                        scheduler=scheduler)
        assert len(entered) == 1, (scheduler, len(entered))
        assert_tree_close(res["E"].grad["y"], jnp.zeros_like(y))
        assert_tree_close(res["D"].grad["y"], composed(X)["D"])
        assert_tree_close(res["D"].value, composed(X)["D"] * y)


def test_a_dask_callback_still_sees_a_prepared_calls_tasks():
    """A Dask callback (a progress bar, a profiler) watches Dask's scheduler: with one active,
    a prepared call runs there, on the sync scheduler too."""
    for _ in range(2):
        daskdag.compute_grads(DAG, X, ["D", "E"], scheduler="sync")
    ran = []
    with Callback(pretask=lambda key, dsk, state: ran.append(key)):
        res = daskdag.compute_grads(DAG, X, ["D", "E"], scheduler="sync")
    check(res)
    assert any(str(k).startswith("fwd:") for k in ran) and any(
        str(k).startswith("bwd:") for k in ran), ran


def test_full_collections_are_held_off_while_a_call_runs_here_and_back_after():
    during = []

    def watch(b):
        during.append(gc.get_threshold()[2])
        return jnp.sum(jnp.sqrt(b))

    before = gc.get_threshold()
    dag = {**DAG, "E": (watch, ["B"])}
    check(daskdag.compute_grads(dag, X, ["D", "E"]))
    assert during and set(during) == {HELD}
    assert gc.get_threshold() == before

    def fails(b):
        raise ValueError("no")

    with pytest.raises(daskdag.NodeError):
        daskdag.compute_grads({**DAG, "E": (fails, ["B"])}, X, ["D", "E"])
    assert gc.get_threshold() == before


def test_full_collections_come_back_when_the_last_of_several_calls_ends():
    """Calls from two threads, one inside a node of another: the threshold is back only once
    the last of them ends; one that the user set meanwhile is kept."""
    before = gc.get_threshold()
    inner_started, outer_may_end = threading.Event(), threading.Event()
    seen = {}

    def outer_node(b):
        inner_started.wait(60)
        seen["outer, inner running"] = gc.get_threshold()[2]
        outer_may_end.set()
        return jnp.sum(b)

    def inner_node(b):
        inner_started.set()
        outer_may_end.wait(60)
        res = daskdag.compute_grads(DAG, X, "D")  # (a call inside a node)
        seen["after a nested call"] = gc.get_threshold()[2]
        return jnp.sum(b) + res.value

    other = threading.Thread(
        target=lambda: seen.setdefault("inner", daskdag.compute_grads(
            {**DAG, "E": (inner_node, ["B"])}, X, "E")))
    other.start()
    daskdag.compute_grads({**DAG, "E": (outer_node, ["B"])}, X, "E")
    other.join(120)
    assert seen["outer, inner running"] == HELD and seen["after a nested call"] == HELD
    assert gc.get_threshold() == before
    try:
        daskdag.compute_grads({**DAG, "E": (lambda b: gc.set_threshold(700, 10, 77) or
                                            jnp.sum(b), ["B"])}, X, "E")
        assert gc.get_threshold() == (700, 10, 77)  # (the user's, set during the call)
    finally:
        gc.set_threshold(*before)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")
def test_a_process_forked_during_a_call_has_its_full_collections_back():
    read, write = os.pipe()
    before = gc.get_threshold()

    def forks(b):
        # JAX warns of a fork in a threaded process: the child only reads its threshold, exits.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pid = os.fork()
        if pid == 0:
            os.write(write, str(gc.get_threshold()[2]).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        return jnp.sum(b)

    daskdag.compute_grads({**DAG, "E": (forks, ["B"])}, X, "E")
    os.close(write)
    with os.fdopen(read) as f:
        assert int(f.read()) == before[2] != HELD
