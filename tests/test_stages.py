"""Stages: chains of eager nodes run as one task, connected jittable nodes as one XLA program;
results as jax.grad / jax.vjp of the composed function, each node's function called once."""

import jax
import jax.numpy as jnp
import dask
import pytest

import daskdag
from daskdag import Node
from daskdag.api import build_graph

from .conftest import assert_tree_close


def _fwd_stages(graph):
    keys = map(str, dict(dask.delayed(graph).__dask_graph__()))
    return sorted(k.split("-")[1] for k in keys if k.startswith("fwd-"))


def _jit_dag(traces):
    """x -> A -> B -> {C, D}, C -> E; every node jit=True; E and C requested."""
    def node(name, f):
        def fn(*a):
            traces.append(name)  # runs when traced
            return f(*a)
        return fn

    return {"A": Node(node("A", jnp.sin), ["x"], jit=True),
            "B": Node(node("B", lambda a, x: a * x), ["A", "x"], jit=True),
            "C": Node(node("C", jnp.tanh), ["B"], jit=True),
            "D": Node(node("D", lambda b: jnp.sum(b ** 2)), ["B"], jit=True),
            "E": Node(node("E", lambda c, d: jnp.sum(c) * d), ["C", "D"], jit=True)}


def _composed(x):
    b = jnp.sin(x) * x
    c = jnp.tanh(b)
    return c, jnp.sum(c) * jnp.sum(b ** 2)


def test_jittable_nodes_fuse_into_one_program_with_several_exposed_values():
    traces = []
    dag = _jit_dag(traces)
    x = jnp.linspace(-1.0, 1.0, 5)
    _, _, graph = build_graph(dag, x, ["E", "C"], cotangents={"C": jnp.ones(5)})
    assert _fwd_stages(graph) == ["A+3more+E"]  # C is requested: exposed from inside the stage
    for _ in range(2):  # the second call compiles nothing: one trace of each node in all
        res = daskdag.compute_grads(dag, x, ["E", "C"], cotangents={"C": jnp.ones(5)})
        assert_tree_close(res["E"].value, _composed(x)[1])
        assert_tree_close(res["E"].grad, jax.grad(lambda x: _composed(x)[1])(x))
        assert_tree_close(res["C"].value, _composed(x)[0])
        assert_tree_close(res["C"].grad, jax.grad(lambda x: jnp.sum(_composed(x)[0]))(x))
    assert sorted(traces) == ["A", "B", "C", "D", "E"]


def test_an_eager_node_splits_a_jittable_group():
    dag = _jit_dag([])
    dag["C"] = Node(jnp.tanh, ["B"])  # eager: runs op by op, in a stage of its own
    x = jnp.linspace(-1.0, 1.0, 5)
    _, _, graph = build_graph(dag, x, ["E"])
    assert _fwd_stages(graph) == ["A+B+D", "C", "E"]
    res = daskdag.compute_grads(dag, x, "E")
    assert_tree_close(res.grad, jax.grad(lambda x: _composed(x)[1])(x))


def test_fusion_off_runs_node_by_node():
    with dask.config.set({"daskdag.fuse-chains": False}):
        _, _, graph = build_graph(_jit_dag([]), jnp.ones(3), ["E"])
    assert _fwd_stages(graph) == ["A", "B", "C", "D", "E"]


def test_a_failing_node_in_a_fused_stage_is_named():
    dag = _jit_dag([])
    dag["D"] = Node(lambda b: float(jnp.sum(b)), ["B"], jit=True)  # concrete value under jit
    with pytest.raises(daskdag.NodeError, match="node 'D' failed in its forward pass"):
        daskdag.compute_grads(dag, jnp.ones(3), "E")


def test_fused_vmap_nodes_in_a_sweep_match_vmapped_value_and_grad():
    w = jnp.eye(3) * 0.5
    dag = {"H": Node(lambda x, w: jnp.tanh(x @ w), ["x", "w"], vmap=True),
           "G": Node(lambda h: h * 2.0, ["H"], vmap=True),
           "L": Node(lambda h, g: jnp.sum(h * g), ["H", "G"], vmap=True),
           "M": Node(lambda g: jnp.mean(g), ["G"], vmap=True)}
    xs = jnp.linspace(-1.0, 1.0, 24).reshape(8, 3)
    res = daskdag.sweep_grads(dag, {"x": xs, "w": w}, ["L", "M"], batched=["x"], chunk_size=3)

    def composed(x):
        h = jnp.tanh(x @ w)
        return jnp.sum(h * h * 2.0), jnp.mean(h * 2.0)

    for k, o in enumerate(["L", "M"]):
        value, grad = jax.vmap(jax.value_and_grad(lambda x: composed(x)[k]))(xs)
        assert_tree_close(res[o].value, value, rtol=1e-5)
        assert_tree_close(res[o].grad["x"], grad, rtol=1e-5)


def test_a_group_never_joins_one_that_comes_after_it():
    """B's group takes A's value only after P has taken B's: N (after P) must not join A's."""
    dag = {"A": Node(jnp.sin, ["x"], jit=True),
           "B": Node(jnp.cos, ["x"], jit=True),
           "P": (lambda b: b * 2.0, ["B"]),  # eager
           "C": Node(lambda b, a: b * a, ["B", "A"], jit=True),
           "N": Node(lambda a, p: a + p, ["A", "P"], jit=True),
           "L": Node(lambda c, n: jnp.sum(c * n), ["C", "N"], jit=True)}
    x = jnp.linspace(-1.0, 1.0, 4)
    _, _, graph = build_graph(dag, x, "L")
    assert _fwd_stages(graph) == ["A", "B+C", "N+L", "P"]

    def composed(x):
        a, b = jnp.sin(x), jnp.cos(x)
        return jnp.sum(b * a * (a + b * 2.0))

    res = daskdag.compute_grads(dag, x, "L")
    assert_tree_close(res.grad, jax.grad(composed)(x))
