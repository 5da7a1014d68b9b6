"""A sweep's failed items, as users meet them: a failed sweep (items collected as failed, or the
first one raised) leaves nothing behind on the cluster or in its errors' frames; a sweep with no
items, or where every item fails (NaN rows), keeps its results' shapes; and the progress bar
counts item by item, on threads and on a cluster. (A lost worker: test_lost_workers.py and
test_internal_sweep_datapath.py; Ctrl-C: test_interrupts.py.)"""

import gc
import time

import distributed
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import NodeError
from daskdag.sweeps import progress
from .support.clusters import eventually, kept_keys, local_client, only_kept_left, scheduler_tasks
from .support.numbers import assert_tree_close
from .support.progress import Recorded


def encode(x, w):
    return jnp.tanh(w @ x)


def flaky(h):
    if jnp.sum(h) > 1.0:
        raise FloatingPointError("diverged")
    return jnp.sum(h ** 2)


# -- 1. failed sweeps release everything ----------------------------------------------------------

def live_futures(client):
    gc.collect()
    return [f for f in gc.get_objects() if isinstance(f, distributed.Future) and f.client is client]


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_failed_sweeps_release_everything_on_the_cluster():
    dag = {"H": (encode, ["x", "w"]), "L": (flaky, ["H"])}
    xs = jnp.linspace(-1.0, 1.0, 24)[:, None] * jnp.ones((24, 3))  # the last items fail
    inputs = {"x": xs, "w": jnp.eye(3)}
    with local_client() as client:
        before = scheduler_tasks(client)

        def released():
            return only_kept_left(client, before) and not any(
                n for k, n in client.refcount.items() if k not in kept_keys(client))

        def details():
            return (f"the scheduler holds {scheduler_tasks(client)} tasks ({before} before), "
                    f"the client {len(client.futures)} futures, {len(kept_keys(client))} kept")

        res = daskdag.sweep_grads(dag, inputs, "L", batched=["x"], chunk_size=4, errors="collect",
                                  client=client)
        assert res.failed
        eventually(released, 30, "the failed sweep's tasks and futures released", details)
        # the kept errors hold no frame holding a future; the client keeps its values alone
        assert {f.key for f in live_futures(client)} <= kept_keys(client)
        for i, err in res.failed.items():
            assert err.item == i and err.original.__traceback__ is None
            assert "in flaky" in "".join(err.original.__notes__)  # where it raised, as text

        with pytest.raises(NodeError, match="node 'L'") as raised:
            daskdag.sweep_grads(dag, inputs, "L", batched=["x"], chunk_size=4, client=client)
        # raised.value's traceback holds the sweep's frames, and still nothing is held
        assert raised.value.item == min(res.failed)
        eventually(released, 30, "the raising sweep's tasks and futures released", details)


def test_kept_errors_hold_no_frames_on_threads():
    dag = {"H": (encode, ["x", "w"]), "L": (flaky, ["H"])}
    xs = jnp.linspace(-1.0, 1.0, 12)[:, None] * jnp.ones((12, 3))
    res = daskdag.sweep_grads(dag, {"x": xs, "w": jnp.eye(3)}, "L", batched=["x"], chunk_size=4,
                              errors="collect")
    assert res.failed
    for err in res.failed.values():
        chain = [err, err.original]
        assert all(e.__traceback__ is None for e in chain)
        assert "in flaky" in "".join(err.original.__notes__)


# -- 2 and 3. no items, no successful item ----------------------------------------------------------

def pytree_dag():
    """A pytree input, a shared input and a pytree output that is not a scalar."""
    def f(p, w):
        return {"s": jnp.sin(p["a"]) @ w, "t": jnp.sum(p["c"] ** 2)}

    return {"Z": (f, ["p", "w"])}, f


def pytree_inputs(n):
    return {"p": {"a": jnp.ones((n, 2, 3)), "c": jnp.ones((n, 4))}, "w": jnp.ones((3, 5))}


def item_shapes(fn, inputs, batched):
    """One item's value and gradients, shaped by jax itself on the composed function."""
    one = {i: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:] if i in batched else a.shape,
                                                          a.dtype), v) for i, v in inputs.items()}
    return jax.eval_shape(fn, *one.values()), one


def test_no_items_gives_shaped_empty_results():
    dag, f = pytree_dag()
    inputs = pytree_inputs(0)
    ct = {"s": jnp.ones((2, 5)), "t": jnp.float32(1.0)}
    res = daskdag.sweep_grads(dag, inputs, "Z", batched=["p"], wrt=["p", "w"], cotangents={"Z": ct})
    value, one = item_shapes(f, inputs, batched=["p"])
    for got, want in [(res.value, value), (res.grad["p"], one["p"]), (res.grad["w"], one["w"])]:
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.shape == (0, *w.shape) and g.dtype == w.dtype
    assert res.failed == {}


def test_no_items_with_a_node_that_cannot_be_traced_gives_value_none():
    def branchy(h):
        return jnp.sum(h) if jnp.sum(h) > 0 else -jnp.sum(h)  # Python control flow on a value

    dag = {"H": (encode, ["x", "w"]), "B": (branchy, ["H"])}
    res = daskdag.sweep_grads(dag, {"x": jnp.ones((0, 3)), "w": jnp.eye(3)}, "B", batched=["x"])
    assert res.value is None  # the documented fallback
    assert res.grad["x"].shape == (0, 3)


def failing_backward():
    @jax.custom_vjp
    def g(h):
        return jnp.sum(h ** 2)

    def bwd(_, ct):
        raise ArithmeticError("no gradient here")

    g.defvjp(lambda h: (g(h), None), bwd)
    return g


def test_collect_where_every_item_fails_returns_nan_rows():
    dag, f = pytree_dag()
    g = failing_backward()
    dag = {**dag, "L": (lambda z: g(z["s"]) + z["t"], ["Z"])}
    inputs = pytree_inputs(5)
    res = daskdag.sweep_grads(dag, inputs, ["Z", "L"], batched=["p"], errors="collect",
                              cotangents={"Z": {"s": jnp.ones((2, 5)), "t": jnp.float32(1.0)}})
    value, one = item_shapes(lambda p, w: (f(p, w), g(f(p, w)["s"])), inputs, batched=["p"])
    for o, want in zip(["Z", "L"], value):
        assert sorted(res[o].failed) == list(range(5))
        assert all(e.phase == "backward" for e in res[o].failed.values())
        for got, w in [(res[o].value, want), (res[o].grad["p"], one["p"])]:
            assert jax.tree.structure(got) == jax.tree.structure(w)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(w)):
                assert a.shape == (5, *b.shape) and a.dtype == b.dtype and np.isnan(a).all()


# -- 4. progress per item ---------------------------------------------------------------------------

def slow_square(x):
    time.sleep(0.05)
    return jnp.sum(x ** 2)


def check_progress_per_item(monkeypatch, client):
    monkeypatch.setattr(progress, "tqdm", Recorded)
    Recorded.counts = []
    items = 16  # one chunk: any count between 0 and 16 was reported from inside it
    res = daskdag.sweep_grads({"L": (slow_square, ["x"])}, jnp.ones((items, 3)), "L",
                              chunk_size=items, progress=True, client=client)
    counts = Recorded.counts
    assert any(0 < c < items for c in counts), counts
    assert counts == sorted(counts) and counts[-1] == items
    assert_tree_close(res.grad, 2 * jnp.ones((items, 3)))


def test_progress_advances_per_item_on_threads(monkeypatch):
    check_progress_per_item(monkeypatch, None)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_progress_advances_per_item_on_a_cluster(monkeypatch):
    with local_client() as client:
        check_progress_per_item(monkeypatch, client)
