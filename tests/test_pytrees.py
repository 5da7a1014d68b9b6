"""Leaf-level differentiation of any pytree input (equinox's filter_vjp rule): floating-point
array leaves are differentiated, every other leaf is held constant and gets ``None``; real
libraries' pytrees (equinox modules, flax variable dicts, optax losses), on threads and on a
cluster, with pullbacks moved between workers; and every call's results as JAX pytrees
(``jax.block_until_ready``, ``jax.tree.map``, ``jax.device_get`` reach their arrays)."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import daskdag

from .support.clusters import compute_split, live_workers
from .support.numbers import assert_tree_close


def test_float_leaves_differentiated_int_leaves_held():
    params = {"w": jnp.array([1.0, -2.0, 0.5]), "i": jnp.array(2), "scale": 3.0, "on": True}
    dag = {"y": (lambda p: jnp.where(p["on"], p["w"][p["i"]] * p["scale"] + jnp.sum(p["w"] ** 2), 0.0),
                 ["p"])}
    r = daskdag.compute_grads(dag, params, "y")
    ref = jax.grad(lambda w, s: dag["y"][0]({**params, "w": w, "scale": s}), (0, 1))(
        params["w"], params["scale"])
    assert r.grad["i"] is None and r.grad["on"] is None  # held constant
    assert_tree_close(r.grad["w"], ref[0])
    assert_tree_close(r.grad["scale"], ref[1])


def test_node_outputs_with_non_float_leaves():
    """A node may return ints and functions beside its arrays; only its float leaves carry a
    cotangent, and downstream nodes get the whole value."""
    dag = {"A": (lambda x: {"h": jnp.tanh(x), "n": jnp.argmax(x), "act": jnp.sin}, ["x"]),
           "B": (lambda a: jnp.sum(a["act"](a["h"])) * a["n"], ["A"])}
    x = jnp.array([0.1, 0.7, -0.3])
    r = daskdag.compute_grads(dag, x, "B")
    f = lambda x: jnp.sum(jnp.sin(jnp.tanh(x))) * jnp.argmax(x)
    assert_tree_close(r.value, f(x))
    assert_tree_close(r.grad, jax.grad(f)(x))


def _mlp():
    return eqx.nn.MLP(3, 2, width_size=8, depth=2, key=jax.random.key(0))


def _mlp_dag():
    return {"Y": (lambda model, x: jax.vmap(model)(x), ["model", "x"]),
            "L": (lambda y: jnp.mean(y ** 2), ["Y"])}


@pytest.mark.parametrize("where", ["threads", pytest.param("cluster", marks=pytest.mark.cluster)])
@pytest.mark.timeout(180)
def test_equinox_mlp_as_input(where, request):
    client = request.getfixturevalue("cli_client") if where == "cluster" else None
    model, x = _mlp(), jax.random.normal(jax.random.key(1), (5, 3))
    r = daskdag.compute_grads(_mlp_dag(), {"model": model, "x": x}, "L", client=client)
    loss = lambda model, x: jnp.mean(jax.vmap(model)(x) ** 2)
    ref = eqx.filter_grad(loss)(model, x)
    assert r.grad["model"].activation is None  # a function leaf, held constant
    assert_tree_close(jax.tree.leaves(r.grad["model"]), jax.tree.leaves(ref), rtol=1e-4)
    assert_tree_close(r.grad["x"], jax.grad(loss, 1)(model, x), rtol=1e-4)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_equinox_mlp_with_its_pullback_moved_to_another_worker(cli_client):
    model, x = _mlp(), jax.random.normal(jax.random.key(1), (5, 3))
    a, b = sorted(live_workers(cli_client))
    res, _ = compute_split(cli_client, _mlp_dag(), {"model": model, "x": x}, ["L"], a, b)
    value, grads = res["L"]
    ref_value, ref = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    assert_tree_close(value, ref_value, rtol=1e-5)
    assert_tree_close(jax.tree.leaves(grads["model"]), jax.tree.leaves(ref), rtol=1e-4)


class _Flax(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.tanh(nn.Dense(8)(x)))


@pytest.mark.parametrize("where", ["threads", pytest.param("cluster", marks=pytest.mark.cluster)])
@pytest.mark.timeout(180)
def test_flax_variables_and_an_optax_loss(where, request):
    client = request.getfixturevalue("cli_client") if where == "cluster" else None
    module = _Flax()
    x = jax.random.normal(jax.random.key(2), (6, 4))
    labels = jnp.array([0, 1, 1, 0, 1, 0])
    variables = module.init(jax.random.key(3), x)
    dag = {"logits": (lambda v, x: module.apply(v, x), ["variables", "x"]),
           "loss": (lambda z, y: optax.softmax_cross_entropy_with_integer_labels(z, y).mean(),
                    ["logits", "labels"])}
    r = daskdag.compute_grads(dag, {"variables": variables, "x": x, "labels": labels}, "loss",
                              wrt=["variables"], client=client)
    loss = lambda v: optax.softmax_cross_entropy_with_integer_labels(module.apply(v, x), labels).mean()
    value, ref = jax.value_and_grad(loss)(variables)
    assert_tree_close(r.value, value, rtol=1e-5)
    assert_tree_close(r.grad["variables"], ref, rtol=1e-4)


def test_sweep_with_shared_equinox_model_differentiated_per_item():
    model, xs = _mlp(), jax.random.normal(jax.random.key(4), (6, 3))
    dag = {"Y": (lambda m, x: m(x), ["model", "x"]), "L": (lambda y: jnp.sum(y ** 2), ["Y"])}
    res = daskdag.sweep_grads(dag, {"model": model, "x": xs}, "L", batched=["x"],
                              wrt=["model", "x"], chunk_size=4)
    per_item = jax.vmap(eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2)), in_axes=(None, 0))
    ref = per_item(model, xs)
    assert res.grad["model"].activation is None
    assert_tree_close(jax.tree.leaves(res.grad["model"]), jax.tree.leaves(ref), rtol=1e-4)
    assert np.shape(res.grad["model"].layers[0].weight) == (6, 8, 3)


# -- results as pytrees (issue 68) ----------------------------------------------------------------

SEED = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"]),
        "C": (lambda a: a * 3.0, ["A"])}


def test_a_result_is_a_pytree_of_its_arrays_with_the_call_info_kept():
    x = jnp.arange(3.0)
    res = daskdag.compute_grads(SEED, x, ["B", "C"], cotangents={"C": jnp.ones(3)})
    assert jax.block_until_ready(res) is res  # (every leaf waited for, the tree returned)
    leaves = jax.tree.leaves(res)
    assert len(leaves) == 4 and all(isinstance(a, jax.Array) for a in leaves)
    doubled = jax.tree.map(lambda a: 2 * a, res["B"])
    assert isinstance(doubled, daskdag.Result) and doubled.info == res["B"].info
    assert_tree_close(doubled.grad, 2 * res["B"].grad)
    on_host = jax.device_get(res["B"])
    assert isinstance(on_host.value, np.ndarray) and isinstance(on_host.grad, np.ndarray)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(res["B"])[0]]
    assert paths == [".value", ".grad"]


def test_jvp_hvp_and_sweep_results_are_pytrees_too():
    x, v = jnp.arange(3.0), jnp.ones(3)
    jvp = daskdag.compute_jvps(SEED, x, v, "B")
    hvp = daskdag.compute_hvps(SEED, x, v, "B")
    swept = daskdag.sweep_grads(SEED, jnp.stack([x, x + 1]), "B", progress=False)
    assert len(jax.tree.leaves(jvp)) == 2 and len(jax.tree.leaves(hvp)) == 4
    assert jax.tree.structure(jax.tree.map(jnp.negative, hvp)) == jax.tree.structure(hvp)
    assert_tree_close(jax.tree.map(jnp.negative, jvp).tangent, -jvp.tangent)
    assert jax.tree.leaves(jax.block_until_ready(swept))[0].shape == (2,)
    failed = daskdag.Result(1.0, 2.0, {0: ValueError("x")})  # (a dict among its call's data)
    assert jax.tree.map(lambda a: a, failed).failed == failed.failed
    hash(jax.tree.structure(failed))
