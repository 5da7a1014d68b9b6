"""vmap=True nodes in sweeps: one compiled program per node function and shapes, results as
jax.vmap(jax.value_and_grad(...)) of the composed function. (How their chunks' pullbacks travel,
and how many items a chunk holds: test_internal_pullbacks.py, test_internal_sweep_datapath.py.)"""

import gc
import weakref

import jax
import jax.numpy as jnp

import daskdag
from daskdag import Node

from .support.numbers import TraceLog, assert_tree_close


def encode(p, w):  # a pytree input: p = {"x": float[4], "k": int[]}, w shared
    return {"h": jnp.tanh(w @ p["x"]) * p["k"], "k": p["k"]}


def energy(e, b):
    return jnp.sum(e["h"] ** 2) + jnp.dot(b, e["h"]) + e["k"]


def inputs(n=10, d=4, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {"p": {"x": jax.random.normal(k[0], (n, d)), "k": jnp.arange(n) % 3 + 1},
            "b": jax.random.normal(k[1], (n, d)), "w": jax.random.normal(k[2], (d, d)) / 2}


def test_matches_vmapped_value_and_grad_with_pytrees_and_a_shared_input():
    dag = {"E": Node(encode, ["p", "w"], vmap=True), "L": Node(energy, ["E", "b"], vmap=True)}
    xs = inputs()
    res = daskdag.sweep_grads(dag, xs, "L", batched=["p", "b"], wrt=["p", "b", "w"], chunk_size=4)

    def composed(x, b, w, k):
        return energy(encode({"x": x, "k": k}, w), b)

    value, (gx, gb, gw) = jax.vmap(jax.value_and_grad(composed, (0, 1, 2)), (0, 0, None, 0))(
        xs["p"]["x"], xs["b"], xs["w"], xs["p"]["k"])
    assert_tree_close(res.value, value, rtol=1e-5)
    assert_tree_close(res.grad["p"]["x"], gx, rtol=1e-5)
    assert res.grad["p"]["k"] is None  # an integer leaf: held constant
    assert_tree_close(res.grad["b"], gb, rtol=1e-5)
    assert res.grad["w"].shape == (10, 4, 4)  # the shared input, per item
    assert_tree_close(res.grad["w"], gw, rtol=1e-5)


def test_non_array_leaves_of_a_shared_input_stay_concrete():
    def act(h, opts):  # a Python int and a function, as a model's static fields
        assert isinstance(opts["power"], int)
        return jnp.sum(opts["fn"](h) ** opts["power"])

    dag = {"A": Node(act, ["x", "opts"], vmap=True)}
    xs = {"x": jnp.linspace(-1.0, 1.0, 12).reshape(6, 2), "opts": {"power": 3, "fn": jnp.sin}}
    res = daskdag.sweep_grads(dag, xs, "A", batched=["x"], chunk_size=4)
    value, grad = jax.vmap(jax.value_and_grad(lambda x: jnp.sum(jnp.sin(x) ** 3)))(xs["x"])
    assert_tree_close(res.value, value, rtol=1e-5)
    assert_tree_close(res.grad["x"], grad, rtol=1e-5)


def test_a_node_function_is_traced_once_per_shapes_across_chunks_and_sweeps():
    traces = TraceLog()

    def layer(x, w):  # the Python body runs only when JAX traces it
        traces.append(x.shape)
        return jnp.tanh(x @ w)

    w = jnp.eye(3) * 0.5
    loss = lambda h: jnp.sum(h ** 2)
    f = jax.vmap(jax.value_and_grad(lambda x: loss(jnp.tanh(x @ w))))
    xs = jnp.linspace(0.0, 1.0, 36).reshape(12, 3)
    for n, chunk_size in [(4, 4), (12, 4), (12, 4), (8, 4)]:  # chunks of 4 items each time
        dag = {"H": Node(layer, ["x", "w"], vmap=True), "L": Node(loss, ["H"], vmap=True)}
        res = daskdag.sweep_grads(dag, {"x": xs[:n], "w": w}, "L", batched=["x"],
                                  chunk_size=chunk_size)
        value, grad = f(xs[:n])
        assert_tree_close(res.value, value, rtol=1e-5)
        assert_tree_close(res.grad["x"], grad, rtol=1e-5)
    # One trace for 8 chunks of 4 in four sweeps (the first sweep has one chunk: chunks that
    # start together may each trace a program new to them).
    assert len(traces) == 1
    daskdag.sweep_grads(dag, {"x": xs[:5], "w": w}, "L", batched=["x"], chunk_size=5)
    assert len(traces) == 2  # new shapes: one more


def test_no_gradient_path_is_compiled_too():
    traces = TraceLog()

    def scale(x, b):
        traces.append(1)
        return x * jnp.sum(b)

    dag = {"S": Node(scale, ["x", "b"], vmap=True), "L": (lambda s: jnp.sum(s), ["S"])}
    xs = inputs(n=8)
    for n in (2, 8, 8):  # b is not differentiated: S runs without vjp, in chunks of 2
        res = daskdag.sweep_grads(dag, {"x": xs["p"]["x"][:n], "b": xs["b"][:n]}, "L",
                                  batched=["x", "b"], wrt=["x"], chunk_size=2)
        assert_tree_close(res.grad["x"], jnp.broadcast_to(jnp.sum(xs["b"][:n], 1)[:, None], (n, 4)),
                          rtol=1e-5)
    assert len(traces) == 1


def test_compiled_programs_do_not_keep_the_node_function_alive():
    def make():
        big = jnp.ones((3, 3))
        return lambda x: jnp.sum(jnp.tanh(x @ big))

    fn = make()
    daskdag.sweep_grads({"L": Node(fn, ["x"], vmap=True)}, jnp.ones((4, 3)), "L", chunk_size=2)
    ref = weakref.ref(fn)
    del fn
    gc.collect()
    assert ref() is None
