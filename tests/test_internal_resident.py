"""Repeated compute_grads and sweep_grads calls on one client send each unchanged input, node and
chunk graph once (daskdag.resident, an internal module), and changed ones again."""

import distributed
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag.running import resident
from daskdag.sweeps import engines
from daskdag.transport import programs
from .support.clusters import eventually, local_client, scheduler_tasks, wait_only_kept_left
from .support.keys import key_kind, key_label
from .support.numbers import assert_tree_close
from .test_sweep import encode, energy, mixed_dag, mixed_inputs

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
    with local_client() as client:
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
    with local_client() as client:
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
        wait_only_kept_left(client, base, what="the sweeps")
        with daskdag_config(**{"daskdag.keep-calls": 0}):  # kept for the sweep's duration only
            before = scheduler_tasks(client)
            r = daskdag.sweep_grads(dag, {"x": xs, "w": w}, "L", batched=["x"], chunk_size=4,
                                    client=client)
            assert_tree_close(r.grad["x"], _sweep_ref(W, S, xs, w)[1], rtol=1e-4)
            eventually(lambda: scheduler_tasks(client) == before, 30,
                       "the sweep's kept values let go after it (daskdag.keep-calls 0)",
                       lambda: f"{scheduler_tasks(client)} tasks on the scheduler, {before} before")


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_sweep_on_a_process_cluster_sends_its_shared_input_once(monkeypatch):
    """The shared w goes to the cluster once, as one task, for all the
    chunks of a sweep and for the sweeps after it; chunks spread over both workers, each
    chunk's pullbacks stay on its worker."""
    inputs = mixed_inputs(n=16)
    with local_client() as client:
        placed = []
        place = engines.place_shared
        monkeypatch.setattr(engines, "place_shared",
                            lambda c, name, value: placed.append((name, value)) or place(c, name, value))
        with distributed.get_task_stream(client) as ts:
            res = daskdag.sweep_grads(mixed_dag(), inputs, ["E", "S"], batched=["x", "b"],
                                      chunk_size=2, client=client)
        assert len(placed) == 1 and placed[0][0] == "w" and placed[0][1] is inputs["w"]  # 8 chunks
        assert sum(1 for t in ts.data if (key_kind(t["key"]), key_label(t["key"])) == ("input", "w")) == 1
        assert len({t["worker"] for t in ts.data}) == 2  # chunks spread over both workers
        # Each chunk stays on its worker: no pullback was exported to move.
        assert all(s["exported"] == 0 for s in client.run(programs.stats).values())
        for _ in range(3):  # back to back: the same w, kept on the cluster, serves each call
            again = daskdag.sweep_grads(mixed_dag(), inputs, "E", batched=["x", "b"],
                                        chunk_size=4, client=client)
            assert_tree_close(again.grad["x"], res["E"].grad["x"])
    w = inputs["w"]
    value, (gx, gb) = jax.vmap(jax.value_and_grad(lambda x, b: energy(encode(x, w), b), (0, 1)))(
        inputs["x"], inputs["b"])
    assert_tree_close(res["E"].value, value, rtol=1e-5)
    assert_tree_close(res["E"].grad["x"], gx, rtol=1e-5)
    assert_tree_close(res["E"].grad["b"], gb, rtol=1e-5)


def daskdag_config(**kw):
    import dask

    return dask.config.set(kw)
