"""Work shared across a sweep's items (issue 41): the nodes a sweep computes from its shared
inputs alone run once for the whole sweep, not once per chunk.

Each result is checked against ``jax.vmap`` of ``jax.value_and_grad`` of the composed
function, the shared data unbatched; runs are counted where the nodes ran (a file the worker
processes append to, on a cluster started by the ``dask`` CLI, which cannot import this module).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag

from .support.clusters import RunLog
from .support.numbers import assert_tree_close

W = jnp.array([0.5, -1.0, 2.0])


def trunk(w):
    return jnp.tanh(w) * 3.0


def features(s):
    return jnp.outer(s, s) + jnp.eye(3)


def head(x, f):
    return jnp.sum(jnp.sin(f @ x))


def composed(x, w):
    return head(x, features(trunk(w)))


def _dag(log):
    return {"S": (log.wrap("S", trunk), ["w"]), "F": (log.wrap("F", features), ["S"]),
            "A": (log.wrap("A", head), ["x", "F"])}


def _items(n=8):
    return jnp.arange(3.0 * n).reshape(n, 3) / 10


def _check(res, xs, w):
    value, grad = jax.vmap(jax.value_and_grad(composed), in_axes=(0, None))(xs, w)
    assert_tree_close(res.value, value, rtol=1e-5)
    assert_tree_close(res.grad["x"], grad, rtol=1e-5)


def test_nodes_of_shared_inputs_run_once_per_sweep_on_threads(tmp_path):
    """8 items in 4 chunks: the trunk S and the features F, which read the shared w alone, run
    once (they ran once per chunk, 4 times); the head A once per item."""
    log = RunLog(tmp_path / "runs")
    xs = _items()
    res = daskdag.sweep_grads(_dag(log), {"x": xs, "w": W}, "A", batched=["x"], chunk_size=2)
    _check(res, xs, W)
    assert len(log.pids("S")) == 1 and len(log.pids("F")) == 1
    assert len(log.pids("A")) == 8


def test_a_shared_node_differentiated_per_item_still_gives_each_item_its_gradient(tmp_path):
    """With ``wrt=["x", "w"]`` the trunk is on every item's path to w: its gradients per item
    are JAX's."""
    log = RunLog(tmp_path / "runs")
    xs = _items()
    res = daskdag.sweep_grads(_dag(log), {"x": xs, "w": W}, "A", batched=["x"],
                              wrt=["x", "w"], chunk_size=2)
    _check(res, xs, W)
    want = jax.vmap(jax.grad(composed, argnums=1), in_axes=(0, None))(xs, W)
    assert_tree_close(res.grad["w"], want, rtol=1e-4)  # (float32, summed in another order)


@pytest.mark.parametrize("errors", ["raise", "collect"])
def test_a_shared_node_that_fails_is_named_with_the_item_as_before(tmp_path, errors):
    """A failing shared node: the chunks run it, and the error names it and the first item
    (``raise``), or every item failed with it (``collect``)."""
    def broken(w):
        raise ValueError("no trunk today")

    dag = {"S": (broken, ["w"]), "A": (head, ["x", "S"])}
    xs = _items()
    if errors == "raise":
        with pytest.raises(daskdag.NodeError, match="'S'") as e:
            daskdag.sweep_grads(dag, {"x": xs, "w": W}, "A", batched=["x"], chunk_size=2)
        assert "no trunk today" in str(e.value) and e.value.item == 0
    else:
        res = daskdag.sweep_grads(dag, {"x": xs, "w": W}, "A", batched=["x"], chunk_size=2,
                                  errors="collect")
        assert sorted(res.failed) == list(range(8))
        assert all(err.node == "S" for err in res.failed.values())


def test_a_durable_sweep_with_shared_nodes_runs_nothing_once_stored(tmp_path):
    """A durable sweep with shared nodes stores the numbers JAX gives; the same sweep again
    reads them from its store and runs nothing, not even the shared nodes."""
    log = RunLog(tmp_path / "runs")
    xs = _items()
    store = tmp_path / "store"
    res = daskdag.sweep_grads(_dag(log), {"x": xs, "w": W}, "A", batched=["x"], chunk_size=2,
                              store=store)
    _check(res, xs, W)
    assert len(log.pids("S")) == 1
    before = len(log.runs())
    again = daskdag.sweep_grads(_dag(log), {"x": xs, "w": W}, "A", batched=["x"],
                                chunk_size=2, store=store)
    _check(again, xs, W)
    assert len(log.runs()) == before


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_nodes_of_shared_inputs_run_once_per_sweep_on_a_cluster(cli_client, tmp_path):
    """On a cluster started by the ``dask`` CLI: the trunk and the features run once for the
    sweep's 4 chunks, the head once per item, the numbers JAX's."""
    log = RunLog(tmp_path / "runs")
    xs = _items()
    res = daskdag.sweep_grads(_dag(log), {"x": xs, "w": W}, "A", batched=["x"], chunk_size=2,
                              client=cli_client)
    _check(res, xs, W)
    assert len(log.pids("S")) == 1 and len(log.pids("F")) == 1
    assert len(log.pids("A")) == 8
