"""Repeated compute_grads and sweep_grads calls on one client send each unchanged input, node and
chunk graph once (daskdag.resident, an internal module), and changed ones again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskdag
from daskdag.running import resident
from .conftest import (assert_tree_close, eventually, key_kind, key_label, only_kept_left,
                       scheduler_tasks)

pytestmark = pytest.mark.cluster


def _dag(W):
    return {"h": (lambda x: jnp.tanh(W @ x), ["x"]), "L": (lambda h: jnp.sum(h ** 2), ["h"])}


def _ref(W, x):
    return jax.value_and_grad(lambda x: jnp.sum(jnp.tanh(W @ x) ** 2))(x)


@pytest.mark.timeout(180)
def test_repeated_calls_send_what_changed_only():
    W = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32) / 20  # 1 MiB
    x = jnp.linspace(-1.0, 1.0, 512)
    dag = _dag(W)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster, set_as_default=False) as client:
        kept = resident.of(client)
        sent = []
        for _ in range(3):
            before = kept.sent
            r = daskdag.compute_grads(dag, x, "L", client=client)
            sent.append(kept.sent - before)
            value, grad = _ref(W, x)
            assert_tree_close(r.value, value, rtol=1e-4)
            assert_tree_close(r.grad, grad, rtol=1e-4)
        assert sent[0] >= W.nbytes and sent[1] == sent[2] == 0  # the weights went once
        placed = set(kept.futures)
        # ... the node holding W alone: x (2 kB) and the small node L travel inside the tasks
        assert {(key_kind(k), key_label(k)) for k in placed} == {("node", "h")}

        W[:] *= 2  # in place: the node that closes over W is sent again, the input x is not
        before = kept.sent
        r = daskdag.compute_grads(dag, x, "L", client=client)
        assert W.nbytes <= kept.sent - before < W.nbytes + 64 * 1024
        value, grad = _ref(W, x)
        assert_tree_close(r.value, value, rtol=1e-4)
        assert_tree_close(r.grad, grad, rtol=1e-4)
        assert len(set(kept.futures) - placed) == 1  # the new node's value

        with daskdag_config(**{"daskdag.keep-calls": 1}):  # the old node is let go
            daskdag.compute_grads(dag, x, "L", client=client)
        assert len(kept.futures) == len(placed)


def _sweep_ref(W, S, xs, w):
    one = jax.value_and_grad(lambda x: jnp.sum(jnp.tanh(W @ x * w) * S))
    return jax.vmap(one)(xs)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("vmap", [False, True], ids=["eager", "vmap"])
def test_repeated_sweeps_send_shared_inputs_and_chunk_graph_once(vmap):
    """The shared input w (not differentiated: the same for every item) and the sweep's chunk
    graph (whose nodes close over W and S) go to the cluster
    once; an in-place change to w, or to the S a node closes over, sends that again, with
    results that follow the change."""
    rng = np.random.default_rng(1)
    W = rng.standard_normal((64, 64)).astype(np.float32) / 8
    S = np.ones(64, np.float32)  # closed over by the second node: a stale copy would be silent
    w = np.full(64, 0.5, np.float32)
    dag = {"h": daskdag.Node(lambda x, w: jnp.tanh(W @ x * w), ["x", "w"], vmap=vmap),
           "L": daskdag.Node(lambda h: jnp.sum(h * S), ["h"], vmap=vmap)}
    xs = jnp.asarray(rng.standard_normal((12, 64)).astype(np.float32))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster, set_as_default=False) as client:
        base = scheduler_tasks(client)
        kept = resident.of(client)

        def sweep():
            before, placed = kept.sent, set(kept.futures)
            r = daskdag.sweep_grads(dag, {"x": xs, "w": w}, "L", batched=["x"], chunk_size=4,
                                    client=client)
            value, grad = _sweep_ref(W, S, xs, w)
            assert_tree_close(r.value, value, rtol=1e-4)
            assert_tree_close(r.grad["x"], grad, rtol=1e-4)
            return kept.sent - before, {f"{key_kind(k)}:{key_label(k)}"
                                        for k in set(kept.futures) - placed}

        first, new = sweep()
        assert first >= W.nbytes and new == {"input:w", "sweep:graph"}
        assert sweep() == (0, set())  # nothing sent again
        w *= 2  # in place: w goes again, the chunk graph (which refers to it) too
        assert sweep()[1] == {"input:w", "sweep:graph"}
        S[:] = 2.0  # in place, closed over: a new chunk graph, w stays
        sent, new = sweep()
        assert new == {"sweep:graph"} and sent >= W.nbytes  # (its graph holds both nodes)

        # (the last sweep's chunks are let go asynchronously: wait until the scheduler heard)
        assert eventually(lambda: only_kept_left(client, base))
        with daskdag_config(**{"daskdag.keep-calls": 0}):  # kept for the sweep's duration only
            before = scheduler_tasks(client)
            r = daskdag.sweep_grads(dag, {"x": xs, "w": w}, "L", batched=["x"], chunk_size=4,
                                    client=client)
            assert_tree_close(r.grad["x"], _sweep_ref(W, S, xs, w)[1], rtol=1e-4)
            assert eventually(lambda: scheduler_tasks(client) == before)


def daskdag_config(**kw):
    import dask

    return dask.config.set(kw)
