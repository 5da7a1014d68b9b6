"""Many outputs through one stage (issue 68): their cotangents pulled back as one batched pass
(``daskdag.batch-cotangents``), in calls split by memory (``graph.tasks.rows_per_call``),
counted where the pullback runs.

The stage counted is an eager gate whose pullback is a ``jax.custom_vjp``: its ``bwd`` runs once
per pullback call (once under ``jax.vmap`` for every output it carries), and records the shape
it saw there.
"""

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag.graph import tasks

from .support.numbers import assert_tree_close

BACKWARD: list = []  # per call of the gate's pullback: the shape of the cotangent it took


@jax.custom_vjp
def halve(h):
    return h * 0.5


def _halve_fwd(h):
    return halve(h), None


def _halve_bwd(_, ct):
    BACKWARD.append(tuple(ct.shape))
    return (ct * 0.5,)


halve.defvjp(_halve_fwd, _halve_bwd)


def gate(h):  # eager: Python control flow on a value
    return halve(h) if jnp.mean(jnp.abs(h)) > 0.1 else h


def trunk(x, w):
    return jnp.tanh(x @ w)


def loss(g, v):
    return jnp.mean((g @ v - 1.0) ** 2)


def dag(k: int) -> dict:
    d = {"t": daskdag.Node(trunk, ["x", "w"], jit=True), "g": (gate, ["t"])}
    d.update({f"L{j}": daskdag.Node(loss, ["g", f"v{j}"], jit=True) for j in range(k)})
    return d


def inputs(k: int, rows: int, width: int = 4) -> dict:
    rng = np.random.default_rng(k + rows)
    values = {"x": rng.standard_normal((rows, width), np.float32),
              "w": rng.standard_normal((width, width), np.float32)}
    values.update({f"v{j}": rng.standard_normal((width, 2), np.float32) for j in range(k)})
    return {n: jnp.asarray(v) for n, v in values.items()}


def composed(values: dict, j: int):
    return loss(gate(trunk(values["x"], values["w"])), values[f"v{j}"])


def grads(k: int, rows: int, setting: str):
    """``compute_grads`` of the k losses under ``batch-cotangents: setting``, checked against
    ``jax.value_and_grad`` of each composed loss; the gate's pullback calls it made."""
    values = inputs(k, rows)
    BACKWARD.clear()
    with dask.config.set({"daskdag.batch-cotangents": setting}):
        res = daskdag.compute_grads(dag(k), values, [f"L{j}" for j in range(k)],
                                    wrt=["w", *(f"v{j}" for j in range(k))])
    calls = list(BACKWARD)
    for j in range(k):
        value, grad = jax.value_and_grad(composed)(values, j)
        assert_tree_close(res[f"L{j}"].value, value)
        for name in ("w", f"v{j}"):
            assert_tree_close(res[f"L{j}"].grad[name], grad[name])
    return calls


@pytest.mark.parametrize("k", [2, 8])
def test_always_one_batched_pullback_for_every_output(k):
    calls = grads(k, rows=3, setting="always")
    assert calls == [(3, 4)]  # one call, under vmap: each row's shape


@pytest.mark.parametrize("k", [2, 8])
def test_never_one_pullback_per_output(k):
    assert grads(k, rows=3, setting="never") == [(3, 4)] * k


def test_auto_on_the_cpu_batches_many_small_cotangents_and_loops_over_few_or_large_ones():
    assert grads(8, rows=3, setting="auto") == [(3, 4)]
    assert grads(3, rows=3, setting="auto") == [(3, 4)] * 3
    large = 2 ** 15 // 4 + 1  # rows of 4: one element over the most an eager batch takes
    assert grads(8, rows=large, setting="auto") == [(large, 4)] * 8
    assert grads(8, rows=large, setting="always") == [(large, 4)]


def test_batched_calls_are_split_where_memory_allows_fewer(monkeypatch):
    monkeypatch.setattr(tasks, "rows_per_call", lambda cts: 3)
    assert grads(8, rows=3, setting="always") == [(3, 4)] * 3  # 3 + 3 + 2 outputs


def test_a_change_of_the_setting_is_seen_by_a_prepared_call():
    values, k = inputs(4, 3), 4
    f = daskdag.value_and_grad(dag(k), [f"L{j}" for j in range(k)], wrt=["w"])
    for setting, want in [("always", [(3, 4)]), ("never", [(3, 4)] * k), ("always", [(3, 4)])]:
        BACKWARD.clear()
        with dask.config.set({"daskdag.batch-cotangents": setting}):
            f(values)
        assert BACKWARD == want, setting


def test_gradients_of_outputs_that_do_not_read_an_input_are_made_by_one_program():
    from dask.callbacks import Callback
    k, values = 4, inputs(4, 3)
    ran: list = []

    class Recorded(Callback):
        def _pretask(self, key, dsk, state):
            ran.append(str(key))

    with Recorded(), dask.config.set(scheduler="sync"):
        res = daskdag.compute_grads(dag(k), values, [f"L{j}" for j in range(k)],
                                    wrt=["w", *(f"v{j}" for j in range(k))])
    assert len([key for key in ran if key.startswith("zeros:")]) == 1, ran
    zero = [res[f"L{j}"].grad[f"v{i}"] for j in range(k) for i in range(k) if i != j]
    for grad in zero:
        assert isinstance(grad, jax.Array) and grad.dtype == jnp.float32 and grad.shape == (4, 2)
        assert not np.asarray(grad).any()
    # each its own buffer (a user may donate one to an update)
    assert len({grad.unsafe_buffer_pointer() for grad in zero}) == len(zero) == k * (k - 1)
    # every output's gradients in one order, zeros or not
    assert len({tuple(res[f"L{j}"].grad) for j in range(k)}) == 1


# -- through a jitted stage: one program pulls each output's cotangent back apart ------------------

COMPILES: list = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **_: COMPILES.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)


def jitted_dag(k: int) -> dict:
    """A jitted trunk of two nodes (one fused stage), the eager gate, k jitted heads."""
    d = {"t": daskdag.Node(trunk, ["x", "w"], jit=True),
         "u": daskdag.Node(trunk, ["t", "w2"], jit=True), "g": (gate, ["u"])}
    d.update({f"L{j}": daskdag.Node(loss, ["g", f"v{j}"], jit=True) for j in range(k)})
    return d


def jitted_composed(values: dict, j: int):
    return loss(gate(trunk(trunk(values["x"], values["w"]), values["w2"])), values[f"v{j}"])


@pytest.fixture
def each_calls(monkeypatch):
    """Per call of a compiled pullback's ``each``, how many outputs it took."""
    from daskdag.rules import vjp
    calls: list = []
    real = vjp.JaxPullback.each

    def counted(self, cts, inputs, dropped=None):
        if self.apart:
            calls.append(len(cts))
        return real(self, cts, inputs, dropped)

    monkeypatch.setattr(vjp.JaxPullback, "each", counted)
    return calls


@pytest.mark.parametrize("k, want", [(2, [2]), (8, [8]), (11, [6, 5]), (17, [6, 6, 5])])
@pytest.mark.parametrize("setting", ["auto", "always"])
def test_a_jitted_stage_pulls_every_output_back_in_one_program_of_at_most_eight(
        k, want, setting, each_calls):
    values = {**inputs(k, rows=3), "w2": jnp.asarray(np.eye(4, dtype=np.float32) * 0.5)}
    wrt = ["w", "w2", *(f"v{j}" for j in range(k))]
    with dask.config.set({"daskdag.batch-cotangents": setting}):
        res = daskdag.compute_grads(jitted_dag(k), values, [f"L{j}" for j in range(k)], wrt=wrt)
        assert each_calls == want
        each_calls.clear()
        compiled = len(COMPILES)
        again = daskdag.compute_grads(jitted_dag(k), values, [f"L{j}" for j in range(k)],
                                      wrt=wrt)
        assert len(COMPILES) == compiled  # (each count's program compiled once)
        assert each_calls == want
    for j in range(k):
        value, grad = jax.value_and_grad(jitted_composed)(values, j)
        for r in (res, again):
            assert_tree_close(r[f"L{j}"].value, value)
            for name in ("w", "w2", f"v{j}"):
                assert_tree_close(r[f"L{j}"].grad[name], grad[name])


def test_a_jitted_stage_under_never_pulls_each_output_back_alone(each_calls):
    values = {**inputs(4, rows=3), "w2": jnp.asarray(np.eye(4, dtype=np.float32))}
    with dask.config.set({"daskdag.batch-cotangents": "never"}):
        daskdag.compute_grads(jitted_dag(4), values, [f"L{j}" for j in range(4)], wrt=["w"])
    assert each_calls == []


def test_a_jitted_stages_calls_are_split_where_memory_allows_fewer(monkeypatch, each_calls):
    monkeypatch.setattr(tasks, "rows_per_call", lambda cts: 3)
    values = {**inputs(8, rows=3), "w2": jnp.asarray(np.eye(4, dtype=np.float32))}
    daskdag.compute_grads(jitted_dag(8), values, [f"L{j}" for j in range(8)], wrt=["w"])
    assert each_calls == [3, 3, 2]
