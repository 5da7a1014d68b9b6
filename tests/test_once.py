"""Each node runs at most once per call; unrequested nodes never run; outputs share forward tasks.

(How the graph lays this out, stage by stage and key by key: test_internal_keys.py.)"""

import jax
import jax.numpy as jnp
import dask

import daskdag


def test_each_node_called_once_for_many_outputs(seed, x5):
    dag, f, _ = seed
    cts = {"B": jnp.ones(5), "C": jnp.ones(5)}
    daskdag.compute_grads(dag, x5, ["B", "C", "D", "E"], cotangents=cts)
    assert {k: v.calls for k, v in f.items()} == dict.fromkeys(f, 1)


def test_unrequested_nodes_never_run(seed, x5):
    dag, f, _ = seed
    daskdag.compute_grads(dag, x5, ["E"])
    assert f["B_to_C"].calls == 0 and f["C_to_D"].calls == 0
    assert f["x_to_A"].calls == f["A_to_B"].calls == f["B_to_E"].calls == 1


def test_node_without_differentiated_input_runs_plainly():
    seen = {}

    def scale(c):  # depends only on the constant c
        seen["tracer"] = isinstance(c, jax.core.Tracer)
        return c * 2.0

    dag = {"S": (scale, ["c"]), "y": (lambda s, x: jnp.sum(s * x), ["S", "x"])}
    inputs = {"c": jnp.ones(3), "x": jnp.arange(3.0)}
    r = daskdag.compute_grads(dag, inputs, "y", wrt=["x"])  # S and y: one stage, one task
    assert seen["tracer"] is False
    assert jnp.allclose(r.grad["x"], 2.0)
    with dask.config.set({"daskdag.fuse-chains": False}):  # S a stage of its own
        r = daskdag.compute_grads(dag, inputs, "y", wrt=["x"])
    assert seen["tracer"] is False and jnp.allclose(r.grad["x"], 2.0)


def test_outputs_share_the_nodes_they_have_in_common(seed, x5):
    """D and E share A and B: asked for together, A and B run once; node by node (fusion off),
    D and E asked for in two lazy calls computed together share them too."""
    dag, f, composed = seed
    res = daskdag.compute_grads(dag, x5, ["D", "E"])
    assert {k: v.calls for k, v in f.items()} == dict.fromkeys(f, 1)
    with dask.config.set({"daskdag.fuse-chains": False}):
        only_d, only_e = daskdag.grads(dag, x5, "D"), daskdag.grads(dag, x5, "E")
    for v in f.values():
        v.calls = 0
    d, e = dask.compute(only_d, only_e)
    assert {k: v.calls for k, v in f.items()} == dict.fromkeys(f, 1)
    for o, r in (("D", d), ("E", e)):
        assert jnp.allclose(r.value, res[o].value) and jnp.allclose(r.grad, res[o].grad)
        assert jnp.allclose(r.grad, jax.grad(composed[o])(x5), rtol=1e-5)


def test_chains_fuse_but_fan_out_keeps_its_tasks():
    """x -> A -> B -> {C, D}; C -> E: every node once (A+B and C+E fuse, D stays alone:
    test_internal_keys.py)."""
    calls = []

    def node(name, f):
        return lambda *a: (calls.append(name), f(*a))[1]

    dag = {"A": (node("A", jnp.sin), ["x"]), "B": (node("B", jnp.cos), ["A"]),
           "C": (node("C", jnp.tanh), ["B"]), "D": (node("D", jnp.sum), ["B"]),
           "E": (node("E", jnp.sum), ["C"])}
    x = jnp.linspace(0.0, 1.0, 4)
    res = daskdag.compute_grads(dag, x, ["D", "E"])
    assert sorted(calls) == ["A", "B", "C", "D", "E"]
    f = lambda x: jnp.cos(jnp.sin(x))
    assert jnp.allclose(res["D"].grad, jax.grad(lambda x: jnp.sum(f(x)))(x))
    assert jnp.allclose(res["E"].grad, jax.grad(lambda x: jnp.sum(jnp.tanh(f(x))))(x))


def test_a_callback_in_a_jitted_node_runs_once_a_call():
    # (a jitted DAG runs as one program: its nodes traced for the output's vjp alone, not
    # once more for the values; jax.debug.callback is a side effect XLA keeps per trace)
    runs = []

    def logged(x):
        jax.debug.callback(lambda v: runs.append(1), x)
        return jnp.sin(x)

    x = jnp.arange(3.0)
    for dag in ({"y": daskdag.Node(lambda x: jnp.sum(logged(x)), ["x"], jit=True)},
                {"h": daskdag.Node(logged, ["x"], jit=True),
                 "y": daskdag.Node(jnp.sum, ["h"], jit=True)}):
        for _ in range(2):
            runs.clear()
            res = daskdag.compute_grads(dag, x, "y")
            jax.effects_barrier()
            assert len(runs) == 1, list(dag)
            assert jnp.allclose(res.grad, jnp.cos(x))
