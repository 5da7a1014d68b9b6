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


# -- shared inputs differentiated per item --------------------------------------------------------

def _check_wrt_w(res, xs, w, f=composed):
    value, (gx, gw) = jax.vmap(jax.value_and_grad(f, argnums=(0, 1)), in_axes=(0, None))(xs, w)
    assert_tree_close(res.value, value, rtol=1e-5)
    assert_tree_close(res.grad["x"], gx, rtol=1e-5)
    assert_tree_close(res.grad["w"], gw, rtol=1e-4)  # (float32, summed in another order)


def test_nodes_differentiated_per_item_run_once_on_threads(tmp_path):
    """``wrt=["x", "w"]``: the trunk and the features are on every item's path to w. They run
    once for the sweep (they ran once per item, 8 times); each item's gradient with respect to w
    is pulled back through their kept pullback, and is JAX's."""
    log = RunLog(tmp_path / "runs")
    xs = _items()
    res = daskdag.sweep_grads(_dag(log), {"x": xs, "w": W}, "A", batched=["x"],
                              wrt=["x", "w"], chunk_size=2)
    _check_wrt_w(res, xs, W)
    assert len(log.pids("S")) == 1 and len(log.pids("F")) == 1
    assert len(log.pids("A")) == 8


def test_several_outputs_and_a_shared_input_also_read_by_the_items(tmp_path):
    """Two outputs, and w read by the head B directly as well as through the trunk: each item's
    gradient with respect to w is the sum of both paths, for each output; w a pytree holding
    a scalar and an integer leaf (no gradient)."""
    log = RunLog(tmp_path / "runs")

    def trunk2(w):
        return jnp.tanh(w["v"]) * w["s"] * w["n"]

    def head_b(x, s, w):
        return jnp.sum(x * s) * w["s"] ** 2

    dag = {"S": (log.wrap("S", trunk2), ["w"]), "A": (log.wrap("A", head), ["x", "F"]),
           "F": (features, ["S"]), "B": (log.wrap("B", head_b), ["x", "S", "w"])}
    w = {"v": W, "s": jnp.asarray(1.5), "n": 2}
    xs = _items(6)
    out = daskdag.sweep_grads(dag, {"x": xs, "w": w}, ["A", "B"], batched=["x"],
                              wrt=["x", "w"], chunk_size=4)
    assert len(log.pids("S")) == 1

    def fa(x, v, s):
        return head(x, features(trunk2({"v": v, "s": s, "n": 2})))

    def fb(x, v, s):
        ww = {"v": v, "s": s, "n": 2}
        return head_b(x, trunk2(ww), ww)

    for name, f in (("A", fa), ("B", fb)):
        value, grads = jax.vmap(jax.value_and_grad(f, argnums=(0, 1, 2)),
                                in_axes=(0, None, None))(xs, W, w["s"])
        res = out[name]
        assert_tree_close(res.value, value, rtol=1e-5)
        assert_tree_close(res.grad["x"], grads[0], rtol=1e-5)
        assert_tree_close(res.grad["w"]["v"], grads[1], rtol=1e-4)
        assert_tree_close(res.grad["w"]["s"], grads[2], rtol=1e-4)
        assert res.grad["w"]["n"] is None
        assert res.grad["w"]["s"].shape == (6,)


def test_a_shared_node_with_its_own_numpy_rule_is_pulled_back_item_by_item(tmp_path):
    """A trunk of NumPy with its own VJP (JAX cannot vmap it): it runs once, and its rule pulls
    each item's cotangent back in turn; vmap=True heads take the trunk's value per item."""
    log = RunLog(tmp_path / "runs")

    def cube(w):
        return np.asarray(w) ** 3

    def cube_vjp(ct, value, w):
        return (3 * np.asarray(w) ** 2 * np.asarray(ct),)

    dag = {"S": daskdag.Node(log.wrap("S", cube), ["w"], vjp=log.wrap("S-vjp", cube_vjp)),
           "A": daskdag.Node(lambda x, s: jnp.sum(jnp.sin(x * s)), ["x", "S"], vmap=True)}
    xs = _items()
    res = daskdag.sweep_grads(dag, {"x": xs, "w": W}, "A", batched=["x"], wrt=["x", "w"],
                              chunk_size=4)
    _check_wrt_w(res, xs, W, lambda x, w: jnp.sum(jnp.sin(x * w ** 3)))
    assert len(log.pids("S")) == 1
    assert len(log.pids("S-vjp")) == 8  # (one per item: its rule is the user's NumPy)


def test_a_failing_item_leaves_the_others_their_gradients_through_the_shared_nodes(tmp_path):
    """``errors="collect"``: an item that fails in its head is kept out; the others' gradients
    with respect to w, through the trunk that ran once, are JAX's."""
    log = RunLog(tmp_path / "runs")

    def picky(x, k, f):
        if int(k) == 1:
            raise ValueError("not this one")
        return head(x, f)

    dag = {"S": (log.wrap("S", trunk), ["w"]), "F": (features, ["S"]),
           "A": (picky, ["x", "k", "F"])}
    xs = _items()
    res = daskdag.sweep_grads(dag, {"x": xs, "k": np.arange(8), "w": W}, "A",
                              batched=["x", "k"], wrt=["x", "w"], chunk_size=4,
                              errors="collect")
    assert list(res.failed) == [1]
    assert len(log.pids("S")) == 1
    keep = np.array([i != 1 for i in range(8)])
    _, gw = jax.vmap(jax.grad(composed, argnums=(0, 1)), in_axes=(0, None))(xs, W)
    assert_tree_close(res.grad["w"][keep], gw[keep], rtol=1e-4)
    assert np.isnan(res.grad["w"][1]).all()


def test_a_durable_sweep_differentiated_per_item_resumes_with_the_same_numbers(tmp_path):
    """With a store: the first sweep stores JAX's gradients with respect to w; a second, over
    a store that lost half its chunks, computes those again (the trunk once more) and returns
    the same numbers."""
    import shutil

    log = RunLog(tmp_path / "runs")
    xs = _items()
    store = tmp_path / "store"
    first = daskdag.sweep_grads(_dag(log), {"x": xs, "w": W}, "A", batched=["x"],
                                wrt=["x", "w"], chunk_size=2, store=store)
    _check_wrt_w(first, xs, W)
    done = sorted(p for p in (store / "done").iterdir() if p.is_dir())
    assert len(done) == 4
    for piece in done[::2]:
        shutil.rmtree(piece)
    again = daskdag.sweep_grads(_dag(log), {"x": xs, "w": W}, "A", batched=["x"],
                                wrt=["x", "w"], chunk_size=2, store=store)
    np.testing.assert_array_equal(again.grad["w"], first.grad["w"])
    assert len(log.pids("S")) == 2 and len(log.pids("A")) == 8 + 2 * len(done[::2])


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_nodes_differentiated_per_item_run_once_on_a_cluster(cli_client, tmp_path):
    """On a cluster started by the ``dask`` CLI: with ``wrt=["x", "w"]`` the trunk and the
    features run once, as one task, the head once per item; the numbers JAX's."""
    log = RunLog(tmp_path / "runs")
    xs = _items()
    res = daskdag.sweep_grads(_dag(log), {"x": xs, "w": W}, "A", batched=["x"],
                              wrt=["x", "w"], chunk_size=2, client=cli_client)
    _check_wrt_w(res, xs, W)
    assert len(log.pids("S")) == 1 and len(log.pids("F")) == 1
    assert len(log.pids("A")) == 8


def test_sharing_turned_off_runs_the_shared_nodes_per_item_as_before(tmp_path):
    """``daskdag.share-sweep-work: false``: the trunk runs in every item's chunk work again, and
    the numbers are the same."""
    import dask

    log = RunLog(tmp_path / "runs")
    xs = _items()
    with dask.config.set({"daskdag.share-sweep-work": False}):
        res = daskdag.sweep_grads(_dag(log), {"x": xs, "w": W}, "A", batched=["x"],
                                  wrt=["x", "w"], chunk_size=2)
    _check_wrt_w(res, xs, W)
    assert len(log.pids("S")) == 8
