"""Repeated compute_grads calls on one client send each unchanged input and node once
(daskdag.resident, an internal module), and changed ones again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskdag
from daskdag import resident

from .conftest import assert_tree_close

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
        # ... all to one worker, so the forward pass finds its nodes and input together
        holders = client.who_has(list(kept.futures.values()))
        assert len({w for ws in holders.values() for w in ws}) == 1

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


def daskdag_config(**kw):
    import dask

    return dask.config.set(kw)
