"""Values and gradients against jax.value_and_grad / jax.vjp of the composed function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import Node
from .support.numbers import assert_tree_close


def test_seed_dag(seed, x5):
    dag, _, composed = seed
    res = daskdag.compute_grads(dag, x5, ["D", "E"])
    assert set(res) == {"D", "E"}
    for o in "DE":
        value, grad = jax.value_and_grad(composed[o])(x5)
        assert_tree_close(res[o].value, value)
        assert_tree_close(res[o].grad, grad)


def test_single_output_name_returns_one_result(seed, x5):
    dag, _, composed = seed
    r = daskdag.compute_grads(dag, x5, "E")
    assert isinstance(r, daskdag.Result)
    assert_tree_close(r.grad, jax.grad(composed["E"])(x5))


def test_diamond_fan_out_and_fan_in():
    # x -> A -> (B, C) -> D: A's cotangent sums two shares; D also reads x directly.
    dag = {"A": (lambda x: jnp.tanh(x) * 3, ["x"]),
           "B": (lambda a: a ** 2, ["A"]),
           "C": (lambda a: jnp.cos(a), ["A"]),
           "D": (lambda b, c, x: jnp.sum(b * c + x), ["B", "C", "x"])}

    def composed(x):
        a = jnp.tanh(x) * 3
        return jnp.sum(a ** 2 * jnp.cos(a) + x)

    x = jnp.linspace(-1.0, 1.0, 7)
    r = daskdag.compute_grads(dag, x, "D")
    assert_tree_close(r.value, composed(x))
    assert_tree_close(r.grad, jax.grad(composed)(x))


def test_node_using_one_dep_twice():
    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a1, a2: jnp.sum(a1 * a2), ["A", "A"])}
    x = jnp.arange(3.0)
    r = daskdag.compute_grads(dag, x, "B")
    assert_tree_close(r.grad, jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(x))


def test_several_free_inputs_at_several_depths():
    dag = {"A": (lambda x, w: jnp.tanh(w @ x), ["x", "w"]),
           "B": (lambda a, b: a * b, ["A", "b"]),
           "C": (lambda bb, w: jnp.sum(w @ bb), ["B", "w"]),
           "E": (lambda a, s: jnp.sum(a) * s, ["A", "s"])}

    def C(x, w, b, s):
        return jnp.sum(w @ (jnp.tanh(w @ x) * b))

    def E(x, w, b, s):
        return jnp.sum(jnp.tanh(w @ x)) * s

    k = jax.random.split(jax.random.key(0), 3)
    inputs = {"x": jax.random.normal(k[0], (4,)), "w": jax.random.normal(k[1], (4, 4)),
              "b": jax.random.normal(k[2], (4,)), "s": jnp.float32(1.5)}
    res = daskdag.compute_grads(dag, inputs, ["C", "E"])
    for o, f in {"C": C, "E": E}.items():
        value, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(*inputs.values())
        assert_tree_close(res[o].value, value)
        assert set(res[o].grad) == set(inputs)
        for name, g in zip(inputs, grads):
            assert_tree_close(res[o].grad[name], g)  # zeros where o does not use the input


def test_wrt_selects_inputs():
    dag = {"y": (lambda x, w: jnp.sum(w * x ** 2), ["x", "w"])}
    inputs = {"x": jnp.arange(3.0), "w": jnp.ones(3) * 2}
    r = daskdag.compute_grads(dag, inputs, "y", wrt=["w"])
    assert list(r.grad) == ["w"]
    assert_tree_close(r.grad["w"], inputs["x"] ** 2)


def test_integer_input_is_not_differentiated():
    dag = {"g": (lambda x, idx: x[idx], ["x", "idx"]), "y": (lambda g: jnp.sum(g ** 2), ["g"])}
    inputs = {"x": jnp.arange(5.0), "idx": jnp.array([0, 2, 2])}
    r = daskdag.compute_grads(dag, inputs, "y")
    assert list(r.grad) == ["x"]
    assert_tree_close(r.grad["x"], jax.grad(lambda x: jnp.sum(x[inputs["idx"]] ** 2))(inputs["x"]))


def test_pytree_inputs_and_outputs():
    def enc(p):
        return {"h": jnp.tanh(p["w"] @ p["v"]), "aux": (p["v"] * 2, jnp.sum(p["w"]))}

    def dec(z):
        return jnp.sum(z["h"] ** 2) + z["aux"][1] * jnp.sum(z["aux"][0])

    dag = {"Z": (enc, ["p"]), "L": (dec, ["Z"])}
    p = {"w": jnp.arange(6.0).reshape(2, 3) / 10, "v": jnp.array([1.0, -1.0, 0.5])}
    r = daskdag.compute_grads(dag, p, "L")
    value, grad = jax.value_and_grad(lambda p: dec(enc(p)))(p)
    assert_tree_close(r.value, value)
    assert_tree_close(r.grad, grad)  # a dict shaped like p


def test_pytree_output_with_cotangent():
    def enc(x):
        return (jnp.sin(x), {"s": jnp.sum(x ** 3)})

    dag = {"Z": (enc, ["x"])}
    x = jnp.arange(4.0)
    ct = (jnp.ones(4) * 0.5, {"s": jnp.float32(2.0)})
    r = daskdag.compute_grads(dag, x, "Z", cotangents={"Z": ct})
    value, vjp = jax.vjp(enc, x)
    assert_tree_close(r.value, value)
    assert_tree_close(r.grad, vjp(ct)[0])


def test_tuple_and_empty_tuple_inputs():
    dag = {"y": (lambda t: jnp.sum(t[0] * t[1]), ["t"])}
    t = (jnp.arange(3.0), jnp.ones(3) * 2)
    assert_tree_close(daskdag.compute_grads(dag, t, "y").grad, jax.grad(dag["y"][0])(t))

    const = {"c": (lambda t: jnp.float32(3.0), ["t"])}
    r = daskdag.compute_grads(const, (), "c")
    assert r.value == 3.0 and r.grad == ()


def test_python_control_flow_on_values():
    def branchy(a):
        if jnp.sum(a) > 0:  # a concrete value decides the branch
            return jnp.sum(a ** 3)
        for _ in range(int(a.shape[0])):
            a = jnp.sin(a)
        return jnp.sum(a)

    dag = {"A": (lambda x: x * 2, ["x"]), "B": (branchy, ["A"])}
    for x in (jnp.array([1.0, 2.0]), jnp.array([-1.0, -2.0])):
        r = daskdag.compute_grads(dag, x, "B")
        value, grad = jax.value_and_grad(lambda x: branchy(x * 2))(x)
        assert_tree_close(r.value, value)
        assert_tree_close(r.grad, grad)


def test_side_effects_run_eagerly(capsys):
    def loud(x):
        print(f"loud sees {type(x).__name__}")
        return jnp.sum(x ** 2)

    daskdag.compute_grads({"y": (loud, ["x"])}, jnp.ones(2), "y")
    assert capsys.readouterr().out.count("loud sees") == 1


def test_chain_of_60_nodes():
    n = 60
    dag = {"n0": (lambda x: jnp.sin(x), ["x"])}
    for i in range(1, n):
        dag[f"n{i}"] = (lambda a, i=i: jnp.sin(a) * (1 + 0.01 * i), [f"n{i - 1}"])
    dag["out"] = (lambda a: jnp.sum(a ** 2), [f"n{n - 1}"])

    def composed(x):
        a = jnp.sin(x)
        for i in range(1, n):
            a = jnp.sin(a) * (1 + 0.01 * i)
        return jnp.sum(a ** 2)

    x = jnp.linspace(0.1, 1.0, 8)
    r = daskdag.compute_grads(dag, x, "out")
    assert_tree_close(r.value, composed(x))
    assert_tree_close(r.grad, jax.grad(composed)(x), rtol=1e-4)


def test_non_scalar_outputs_with_cotangents(seed, x5):
    dag, _, _ = seed
    g = {"x_to_A": lambda x: jnp.sin(x) * 2.0, "A_to_B": lambda A: A ** 2 + 1.0,
         "B_to_C": lambda B: jnp.cumsum(B) / 3.0}
    ct_b, ct_c = jnp.arange(5.0), jnp.linspace(-1, 1, 5)
    res = daskdag.compute_grads(dag, x5, ["B", "C", "D"], cotangents={"B": ct_b, "C": ct_c})
    B = lambda x: g["A_to_B"](g["x_to_A"](x))
    C = lambda x: g["B_to_C"](B(x))
    for o, f, ct in (("B", B, ct_b), ("C", C, ct_c)):
        value, vjp = jax.vjp(f, x5)
        assert_tree_close(res[o].value, value)
        assert_tree_close(res[o].grad, vjp(ct)[0])


def test_jit_nodes_match_eager():
    dag = {"A": Node(lambda x: jnp.tanh(x) @ jnp.ones((3, 3)), ["x"], jit=True),
           "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    x = jnp.arange(3.0) / 3
    r = daskdag.compute_grads(dag, x, "B")
    assert_tree_close(r.grad, jax.grad(lambda x: jnp.sum((jnp.tanh(x) @ jnp.ones((3, 3))) ** 2))(x))


def test_output_that_does_not_depend_on_x():
    dag = {"A": (jnp.sin, ["x"]), "K": (lambda c: c * 2.0, ["c"])}
    inputs = {"x": jnp.ones(3), "c": jnp.float32(4.0)}
    r = daskdag.compute_grads(dag, inputs, ["A", "K"], wrt=["x"], cotangents={"A": jnp.ones(3)})
    assert float(r["K"].value) == 8.0
    np.testing.assert_array_equal(r["K"].grad["x"], np.zeros(3))
    assert_tree_close(r["A"].grad["x"], jnp.cos(inputs["x"]))


def test_numpy_and_python_scalar_inputs():
    dag = {"y": (lambda x, s: jnp.sum(x) * s ** 2, ["x", "s"])}
    r = daskdag.compute_grads(dag, {"x": np.arange(3, dtype=np.float32), "s": 2.0}, "y")
    assert float(r.grad["s"]) == pytest.approx(12.0)
    assert_tree_close(r.grad["x"], np.full(3, 4.0))
