"""Programs (issue 40): a call compiled once and run at the cost of its work.

- Cotangents are a program's data, not its structure: calls with new cotangents build no graph.
- Connected ``jit=True`` nodes run as one program: an all-``jit`` call is one program (one
  dispatch here, one task on a cluster); between eager nodes, each jit region is one forward
  task (and one backward task where its cotangents come from later nodes).
- On a cluster, a step of a loop sends its new inputs and one task: the program stays on the
  workers (placed by the first call, compiled once there), counted by distributed's own
  byte counter and task stream.

Each result is checked against ``jax.value_and_grad`` / ``jax.vjp`` of the composed function.
"""

import logging
import time

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dask.callbacks import Callback
from distributed import get_task_stream

import daskdag
from daskdag import Node
from daskdag.graph import build as build_module
from daskdag.graph.assembly import kind_of, runs
from daskdag.running import programs, resident

from .support.numbers import TraceLog, assert_tree_close


def _trace(log, name, f):
    def fn(*a):
        log.append(name)  # (runs when JAX traces it, or each call where it runs eagerly)
        return f(*a)
    return fn


def seed_dag(log, jit=True):
    """The seed question's DAG, its two outputs summed into L; every node ``jit`` or eager."""
    fns = {"A": (lambda x: jnp.tanh(x) * 2.0, ["x"]),
           "B": (lambda a: jnp.outer(a, a) + jnp.eye(a.shape[0]), ["A"]),
           "C": (lambda b: jnp.linalg.solve(b, jnp.ones(b.shape[0])), ["B"]),
           "D": (lambda c: jnp.sum(c ** 2), ["C"]),
           "E": (lambda b: jnp.trace(b) / 10, ["B"]),
           "L": (lambda d, e: d + e, ["D", "E"])}
    return {k: Node(_trace(log, k, f), deps, jit=jit) for k, (f, deps) in fns.items()}


def composed(x):
    a = jnp.tanh(x) * 2.0
    b = jnp.outer(a, a) + jnp.eye(a.shape[0])
    c = jnp.linalg.solve(b, jnp.ones(b.shape[0]))
    return jnp.sum(c ** 2) + jnp.trace(b) / 10


def two_outputs(x):
    a = jnp.tanh(x) * 2.0
    b = jnp.outer(a, a) + jnp.eye(a.shape[0])
    return b, jnp.trace(b) / 10


def xs(n=4):
    return [np.linspace(0.5, 1.5, 5).astype(np.float32) + 0.01 * k for k in range(n)]


class Tasks(Callback):
    """The kinds of the tasks Dask's local scheduler ran (fwd, bwd, ...), in order."""

    def __init__(self):
        super().__init__()
        self.ran = []

    def _posttask(self, key, result, dsk, state, worker_id):
        self.ran.append(str(key))
        self.functions[str(key).partition("-")[0]] = runs(dsk[key]).__name__

    def _start(self, dsk):
        self.functions = {}


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def daskdag_log():
    log = logging.getLogger("daskdag")
    records, level = Records(), log.level
    log.addHandler(records)
    log.setLevel(logging.INFO)
    yield records.lines
    log.removeHandler(records)
    log.setLevel(level)


def _count_builds(monkeypatch):
    builds = []
    real = build_module.build

    def counted(*a, **k):
        builds.append(1)
        return real(*a, **k)

    for module in ("daskdag.graph.build", "daskdag.running.passes"):
        monkeypatch.setattr(f"{module}.build", counted)
    return builds


# --- Cotangents are data ---------------------------------------------------------------------------

def test_new_cotangents_build_no_graph_on_threads(monkeypatch):
    """A prepared call with a non-scalar output and new cotangents each call: the graph is
    built once (the program's template), every call right against jax.vjp."""
    log = TraceLog()
    dag = {k: (v.fn, v.deps) for k, v in seed_dag(log, jit=False).items()}  # eager: a graph runs
    builds = _count_builds(monkeypatch)
    rng = np.random.default_rng(0)
    for k, x in enumerate(xs()):
        ct = jnp.asarray(rng.standard_normal((5, 5)), jnp.float32)
        got = daskdag.compute_grads(dag, x, ["B", "E"], cotangents={"B": ct})
        (b, e), pull = jax.vjp(two_outputs, x)
        assert_tree_close(got["B"].value, b)
        assert_tree_close(got["B"].grad, pull((ct, jnp.zeros_like(e)))[0])
        assert_tree_close(got["E"].grad, pull((jnp.zeros_like(b), jnp.ones_like(e)))[0])
        assert got["B"].info.prepared == (k > 0)
    assert len(builds) == 1, builds


def test_new_cotangents_run_the_same_one_program_all_jit(monkeypatch, daskdag_log):
    """All-jit, cotangents given: one program, compiled once, whatever the cotangents."""
    log = TraceLog()
    dag = seed_dag(log)
    builds = _count_builds(monkeypatch)
    rng = np.random.default_rng(1)
    for x in xs():
        ct = jnp.asarray(rng.standard_normal((5, 5)), jnp.float32)
        got = daskdag.compute_grads(dag, x, ["B", "E"], cotangents={"B": ct})
        (b, e), pull = jax.vjp(two_outputs, x)
        assert_tree_close(got["B"].grad, pull((ct, jnp.zeros_like(e)))[0])
        assert_tree_close(got["E"].grad, pull((jnp.zeros_like(b), jnp.ones_like(e)))[0])
    assert len(builds) == 1
    assert sorted(log) == ["A", "B", "E"]  # each node traced once, in one program
    assert sum("one program" in line for line in daskdag_log) == len(xs())


# --- One program per jit region ---------------------------------------------------------------------

def test_an_all_jit_call_is_one_program_traced_once(daskdag_log):
    log = TraceLog()
    f = daskdag.value_and_grad(seed_dag(log), "L")
    for x in xs():
        value, grad = f(x)
        want_value, want_grad = jax.value_and_grad(composed)(x)
        assert_tree_close(value, want_value)
        assert_tree_close(grad, want_grad)
    assert sorted(log) == sorted("ABCDEL")  # traced once, for the first call's one program
    assert sum("one program" in line for line in daskdag_log) == len(xs())
    with Tasks() as tasks:  # (a Dask callback watching: the graph runs, one fused stage)
        value, grad = f(xs()[0])
    assert [k.partition("-")[0] for k in tasks.ran if kind_of(k) == "fwd"] == ["fwd:A+4more+L"]
    assert_tree_close(grad, jax.grad(composed)(xs()[0]))


def test_each_jit_region_between_eager_nodes_is_one_task():
    """x -> [A, B] jit -> C eager -> [D, E] jit -> L: per call, one forward task for each jit
    region and one backward task for the first (its cotangents come from C); the second is
    closed (its cotangents start at its own output), forward and backward in one task."""
    log = TraceLog()
    dag = seed_dag(log)
    dag["C"] = (dag["C"].fn, ["B"])
    dag["E"] = Node(_trace(log, "E", lambda c: jnp.sum(jnp.sin(c))), ["C"], jit=True)

    def want(x):
        a = jnp.tanh(x) * 2.0
        b = jnp.outer(a, a) + jnp.eye(a.shape[0])
        c = jnp.linalg.solve(b, jnp.ones(b.shape[0]))
        return jnp.sum(c ** 2) + jnp.sum(jnp.sin(c))

    f = daskdag.value_and_grad(dag, "L")
    for x in xs():
        with Tasks() as tasks:
            value, grad = f(x)
        assert_tree_close(value, want(x))
        assert_tree_close(grad, jax.grad(want)(x))
        stages = {k: fn for k, fn in tasks.functions.items() if kind_of(k) in ("fwd", "bwd")}
        assert stages == {"fwd:A+B": "forward", "fwd:C": "forward",
                          "fwd:D+E+L": "forward_backward",  # one program, both passes
                          "bwd:D+E+L[L]": "cotangents_of",  # (picks them from its result)
                          "bwd:C[L]": "backward", "bwd:A+B[L]": "backward"}, tasks.ran
    assert log.count("A") == 1 and log.count("D") == 1  # jit regions traced once
    assert log.count("C") == len(xs())  # the eager node runs at each call


KINDS = {  # (every kind of call, each with its mode given: "auto" traces the nodes to choose)
    "grads": lambda dag, x: daskdag.compute_grads(dag, x, "L").grad,
    "jacobian_rev": lambda dag, x: daskdag.jacobian(dag, x, "L", mode="rev").grad,
    "jacobian_fwd": lambda dag, x: daskdag.jacobian(dag, x, "L", mode="fwd").grad,
    "jvps": lambda dag, x: daskdag.compute_jvps(dag, x, jnp.ones(5), "L").tangent,
    "hvps": lambda dag, x: daskdag.compute_hvps(dag, x, jnp.ones(5), "L").hvp}
WANT = {"grads": jax.grad(composed), "jacobian_rev": jax.jacrev(composed),
        "jacobian_fwd": jax.jacfwd(composed),
        "jvps": lambda x: jax.jvp(composed, (x,), (jnp.ones(5),))[1],
        "hvps": lambda x: jax.jvp(jax.grad(composed), (x,), (jnp.ones(5),))[1]}


COMPILED: list = []  # (XLA's compilations, as JAX reports them)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **_: COMPILED.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_prepared_anew_runs_the_program_compiled_already(kind):
    """With preparations off, every call plans, packs and lifts the DAG anew, and still runs
    the one program the first call compiled: XLA compiles nothing more."""
    dag = seed_dag(TraceLog())
    with dask.config.set({"daskdag.prepared-calls": 0}):
        for k, x in enumerate(xs(3)):
            assert_tree_close(KINDS[kind](dag, x), WANT[kind](x))
            if k == 0:
                compiled = len(COMPILED)
    assert len(COMPILED) == compiled


@pytest.mark.parametrize("make", [
    lambda dag: daskdag.value_and_grad(dag, "L"),
    lambda dag: daskdag.value_and_jacobian(dag, "L", mode="fwd"),
    lambda dag: daskdag.value_and_jacobian(dag, "L", mode="rev"),
    lambda dag: (lambda f: lambda x: f(x, jnp.ones(5)))(daskdag.value_and_jvp(dag, "L")),
    lambda dag: (lambda f: lambda x: f(x, jnp.ones(5)))(daskdag.value_grad_and_hvp(dag, "L"))])
def test_a_prepared_call_checks_each_node_function_once(make, monkeypatch):
    """What a prepared call checks grows with what can change: each of the DAG's functions
    once, not the packed or lifted functions daskdag made of them."""
    f = make(seed_dag(TraceLog()))
    checked = []
    holding = programs.holding  # (the one check of a program's functions, made at its first use)
    monkeypatch.setattr(programs, "holding",
                        lambda watched, *first: checked.extend(fn for _, fn in watched)
                        or holding(watched, *first))
    f(xs()[0])
    f(xs()[1])
    assert len(checked) == 6  # (the six nodes' functions)
    f(xs()[2])
    assert len(checked) == 6  # (made once: the next calls run it)


# --- On a cluster ----------------------------------------------------------------------------------

def _settled(comm):
    """Until distributed's batched stream to the scheduler has sent all it buffered."""
    last = None
    for _ in range(100):
        now = (comm.byte_count, len(comm.buffer))
        if now == last and not comm.buffer:
            return
        last = now
        time.sleep(0.02)


def _sent(client, fn):
    """``fn()``, and the bytes the client wrote to the scheduler meanwhile (distributed's own
    count of its batched stream, which carries every graph)."""
    comm = client.scheduler_comm
    _settled(comm)
    before = comm.byte_count
    out = jax.block_until_ready(fn())
    _settled(comm)
    return out, comm.byte_count - before


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_cluster_step_sends_its_inputs_and_one_task(client, daskdag_log):
    """All-jit on a 2-worker LocalCluster(processes=True): the first call places the program;
    every later step runs one task and places nothing, and sends no more bytes than one
    ``client.submit`` of the jitted composed function kept on the workers (same input)."""
    log = TraceLog()
    f = daskdag.value_and_grad(seed_dag(log), "L", client=client)
    plain = jax.jit(jax.value_and_grad(composed))
    [kept] = client.scatter([plain], broadcast=True)
    x0 = xs()[0]
    f(x0)
    placed_first = [line for line in daskdag_log if "placed" in line]
    assert placed_first and "placed 0 bytes" not in placed_first[-1]  # the program, once
    daskdag_log.clear()
    sent, submitted = [], []
    for k, x in enumerate(xs(6)):
        with get_task_stream(client) as ts:
            (value, grad), n = _sent(client, lambda: f(x))
        sent.append(n)
        assert len(ts.data) == 1, ts.data  # one task a step, the program kept on its worker
        want_value, want_grad = jax.value_and_grad(composed)(x)
        assert_tree_close(value, want_value, rtol=1e-5)
        assert_tree_close(grad, want_grad, rtol=1e-5)
        _, n = _sent(client, lambda: client.submit(lambda f, x: f(x), kept, x, pure=False).result())
        submitted.append(n)
    assert all("placed 0 bytes" in line for line in daskdag_log if "placed" in line)
    assert sorted(sent)[len(sent) // 2] <= 1.2 * sorted(submitted)[len(submitted) // 2], \
        (sent, submitted)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_cotangents_on_a_cluster_are_inputs_of_the_one_task(client):
    log = TraceLog()
    dag = seed_dag(log)
    rng = np.random.default_rng(2)
    for x in xs(3):
        ct = jnp.asarray(rng.standard_normal((5, 5)), jnp.float32)
        with get_task_stream(client) as ts:
            got = daskdag.compute_grads(dag, x, ["B", "E"], cotangents={"B": ct}, client=client)
        (b, e), pull = jax.vjp(two_outputs, x)
        assert_tree_close(got["B"].value, b, rtol=1e-5)
        assert_tree_close(got["B"].grad, pull((ct, jnp.zeros_like(e)))[0], rtol=1e-5)
        assert_tree_close(got["E"].grad, pull((jnp.zeros_like(b), jnp.ones_like(e)))[0], rtol=1e-5)
        assert len([t for t in ts.data if not t["key"].startswith("program")]) == 1


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_kept_program_sees_a_closed_over_array_changed_in_place(client):
    """The program kept on the cluster is the program of the functions' content: an array the
    node closes over, changed in place between two steps, gives a new program there."""
    w = np.ones(5, np.float32)
    dag = {"A": Node(lambda x: jnp.sin(x) * w, ["x"], jit=True),
           "L": Node(lambda a: jnp.sum(a ** 2), ["A"], jit=True)}
    f = daskdag.value_and_grad(dag, "L", client=client)
    for scale in (1.0, -3.0, 0.5):
        w[:] = scale
        x = xs()[0]
        value, grad = f(x)
        want = jax.value_and_grad(lambda x: jnp.sum((jnp.sin(x) * jnp.asarray(w)) ** 2))(x)
        assert_tree_close(value, want[0], rtol=1e-5)
        assert_tree_close(grad, want[1], rtol=1e-5)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_an_all_jit_loop_on_a_cluster_that_cannot_import_this_module(cli_client):
    log = TraceLog()
    f = daskdag.value_and_grad(seed_dag(log), "L", client=cli_client)
    for x in xs(3):
        with get_task_stream(cli_client) as ts:
            value, grad = f(x)
        want_value, want_grad = jax.value_and_grad(composed)(x)
        assert_tree_close(value, want_value, rtol=1e-5)
        assert_tree_close(grad, want_grad, rtol=1e-5)
    assert len(ts.data) == 1


# --- Eager stages on a cluster: spread, or the whole graph in one task, as the calls measure --------

def _tasks_per_call(client, f, inputs):
    """Per call of ``f``: its result and the keys of the tasks the workers ran for it, but the
    values it kept on the cluster (placed once, for later calls)."""
    out = []
    for x in inputs:
        with get_task_stream(client) as ts:
            result = f(x)
        out.append((result, [t["key"] for t in ts.data if kind_of(t["key"]) != "program"]))
    return out


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_a_loop_of_short_eager_stages_runs_in_one_task_with_values_from_jax(cli_client,
                                                                          one_task_in_reach):
    """Eager nodes, on a cluster started by the ``dask`` CLI (the workers cannot import this
    module): a loop's first calls spread a task per stage; once the calls have measured that
    one task is faster (the stages are microseconds long), each call is one task, and sends
    its new input only (the graph kept on the cluster). Every value and gradient is
    ``jax.value_and_grad``'s, before and after the switch, and after the function a node
    closes over is changed in place."""
    scale = np.ones(5, np.float32)
    dag = seed_dag(TraceLog(), jit=False)
    dag["A"] = Node(lambda x: jnp.tanh(x) * 2.0 * scale, ["x"])
    f = daskdag.value_and_grad(dag, "L", client=cli_client)

    def want(x):
        return jax.value_and_grad(_scaled)(x, scale)

    runs = _tasks_per_call(cli_client, f, xs(12))
    for x, ((value, grad), _) in zip(xs(12), runs):
        assert_tree_close(value, want(x)[0], rtol=1e-5)
        assert_tree_close(grad, want(x)[1], rtol=1e-5)
    tasks = [len(keys) for _, keys in runs]
    assert tasks[0] > 6 and all(n == 1 for n in tasks[-4:]), tasks
    kept = resident.of(cli_client)
    before = kept.sent
    f(xs()[1])
    assert kept.sent == before  # the graph is kept: a step places nothing

    scale[:] = -0.5  # in place: a new graph, with the new content, wherever it runs
    for x, ((value, grad), _) in zip(xs(3), _tasks_per_call(cli_client, f, xs(3))):
        assert_tree_close(value, want(x)[0], rtol=1e-5)
        assert_tree_close(grad, want(x)[1], rtol=1e-5)


def _scaled(x, scale):
    a = jnp.tanh(x) * 2.0 * jnp.asarray(scale)
    b = jnp.outer(a, a) + jnp.eye(a.shape[0])
    c = jnp.linalg.solve(b, jnp.ones(b.shape[0]))
    return jnp.sum(c ** 2) + jnp.trace(b) / 10


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_long_eager_stages_side_by_side_stay_spread(client):
    """Two branches that each take longer than a call in one task may (a sleep each): the
    calls keep a task per stage, and the branches run on both workers at once."""
    def slow(k):
        def fn(x):
            time.sleep(0.3)
            return jnp.sin(x) * k
        return fn

    dag = {"P": (slow(1.0), ["x"]), "Q": (slow(2.0), ["x"]),
           "L": (lambda p, q: jnp.sum(p * q), ["P", "Q"])}
    f = daskdag.value_and_grad(dag, "L", client=client)
    runs = _tasks_per_call(client, f, xs(7))
    for x, ((value, grad), keys) in zip(xs(7), runs):
        want = jax.value_and_grad(lambda x: jnp.sum(jnp.sin(x) * jnp.sin(x) * 2.0))(x)
        assert_tree_close(value, want[0], rtol=1e-5)
        assert_tree_close(grad, want[1], rtol=1e-5)
        assert len(keys) > 1, keys


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_a_node_failing_inside_the_one_task_is_named(client, one_task_in_reach):
    """Once the calls run in one task, a node that raises is a NodeError naming it, as when
    the stages spread; and the next call with good inputs computes as before."""
    def checked(x, n):
        if int(n) > 10:  # (an integer input: not differentiated, so a value here)
            raise ValueError("n is out of range")
        return jnp.sin(x)

    dag = {"A": (checked, ["x", "n"]), "L": (lambda a: jnp.sum(a ** 2), ["A"])}
    f = daskdag.value_and_grad(dag, "L", client=client)
    runs = _tasks_per_call(client, f, [{"x": x, "n": np.int32(1)} for x in xs(8)])
    assert len(runs[-1][1]) == 1  # in one task by now
    with pytest.raises(daskdag.NodeError, match="'A'") as e:
        f({"x": xs()[0], "n": np.int32(20)})
    assert "out of range" in str(e.value)
    value, grad = f({"x": xs()[2], "n": np.int32(1)})
    want = jax.value_and_grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(xs()[2])
    assert_tree_close(value, want[0], rtol=1e-5)
    assert_tree_close(grad["x"], want[1], rtol=1e-5)
