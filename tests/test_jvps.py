"""Forward mode: values and Jacobian-vector products against jax.jvp / jax.jacfwd of the composed
function."""

import dask
import jax
import jax.numpy as jnp
import pytest

import daskdag
from daskdag import DAGError, JVPResult, Node, NodeError

from .support.clusters import local_client
from .support.numbers import Counted, TraceLog, assert_tree_close

V5 = jnp.array([0.3, -1.0, 0.5, 2.0, 0.1], dtype=jnp.float32)


def test_seed_dag_matches_jax_jvp_each_node_once(seed, x5):
    dag, f, composed = seed
    res = daskdag.compute_jvps(dag, x5, V5, ["D", "E", "B"])
    assert set(res) == {"D", "E", "B"} and all(isinstance(r, JVPResult) for r in res.values())
    for o in "DE":
        value, tangent = jax.jvp(composed[o], (x5,), (V5,))
        assert_tree_close(res[o].value, value)
        assert_tree_close(res[o].tangent, tangent)
    value, tangent = jax.jvp(lambda x: f["A_to_B"].fn(f["x_to_A"].fn(x)), (x5,), (V5,))
    assert_tree_close(res["B"].tangent, tangent)
    assert all(fn.calls == 1 for fn in f.values()), {k: fn.calls for k, fn in f.items()}
    single = daskdag.compute_jvps(dag, x5, V5, "E")
    assert isinstance(single, JVPResult)
    assert_tree_close(single.tangent, jax.jvp(composed["E"], (x5,), (V5,))[1])


def test_batched_identity_basis_is_jacfwd(seed, x5):
    dag, f, composed = seed
    res = daskdag.compute_jvps(dag, x5, jnp.eye(5), ["D", "E", "C"], batched=True)
    for o in "DE":
        assert_tree_close(res[o].tangent, jax.jacfwd(composed[o])(x5), rtol=1e-5, atol=1e-5)
    c = lambda x: f["B_to_C"].fn(f["A_to_B"].fn(f["x_to_A"].fn(x)))
    assert res["C"].tangent.shape == (5, 5)  # (directions, *C's shape)
    assert_tree_close(res["C"].tangent, jax.jacfwd(c)(x5).T, rtol=1e-5, atol=1e-5)
    assert all(fn.calls == 1 for fn in f.values())
    two = daskdag.compute_jvps(dag, x5, jnp.stack([V5, -2 * V5]), "E", batched=True)
    one = jax.jvp(composed["E"], (x5,), (V5,))[1]
    assert_tree_close(two.tangent, jnp.stack([one, -2 * one]), rtol=1e-5)


def test_several_inputs_tangent_for_one():
    c = Counted(lambda w: jnp.sum(w ** 2))
    dag = {"A": (lambda x, w: jnp.tanh(w @ x), ["x", "w"]),
           "B": (lambda a, s: jnp.sum(a) * s, ["A", "s"]),
           "C": (c, ["w"])}
    k = jax.random.split(jax.random.key(0), 3)
    x, w, s = jax.random.normal(k[0], (4,)), jax.random.normal(k[1], (3, 4)), jnp.float32(1.5)
    dw = jax.random.normal(k[2], (3, 4))
    res = daskdag.compute_jvps(dag, {"x": x, "w": w, "s": s}, {"w": dw}, ["A", "B", "C"])
    fx = lambda w: {"A": jnp.tanh(w @ x), "B": jnp.sum(jnp.tanh(w @ x)) * s, "C": jnp.sum(w ** 2)}
    values, tangents = jax.jvp(fx, (w,), (dw,))
    for o in "ABC":
        assert_tree_close(res[o].value, values[o])
        assert_tree_close(res[o].tangent, tangents[o], rtol=1e-5, atol=1e-5)
    # tangent for x only: C, which does not use x, gets zeros
    dx = jnp.ones(4)
    res = daskdag.compute_jvps(dag, {"x": x, "w": w, "s": s}, {"x": dx}, ["B", "C"])
    assert_tree_close(res["B"].tangent, jax.jvp(lambda x: jnp.sum(jnp.tanh(w @ x)) * s, (x,), (dx,))[1])
    assert_tree_close(res["C"].tangent, jnp.float32(0.0))
    # C, which no tangent reaches, runs as in the gradient graph, under the same key: computed
    # together, the two calls run it once
    inputs = {"x": x, "w": w, "s": s}
    jvps = daskdag.jvps(dag, inputs, {"x": dx}, ["B", "C"])
    grads = daskdag.grads(dag, inputs, ["B", "C"], wrt=["x"], cotangents={"B": 1.0, "C": 1.0})
    c.calls = 0
    tangents, gradients = dask.compute(jvps, grads)
    assert c.calls == 1
    assert_tree_close(tangents["C"].value, gradients["C"].value)


def test_pytree_input_with_int_leaf_held_constant():
    def f(p):
        return {"y": jnp.sin(p["a"]) * p["n"] + jnp.sum(p["b"]), "n": p["n"] + 1}

    dag = {"P": (f, ["p"]), "Q": (lambda q: jnp.sum(q["y"] ** 2), ["P"])}
    p = {"a": jnp.arange(3.0), "b": jnp.ones((2, 2)), "n": 3}
    t = {"a": jnp.array([1.0, 0.5, -1.0]), "b": None, "n": None}  # b: zero tangent
    res = daskdag.compute_jvps(dag, p, t, ["P", "Q"])
    t0 = {"a": t["a"], "b": jnp.zeros((2, 2))}
    g = lambda ab: f({**ab, "n": 3})
    value, tangent = jax.jvp(g, ({"a": p["a"], "b": p["b"]},), (t0,))
    assert_tree_close(res["P"].value["y"], value["y"])
    assert res["P"].tangent["n"] is None  # an int output leaf: held constant
    assert_tree_close(res["P"].tangent["y"], tangent["y"])
    q = jax.jvp(lambda ab: jnp.sum(g(ab)["y"] ** 2), ({"a": p["a"], "b": p["b"]},), (t0,))[1]
    assert_tree_close(res["Q"].tangent, q, rtol=1e-5)


@pytest.mark.parametrize("x, tangents, batched, match", [
    (jnp.ones(3), jnp.ones(4), False, r"input 'x' has shape \(4,\), but the input has shape \(3,\)"),
    (jnp.ones(3), jnp.ones(3), True, r"input 'x' has shape \(3,\), but the input has shape \(3,\) "
                                      r"\(with batched=True"),
    (jnp.ones(3), jnp.ones(3, jnp.int32), False, r"input 'x' .* must be floating-point"),
    (jnp.ones(3), {"a": jnp.ones(3)}, False, r"tangent for input 'x' is .*but the input is"),
    ({"a": jnp.ones(3), "n": 2}, {"a": jnp.ones(2), "n": None}, False,
     r"input 'x' at \['a'\] has shape \(2,\), but the input has shape \(3,\)"),
    ({"a": jnp.ones(3), "n": 2}, {"a": jnp.ones(3), "n": 1}, False, r"input 'x' at \['n'\].*held constant"),
])
def test_bad_tangents_name_the_input(x, tangents, batched, match):
    dag = {"A": (lambda x: x, ["x"])}
    with pytest.raises(DAGError, match=match):
        daskdag.compute_jvps(dag, x, tangents, "A", batched=batched)


def test_tangent_for_an_unknown_input_is_named():
    dag = {"A": (lambda x, w: x * w, ["x", "w"])}
    with pytest.raises(DAGError, match=r"tangent for 'y', which is not a free input"):
        daskdag.compute_jvps(dag, {"x": 1.0, "w": 2.0}, {"y": 1.0}, "A")
    with pytest.raises(DAGError, match=r"pass tangents as a dict"):
        daskdag.compute_jvps(dag, {"x": 1.0, "w": 2.0}, 1.0, "A")


def test_failing_node_is_named():
    def boom(a):
        raise ValueError("boom")

    dag = {"A": (jnp.sin, ["x"]), "B": (boom, ["A"]), "C": (jnp.cos, ["B"])}
    with pytest.raises(NodeError, match=r"node 'B' failed in its forward pass: ValueError: boom") as e:
        daskdag.compute_jvps(dag, jnp.ones(3), jnp.ones(3), "C")
    assert e.value.node == "B"
    dag = {"A": Node(jnp.sin, ["x"], jit=True), "B": Node(boom, ["A"], jit=True)}  # fused
    with pytest.raises(NodeError, match=r"node 'B'"):
        daskdag.compute_jvps(dag, jnp.ones(3), jnp.ones(3), "B", batched=False)


def _cluster_dag():
    return {"A": (lambda x: jnp.sin(x) * 2.0, ["x"]),
            "B": (lambda a: a ** 2 + 1.0, ["A"]),
            "C": Node(lambda b: jnp.cumsum(b) / 3.0, ["B"], jit=True),
            "D": Node(lambda c: jnp.sum(jnp.log(c)), ["C"], jit=True),
            "E": (lambda b, w: jnp.sum(jnp.sqrt(b) * w), ["B", "w"])}


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_on_a_process_cluster():
    x, w = jnp.arange(1.0, 6.0), jnp.linspace(0.0, 1.0, 5)

    def composed(x):
        b = (jnp.sin(x) * 2.0) ** 2 + 1.0
        return {"D": jnp.sum(jnp.log(jnp.cumsum(b) / 3.0)), "E": jnp.sum(jnp.sqrt(b) * w)}

    with local_client() as client:
        res = daskdag.compute_jvps(_cluster_dag(), {"x": x, "w": w}, {"x": V5}, ["D", "E"],
                                   client=client)
        values, tangents = jax.jvp(composed, (x,), (V5,))
        for o in "DE":
            assert_tree_close(res[o].value, values[o])
            assert_tree_close(res[o].tangent, tangents[o], rtol=1e-5)
        res = daskdag.compute_jvps(_cluster_dag(), {"x": x, "w": w}, {"x": jnp.eye(5)}, ["D", "E"],
                                   batched=True, client=client)
        jac = jax.jacfwd(composed)(x)
        for o in "DE":
            assert_tree_close(res[o].tangent, jac[o], rtol=1e-5, atol=1e-6)


def test_fused_stage_compiles_once_across_calls():
    traces = TraceLog()

    def a(x):
        traces.append("A")
        return jnp.sin(x)

    def b(y):
        traces.append("B")
        return y * 2.0

    dag = {"A": Node(a, ["x"], jit=True), "B": Node(b, ["A"], jit=True)}
    for i in range(3):
        x = jnp.arange(3.0) + i
        r = daskdag.compute_jvps(dag, x, jnp.ones(3), "B")
        assert_tree_close(r.tangent, 2.0 * jnp.cos(x))
    assert traces == ["A", "B"]
    for i in range(2):  # batched: one more program, the nodes' jitted functions traced already
        r = daskdag.compute_jvps(dag, jnp.arange(3.0) + i, jnp.eye(3), "B", batched=True)
        assert_tree_close(r.tangent, jnp.diag(2.0 * jnp.cos(jnp.arange(3.0) + i)))
    assert traces == ["A", "B"]
