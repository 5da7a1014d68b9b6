"""What a sweep in this process keeps for its next calls: its chunk graph, made once per
preparation with the shared inputs, cotangents and items as slots
(:func:`daskdag.sweeps.engines.kept_chunk_graph`), and the threads its chunks run on
(:func:`daskdag.sweeps.engines.sweep_pool`); each call's own values still reach every chunk."""

import threading

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag.sweeps import engines

from .support.numbers import assert_tree_close

W = jnp.asarray(np.random.default_rng(0).standard_normal((3, 3)), jnp.float32)


def _dag(vmap: bool):
    def a(x, w):
        return jnp.tanh(w @ x)

    def out(h):
        return h * 2.0

    return {"A": daskdag.Node(a, ["x", "w"], jit=True, vmap=vmap),
            "O": daskdag.Node(out, ["A"], jit=True, vmap=vmap)}


def _want(xs, w, ct):
    def one(x):
        value, pull = jax.vjp(lambda x, w: jnp.tanh(w @ x) * 2.0, x, w)
        return value, pull(ct)

    return jax.vmap(one)(xs)


@pytest.mark.parametrize("vmap", [False, True])
def test_a_sweeps_chunk_graph_is_made_once_and_takes_each_calls_values(monkeypatch, vmap):
    made = []
    chunk_graph = engines.chunk_graph
    monkeypatch.setattr(engines, "chunk_graph", lambda *a: made.append(1) or chunk_graph(*a))
    dag = _dag(vmap)
    rng = np.random.default_rng(1)
    for call in range(3):  # new items, a new shared input and new cotangents each call
        xs = jnp.asarray(rng.standard_normal((10, 3)), jnp.float32)
        w = W + call
        ct = jnp.asarray(rng.standard_normal(3), jnp.float32)
        res = daskdag.sweep_grads(dag, {"x": xs, "w": w}, "O", batched=["x"], wrt=["x", "w"],
                                  cotangents={"O": ct}, chunk_size=4)
        value, (gx, gw) = _want(xs, w, ct)
        assert_tree_close(res.value, value)
        assert_tree_close(res.grad["x"], gx)
        assert_tree_close(res.grad["w"], gw)
    assert len(made) == 1


def test_sweeps_share_their_threads_and_a_sweep_in_a_chunk_has_its_own():
    dag = _dag(False)
    xs = jnp.ones((8, 3))
    ran = []

    def inner(h):
        ran.append(threading.current_thread().name)
        res = daskdag.sweep_grads(dag, {"x": xs, "w": W}, "O", batched=["x"], chunk_size=2,
                                  cotangents={"O": jnp.ones(3)})
        return h + jnp.sum(res.value)

    nested = {**dag, "P": daskdag.Node(inner, ["O"])}
    with dask.config.set({"daskdag.share-sweep-work": False}):
        daskdag.sweep_grads(dag, {"x": xs, "w": W}, "O", batched=["x"], chunk_size=2,
                            cotangents={"O": jnp.ones(3)})
        before = set(threading.enumerate())
        daskdag.sweep_grads(dag, {"x": xs, "w": W}, "O", batched=["x"], chunk_size=2,
                            cotangents={"O": jnp.ones(3)})
        assert set(threading.enumerate()) <= before  # no thread started
        res = daskdag.sweep_grads(nested, {"x": xs, "w": W}, "P", batched=["x"], chunk_size=2,
                                  cotangents={"P": jnp.ones(3)})
    assert ran and all(name.startswith(engines.POOL_PREFIX) for name in ran)
    inner_total = jnp.sum(_want(xs, W, jnp.ones(3))[0])
    assert_tree_close(res.value, _want(xs, W, jnp.ones(3))[0] + inner_total)
