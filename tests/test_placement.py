"""Nodes placed on the local devices of one process (``Node(device=...)``), with the four CPU
devices the root conftest.py gives JAX: on threads and in each worker of a 2-worker cluster,
every kind in every form, each node's inputs, eager ops and value on its device, and every
derivative equal to JAX's of the composed function.

What a node saw is recorded inside its function: the devices of its concrete inputs (a dep
held constant), of its eager ops (``jnp.zeros``), and, for its traced inputs, a product with a
scalar committed to its device, which JAX refuses where the input is committed to another one.
On a cluster the records travel as distributed's events (``Worker.log_event``)."""

from __future__ import annotations

import uuid

import dask
import distributed
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import Node

from .support.keys import key_kind, key_label

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 4,
                                reason="needs 4 CPU devices (XLA_FLAGS, set by conftest.py)")

X = jnp.linspace(0.1, 1.0, 5)
W = jnp.linspace(0.5, 1.5, 5)
T = jnp.linspace(-1.0, 1.0, 5)  # a tangent of x (JVPs, HVPs)
TS = {"x": T, "w": None}
INPUTS = {"x": X, "w": W}
#: The device each node runs on, by its index in jax.devices(); L gives none: the default one.
ON = {"A": 1, "B": 2, "C": 3, "M": 1, "L": 0}


def record(topic: str, sink: list, entry: dict) -> None:
    """``entry`` told: as an event of ``topic`` in a cluster's worker, else into ``sink``."""
    try:
        worker = distributed.get_worker()
    except ValueError:  # (not in a worker: this process's threads)
        sink.append(entry)
    else:
        worker.log_event(topic, entry)


def eager(topic: str, sink: list, name: str, fn):
    """``fn`` as an eager node that records where it ran (see the module's docstring)."""
    def node(*args):
        def ids(a):
            return sorted(d.id for d in a.devices())

        concrete = [ids(a) for a in args
                    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)]
        record(topic, sink, {"node": name, "ops": ids(jnp.zeros(())), "inputs": concrete})
        return fn(*args) * jax.device_put(jnp.float32(1), jax.devices()[ON[name]])
    return node


def placed_dag(topic: str, sink: list) -> dict:
    """x -> A (eager, cpu:1) -> B (jit, cpu:2) and C (eager, a jax.Device: cpu:3), a fan-out
    across devices; C -> M (jit, cpu:1); L (eager, no device) of B, C and M."""
    return {"A": Node(eager(topic, sink, "A", lambda x, w: jnp.sin(x) * w), ["x", "w"],
                      device="cpu:1"),
            "B": Node(lambda a: jnp.cos(a) ** 2, ["A"], jit=True, device="cpu:2"),
            "C": Node(eager(topic, sink, "C", lambda a, w: jnp.tanh(a) + w), ["A", "w"],
                      device=jax.devices()[3]),
            "M": Node(lambda c: jnp.sum(c ** 3), ["C"], jit=True, device="cpu:1"),
            "L": Node(eager(topic, sink, "L", lambda b, c, m: jnp.sum(b * c) + m),
                      ["B", "C", "M"])}


def composed_c(x, w=W):
    return jnp.tanh(jnp.sin(x) * w) + w


def composed(x, w=W):
    a = jnp.sin(x) * w
    c = jnp.tanh(a) + w
    return jnp.sum(jnp.cos(a) ** 2 * c) + jnp.sum(c ** 3)


def _x(grad):
    return grad["x"] if isinstance(grad, dict) else grad


#: Per kind and form, ``(what daskdag gives, what JAX gives)``: ``call(dag, client)``.
CASES = {
    ("grads", "eager"): lambda dag, client: _x(daskdag.compute_grads(
        dag, INPUTS, "L", wrt=["x"], client=client).grad),
    ("grads", "lazy"): lambda dag, client: _x(dask.compute(
        daskdag.grads(dag, INPUTS, "L", wrt=["x"]), scheduler=client)[0].grad),
    ("grads", "prepared"): lambda dag, client: _x(daskdag.value_and_grad(
        dag, "L", wrt=["x"], client=client)(INPUTS)[1]),
    ("jacobian rev", "eager"): lambda dag, client: _x(daskdag.jacobian(
        dag, INPUTS, "C", wrt=["x"], mode="rev", client=client).grad),
    ("jacobian rev", "lazy"): lambda dag, client: _x(dask.compute(daskdag.jacobians(
        dag, INPUTS, "C", wrt=["x"], mode="rev"), scheduler=client)[0].grad),
    ("jacobian rev", "prepared"): lambda dag, client: _x(daskdag.value_and_jacobian(
        dag, "C", wrt=["x"], mode="rev", client=client)(INPUTS)[1]),
    ("jacobian fwd", "eager"): lambda dag, client: _x(daskdag.jacobian(
        dag, INPUTS, "C", wrt=["x"], mode="fwd", client=client).grad),
    ("jacobian fwd", "lazy"): lambda dag, client: _x(dask.compute(daskdag.jacobians(
        dag, INPUTS, "C", wrt=["x"], mode="fwd"), scheduler=client)[0].grad),
    ("jacobian fwd", "prepared"): lambda dag, client: _x(daskdag.value_and_jacobian(
        dag, "C", wrt=["x"], mode="fwd", client=client)(INPUTS)[1]),
    ("jvps", "eager"): lambda dag, client: daskdag.compute_jvps(
        dag, INPUTS, TS, "L", wrt=["x"], client=client).tangent,
    ("jvps", "lazy"): lambda dag, client: dask.compute(daskdag.jvps(
        dag, INPUTS, TS, "L", wrt=["x"]), scheduler=client)[0].tangent,
    ("jvps", "prepared"): lambda dag, client: daskdag.value_and_jvp(
        dag, "L", wrt=["x"], client=client)(INPUTS, TS)[1],
    ("hvps", "eager"): lambda dag, client: _x(daskdag.compute_hvps(
        dag, INPUTS, TS, "L", wrt=["x"], client=client).hvp),
    ("hvps", "lazy"): lambda dag, client: _x(dask.compute(daskdag.hvps(
        dag, INPUTS, TS, "L", wrt=["x"]), scheduler=client)[0].hvp),
    ("hvps", "prepared"): lambda dag, client: _x(daskdag.value_grad_and_hvp(
        dag, "L", wrt=["x"], client=client)(INPUTS, TS)[2]),
}
JAX = {"grads": lambda: jax.grad(composed)(X),
       "jacobian rev": lambda: jax.jacrev(composed_c)(X),
       "jacobian fwd": lambda: jax.jacfwd(composed_c)(X),
       "jvps": lambda: jax.jvp(composed, (X,), (T,))[1],
       "hvps": lambda: jax.jvp(jax.grad(composed), (X,), (T,))[1]}


def check_records(records: list, kind: str) -> None:
    """Each eager node that ran recorded its own device for its eager ops and its concrete
    inputs (``w``, held constant, is always one)."""
    ran = {r["node"] for r in records}
    assert ran == ({"A", "C"} if kind.startswith("jacobian") else {"A", "C", "L"}), records
    for r in records:  # (lists, or tuples where they travelled as events)
        assert list(r["ops"]) == [ON[r["node"]]], r
        assert all(list(ids) == [ON[r["node"]]] for ids in r["inputs"]), r
    assert all(any(r["inputs"] for r in records if r["node"] == n) for n in ("A", "C")), records


# -- threads ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, form", list(CASES))
def test_every_kind_and_form_on_threads(kind, form):
    sink: list = []
    got = CASES[kind, form](placed_dag("placement", sink), None)
    np.testing.assert_allclose(got, JAX[kind](), rtol=2e-5, atol=1e-6)
    check_records(sink, kind)


def test_each_value_on_its_node_s_device():
    """The value each node's forward task leaves (read from the lazy call's tasks, run here)."""
    dag = placed_dag("placement", [])
    graph = daskdag.grads(dag, INPUTS, "L", wrt=["x"])
    tasks = dict(graph.__dask_graph__())
    values = {key_label(k): k for k in tasks if key_kind(k) == "val"}
    assert set(values) == set(ON)
    computed = dask.get(tasks, [values[n] for n in ON])
    assert {n: sorted(d.id for d in v.devices()) for n, v in zip(ON, computed)} == \
        {n: [k] for n, k in ON.items()}


def test_results_on_the_default_device():
    res = daskdag.compute_grads(placed_dag("placement", []), INPUTS, "L", wrt=["x"])
    assert res.value.devices() == res.grad["x"].devices() == {jax.devices()[0]}


def test_stages_and_programs_split_where_the_device_changes():
    dag = {"J1": Node(jnp.sin, ["x"], jit=True, device="cpu:1"),
           "J2": Node(lambda a: a * 3.0, ["J1"], jit=True, device="cpu:1"),
           "J3": Node(jnp.cos, ["J2"], jit=True, device="cpu:2"),
           "L": Node(jnp.sum, ["J3"], jit=True, device="cpu:2")}
    graph = daskdag.grads(dag, X, "L")
    assert {key_label(k) for k in graph.__dask_graph__() if key_kind(k) == "fwd"} == \
        {"J1+J2", "J3+L"}
    f = daskdag.value_and_grad(dag, "L")
    for _ in range(2):  # (two programs, no whole one: each on its device)
        _, grad = f(X)
        np.testing.assert_allclose(grad, jax.grad(lambda x: jnp.sum(jnp.cos(jnp.sin(x) * 3)))(X),
                                   rtol=1e-5)
    same = {n: Node(node.fn, node.deps, jit=True, device="cpu:2") for n, node in dag.items()}
    assert {key_label(k) for k in daskdag.grads(same, X, "L").__dask_graph__()
            if key_kind(k) == "fwd"} == {"J1+J2+J3+L"}
    np.testing.assert_allclose(daskdag.value_and_grad(same, "L")(X)[1], grad, rtol=1e-6)


def test_eager_device_setting_places_eager_nodes_that_give_none():
    sink: list = []

    def seen(name, fn):
        def node(*args):
            sink.append((name, sorted(d.id for d in jnp.zeros(()).devices())))
            return fn(*args)
        return node

    dag = {"A": (seen("A", lambda x: jnp.sin(x) * 2.0), ["x"]),
           "J": Node(lambda a: a ** 2, ["A"], jit=True),
           "P": Node(seen("P", jnp.tanh), ["J"], device="cpu:1"),
           "L": (seen("L", jnp.sum), ["P"])}
    with dask.config.set({"daskdag.eager-device": "cpu:3"}):
        res = daskdag.compute_grads(dag, X, "L")
        tasks = dict(daskdag.grads(dag, X, "L").__dask_graph__())
        j = next(k for k in tasks if key_kind(k) == "val" and key_label(k) == "J")
        assert dask.get(tasks, j).devices() == {jax.devices()[0]}  # a jit node: the default
    assert dict(sink) == {"A": [3], "P": [1], "L": [3]}
    np.testing.assert_allclose(
        res.grad, jax.grad(lambda x: jnp.sum(jnp.tanh((jnp.sin(x) * 2) ** 2)))(X), rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu:9", "tpu"])
def test_a_device_this_process_lacks_is_refused_before_anything_runs(device):
    ran = []
    dag = {"A": (lambda x: ran.append(1) or jnp.sin(x), ["x"]),
           "B": Node(jnp.cos, ["A"], device=device), "L": (jnp.sum, ["B"])}
    with pytest.raises(daskdag.DAGError, match=r"node 'B': device '(cpu:9|tpu:0)' is not one of "
                                               r"this process's devices \(cpu:0, cpu:1, cpu:2, "
                                               r"cpu:3\)"):
        daskdag.compute_grads(dag, X, "L")
    with pytest.raises(daskdag.DAGError, match="node 'B'"):
        daskdag.value_and_grad(dag, "L")(X)
    assert not ran


@pytest.mark.parametrize("device", ["cpu:x", "CPU", 3, ""])
def test_a_malformed_device_is_refused(device):
    with pytest.raises(daskdag.DAGError, match="node 'A': device must be a jax.Device, a "
                                               "platform"):
        daskdag.compute_grads({"A": Node(jnp.sin, ["x"], device=device),
                               "L": (jnp.sum, ["A"])}, X, "L")


def test_gpu_and_tpu_ask_for_their_worker_resource():
    assert Node(jnp.sin, ["x"], device="gpu").needs == {"GPU": 1}
    assert Node(jnp.sin, ["x"], device="gpu:1").needs == {"GPU": 1}
    assert Node(jnp.sin, ["x"], device="tpu", resources={"BIG": 2}).needs == {"TPU": 1, "BIG": 2}
    assert Node(jnp.sin, ["x"], device="cpu:1").needs == {}
    assert Node(jnp.sin, ["x"], device=jax.devices()[2]).needs == {}


def test_implicit_nodes_take_a_device():
    sink: list = []
    dag = {"u": daskdag.Implicit(lambda u, a: u ** 3 - a, ["a"], guess=jnp.ones(3),
                                 device="cpu:2"),
           "L": Node(lambda u: sink.append(sorted(d.id for d in jnp.zeros(()).devices()))
                     or jnp.sum(u), ["u"], device="cpu:1")}
    a = jnp.array([1.0, 8.0, 27.0])
    res = daskdag.compute_grads(dag, a, "L")
    np.testing.assert_allclose(res.grad, 1 / (3 * jnp.cbrt(a) ** 2), rtol=1e-4)
    assert sink and all(s == [1] for s in sink)


# -- a cluster ----------------------------------------------------------------------------------

@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind, form", list(CASES))
def test_every_kind_and_form_on_a_cluster(client, kind, form):
    topic = f"placement-{uuid.uuid4().hex}"
    got = CASES[kind, form](placed_dag(topic, []), client)
    np.testing.assert_allclose(got, JAX[kind](), rtol=2e-5, atol=1e-6)
    check_records([msg for _, msg in client.get_events(topic)], kind)


@pytest.mark.timeout(120)
def test_a_device_no_worker_has_is_refused_on_a_cluster(client):
    dag = {"A": (jnp.sin, ["x"]), "B": Node(jnp.cos, ["A"], device="cpu:9"),
           "L": (jnp.sum, ["B"])}
    with pytest.raises(daskdag.ClusterError, match=r"node 'B': no worker that could run it has "
                                                   r"device 'cpu:9' \(their devices: .*cpu:0, "
                                                   r"cpu:1, cpu:2, cpu:3"):
        daskdag.compute_grads(dag, X, "L", client=client)
    with dask.config.set({"daskdag.worker-wait": "0.5s"}), \
            pytest.raises(daskdag.ClusterError, match=r"node 'B' needs resources \{'TPU': 1\}"):
        daskdag.compute_grads({**dag, "B": Node(jnp.cos, ["A"], device="tpu")}, X, "L",
                              client=client)


def test_nodes_without_a_device_take_jax_s_default_device():
    sink: list = []
    dag = {"A": Node(jnp.sin, ["x"], device="cpu:1"),
           "L": (lambda a: sink.append(sorted(d.id for d in jnp.zeros(()).devices()))
                 or jnp.sum(a), ["A"])}
    jax.config.update("jax_default_device", jax.devices()[2])
    try:
        res = daskdag.compute_grads(dag, X, "L")
    finally:
        jax.config.update("jax_default_device", None)
    assert sink == [[2]]
    np.testing.assert_allclose(res.grad, jnp.cos(X), rtol=1e-6)
