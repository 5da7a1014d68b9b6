"""sweep_grads: per-item agreement with compute_grads and jax.vmap, failures, clusters, memory."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import psutil
import pytest

import daskdag
from daskdag import Node, NodeError
from .support.numbers import assert_tree_close


def encode(x, w):
    return jnp.tanh(w @ x)


def energy(h, b):
    return jnp.sum(h ** 2) + jnp.dot(b, h)


def spread(h):
    return jnp.std(h)


def mixed_dag(vmap_encode=True):
    """A vmap=True node and item-by-item nodes; x and b batched, w shared."""
    return {"H": Node(encode, ["x", "w"], vmap=vmap_encode),
            "E": (energy, ["H", "b"]),
            "S": (spread, ["H"])}


def mixed_inputs(n=11, d=4, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {"x": jax.random.normal(k[0], (n, d)), "b": jax.random.normal(k[1], (n, d)),
            "w": jax.random.normal(k[2], (d, d)) / 2}


@pytest.mark.parametrize("vmap_encode", [True, False])
def test_matches_vmapped_value_and_grad(vmap_encode):
    inputs = mixed_inputs()
    res = daskdag.sweep_grads(mixed_dag(vmap_encode), inputs, ["E", "S"], batched=["x", "b"],
                              chunk_size=3)
    w = inputs["w"]
    for o, f in {"E": lambda x, b: energy(encode(x, w), b),
                 "S": lambda x, b: spread(encode(x, w))}.items():
        value, (gx, gb) = jax.vmap(jax.value_and_grad(f, (0, 1)))(inputs["x"], inputs["b"])
        assert res[o].value.shape == (11,)
        assert_tree_close(res[o].value, value, rtol=1e-5)
        assert set(res[o].grad) == {"x", "b"}  # shared w is not differentiated by default
        assert_tree_close(res[o].grad["x"], gx, rtol=1e-5)
        assert_tree_close(res[o].grad["b"], gb, rtol=1e-5)
        assert res[o].failed == {}


def test_each_item_matches_compute_grads_with_control_flow():
    def branchy(h):
        if jnp.sum(h) > 0:
            return jnp.sum(h ** 3)
        return jnp.sum(jnp.cos(h))

    dag = {"H": (encode, ["x", "w"]), "B": (branchy, ["H"])}
    inputs = mixed_inputs(n=7)
    inputs.pop("b")
    res = daskdag.sweep_grads(dag, inputs, "B", batched=["x"], wrt=["x", "w"], chunk_size=2)
    assert res.grad["x"].shape == (7, 4) and res.grad["w"].shape == (7, 4, 4)
    for i in range(7):
        one = daskdag.compute_grads(dag, {"x": inputs["x"][i], "w": inputs["w"]}, "B")
        assert_tree_close(res.value[i], one.value)
        assert_tree_close(res.grad["x"][i], one.grad["x"])
        assert_tree_close(res.grad["w"][i], one.grad["w"])  # a shared input, per item
    # JAX's own numbers, item by item (Python control flow: no vmap), both branches taken
    taken = set()
    for i in range(7):
        x = inputs["x"][i]
        taken.add(bool(jnp.sum(encode(x, inputs["w"])) > 0))
        value, (gx, gw) = jax.value_and_grad(lambda x, w: branchy(encode(x, w)), (0, 1))(
            x, inputs["w"])
        assert_tree_close(res.value[i], value, rtol=1e-6)
        assert_tree_close(res.grad["x"][i], gx, rtol=1e-6)
        assert_tree_close(res.grad["w"][i], gw, rtol=1e-6)  # shared w's gradient of this item
    assert taken == {True, False}


def test_single_free_input_pytree_and_non_scalar_output():
    dag = {"Z": (lambda p: {"s": jnp.sin(p["a"]) * p["c"], "t": p["c"] ** 2}, ["p"])}
    ps = {"a": jnp.linspace(0, 1, 10).reshape(5, 2), "c": jnp.arange(5.0)}
    ct = {"s": jnp.array([1.0, -1.0]), "t": jnp.float32(0.5)}
    res = daskdag.sweep_grads(dag, ps, "Z", cotangents={"Z": ct}, chunk_size=2)
    f = dag["Z"][0]
    value = jax.vmap(f)(ps)
    grad = jax.vmap(lambda p: jax.vjp(f, p)[1](ct)[0])(ps)
    assert_tree_close(res.value, value)
    assert_tree_close(res.grad, grad)


def test_shared_only_nodes_run_once_and_broadcast():
    calls = []

    def scale(w):
        calls.append(1)
        return w * 2

    dag = {"W2": (scale, ["w"]), "Y": (lambda x, w2: jnp.sum(x * w2), ["x", "W2"]),
           "K": (lambda w2: jnp.sum(w2), ["W2"])}
    inputs = {"x": jnp.ones((6, 3)), "w": jnp.arange(3.0)}
    res = daskdag.sweep_grads(dag, inputs, ["Y", "K"], batched=["x"], chunk_size=6)
    assert len(calls) == 1
    np.testing.assert_allclose(res["K"].value, np.full(6, 6.0))
    np.testing.assert_allclose(res["K"].grad["x"], np.zeros((6, 3)))
    np.testing.assert_allclose(res["Y"].grad["x"], np.tile(inputs["w"] * 2, (6, 1)))


def flaky(h):
    if jnp.sum(h) > 1.0:
        raise FloatingPointError("diverged")
    return jnp.sum(h ** 2)


def flaky_inputs():
    x = jnp.linspace(-1.0, 1.0, 10)[:, None] * jnp.ones((10, 3))  # items 6..9 sum above 1
    return {"x": x, "w": jnp.eye(3)}


def test_errors_collect_keeps_every_item_that_succeeded():
    dag = {"H": (encode, ["x", "w"]), "L": (flaky, ["H"])}
    inputs = flaky_inputs()
    res = daskdag.sweep_grads(dag, inputs, ["L"], batched=["x"], chunk_size=4, errors="collect")["L"]
    bad = [i for i in range(10) if float(jnp.sum(encode(inputs["x"][i], inputs["w"]))) > 1.0]
    assert sorted(res.failed) == bad and bad
    for i, err in res.failed.items():
        assert err.node == "L" and err.item == i and isinstance(err.__cause__, FloatingPointError)
        assert f"item {i}: node 'L'" in str(err)
        assert np.isnan(res.value[i]) and np.isnan(res.grad["x"][i]).all()
    f = lambda x: flaky(encode(x, inputs["w"]))
    for i in set(range(10)) - set(bad):
        value, grad = jax.value_and_grad(f)(inputs["x"][i])
        assert_tree_close(res.value[i], value)
        assert_tree_close(res.grad["x"][i], grad)


def test_errors_raise_names_the_item_and_node():
    dag = {"H": (encode, ["x", "w"]), "L": (flaky, ["H"])}
    inputs = flaky_inputs()
    first = next(i for i in range(10) if float(jnp.sum(encode(inputs["x"][i], inputs["w"]))) > 1.0)
    with pytest.raises(NodeError, match=f"item {first}: node 'L' failed in its forward pass") as e:
        daskdag.sweep_grads(dag, inputs, "L", batched=["x"], chunk_size=2)
    assert e.value.item == first and isinstance(e.value.__cause__, FloatingPointError)


@pytest.mark.parametrize("kw, match", [
    ({"batched": ["q"]}, "batched names 'q'"),
    ({"batched": []}, "batched is empty"),
    ({"errors": "ignore"}, "errors must be 'raise' or 'collect'"),
    ({"chunk_size": 0}, "chunk_size must be a positive integer"),
])
def test_bad_sweep_arguments(kw, match):
    with pytest.raises(daskdag.DAGError, match=match):
        daskdag.sweep_grads(mixed_dag(), mixed_inputs(), "E", **{"batched": ["x", "b"], **kw})


def test_batched_inputs_must_agree_on_items():
    inputs = {**mixed_inputs(), "b": jnp.ones((5, 4))}
    with pytest.raises(daskdag.DAGError, match="disagree on the number of items: 'x' has 11, 'b' has 5"):
        daskdag.sweep_grads(mixed_dag(), inputs, "E", batched=["x", "b"])
    with pytest.raises(daskdag.DAGError, match="batched input 'w' has a scalar leaf"):
        daskdag.sweep_grads({"Y": (jnp.sin, ["w"])}, jnp.float32(1.0), "Y")


def test_progress_bar(capsys):
    daskdag.sweep_grads(mixed_dag(), mixed_inputs(), "E", batched=["x", "b"], chunk_size=4,
                        progress=True)
    err = capsys.readouterr().err
    assert "11/11" in err and "item" in err


@pytest.mark.timeout(120)
def test_bounded_memory_in_the_client():
    """Each item makes 256 KiB of intermediates and as much of residuals: 2 GiB for 4,000
    items if they were kept. The client's memory must grow by far less."""
    dag = {"H": Node(lambda x: jnp.tanh(jnp.outer(x, x)), ["x"], vmap=True),  # 256 KiB per item
           "L": (lambda h: jnp.mean(h), ["H"])}
    items = 4000
    xs = jnp.linspace(0.0, 1.0, items * 256).reshape(items, 256)
    proc, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    daskdag.sweep_grads(dag, xs[:40], "L", chunk_size=20)  # warm up: compile, allocate pools
    base = proc.memory_info().rss
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        res = daskdag.sweep_grads(dag, xs, "L", chunk_size=20)
    finally:
        done.set()
        sampler.join()
    results = res.value.nbytes + res.grad.nbytes  # 2 MB
    intermediates = items * 256 * 256 * 4 * 2
    growth = peak[0] - base
    print(f"client memory grew {growth / 2**20:.0f} MiB for {intermediates / 2**20:.0f} MiB of intermediates")
    assert growth < intermediates / 8, (growth, intermediates)
    np.testing.assert_allclose(res.value, jax.vmap(lambda x: jnp.mean(jnp.tanh(jnp.outer(x, x))))(xs),
                               rtol=1e-5)
    assert results < growth + intermediates  # (keeps results referenced until here)


@pytest.mark.parametrize("fuse", [True, False])
def test_item_by_item_values_feed_vectorized_nodes_and_back(fuse):
    """Item-by-item nodes pass their values on unstacked (chunked.Items); a vmap node takes
    them stacked, and the cotangents it returns reach the item-by-item pullbacks per item,
    summed with those of item-by-item consumers (H fans out to both kinds), pytrees included."""
    import dask

    def split(h):  # eager, a pytree value
        return {"a": h * 2.0, "s": jnp.sum(h)}

    def mix(p, b):  # vmap: takes the pytree of Items
        return jnp.sum(jnp.sin(p["a"]) * b) + p["s"] * 3.0

    dag = {"H": (encode, ["x", "w"]), "P": (split, ["H"]),
           "V": Node(mix, ["P", "b"], vmap=True), "E": (energy, ["H", "b"])}
    inputs = mixed_inputs(n=7)
    w = inputs["w"]
    with dask.config.set({"daskdag.fuse-chains": fuse}):
        res = daskdag.sweep_grads(dag, inputs, ["V", "E", "H"], batched=["x", "b"], chunk_size=3,
                                  cotangents={"H": jnp.arange(4.0)})
    refs = {"V": lambda x, b: mix(split(encode(x, w)), b), "E": lambda x, b: energy(encode(x, w), b),
            "H": lambda x, b: jnp.dot(encode(x, w), jnp.arange(4.0))}
    for o, f in refs.items():
        value, (gx, gb) = jax.vmap(jax.value_and_grad(f, (0, 1)))(inputs["x"], inputs["b"])
        if o == "H":
            assert_tree_close(res[o].value, jax.vmap(lambda x: encode(x, w))(inputs["x"]), rtol=1e-5)
        else:
            assert_tree_close(res[o].value, value, rtol=1e-5)
        assert_tree_close(res[o].grad["x"], gx, rtol=1e-5)
        assert_tree_close(res[o].grad["b"], gb, rtol=1e-5)
