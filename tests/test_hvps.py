"""compute_hvps against jax.jvp of jax.grad of the composed function: the seed DAG (eager and
jitted nodes, each run once), several inputs and pytrees with leaves held constant, outputs with
a cotangent, an equinox model, the lazy form, errors that name the node, and a process cluster
with the pullbacks moved between workers."""

import contextlib

import dask
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import Node
from .support.clusters import compute_split, local_client
from .support.numbers import Counted, assert_tree_close, seed_functions

X = jnp.linspace(0.1, 1.0, 5)
V = jnp.arange(5.0) - 2.0


def seed_dag(jit=False, f=None):
    f = f or seed_functions()
    return {"A": Node(f["x_to_A"], ["x"], jit=jit), "B": Node(f["A_to_B"], ["A"], jit=jit),
            "C": Node(f["B_to_C"], ["B"], jit=jit), "D": Node(f["C_to_D"], ["C"], jit=jit),
            "E": Node(f["B_to_E"], ["B"], jit=jit)}


def composed(x):
    f = seed_functions()
    b = f["A_to_B"](f["x_to_A"](x))
    return {"D": f["C_to_D"](f["B_to_C"](b)), "E": f["B_to_E"](b)}


def want(o, x=X, v=V):
    """(gradient, Hessian-vector product) of output ``o`` of the composed function."""
    return jax.jvp(jax.grad(lambda x: composed(x)[o]), (x,), (v,))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_seed_dag_matches_jvp_of_grad_and_each_node_runs_once(jit):
    counted = {k: Counted(f) for k, f in seed_functions().items()}
    res = daskdag.compute_hvps(seed_dag(jit, counted), X, V, ["D", "E"])
    for o in ("D", "E"):
        grad, hvp = want(o)
        assert_tree_close(res[o].value, composed(X)[o])
        assert_tree_close(res[o].grad, grad, rtol=1e-5)
        assert_tree_close(res[o].hvp, hvp, rtol=1e-4, atol=1e-5)
        assert_tree_close(res[o].tangent, jax.jvp(lambda x: composed(x)[o], (X,), (V,))[1],
                          rtol=1e-5)
    if not jit:
        assert all(f.calls == 1 for f in counted.values())


def test_the_hessian_column_by_column_is_jax_hessian():
    f = lambda x: jnp.sum(jnp.sin(x) * jnp.roll(x, 1)) ** 2  # noqa: E731
    dag = {"A": (lambda x: jnp.sin(x) * jnp.roll(x, 1), ["x"]), "S": (lambda a: jnp.sum(a) ** 2, ["A"])}
    columns = [daskdag.compute_hvps(dag, X, e, "S").hvp for e in jnp.eye(5)]
    assert_tree_close(jnp.stack(columns, axis=1), jax.hessian(f)(X), rtol=1e-4, atol=1e-5)


def test_several_pytree_inputs_leaves_held_and_an_output_with_a_cotangent():
    def p(w, t):
        return {"y": jnp.tanh(w["a"] * t) * w["n"], "z": w["a"] ** 3}

    dag = {"P": (p, ["w", "t"]), "Q": (lambda q: q["y"] * q["z"], ["P"])}
    x = {"w": {"a": jnp.array([0.5, -1.0, 2.0]), "n": 2}, "t": jnp.array([1.0, 0.3, -0.7])}
    v = {"w": {"a": jnp.array([1.0, 0.0, -1.0]), "n": None}}  # t moves by zero
    ct = jnp.array([1.0, 2.0, -0.5])
    res = daskdag.compute_hvps(dag, x, v, "Q", cotangents={"Q": ct})

    def scalar(a, t):
        return jnp.vdot(ct, dag["Q"][0](p({"a": a, "n": 2}, t)))

    g, hv = jax.jvp(jax.grad(scalar, argnums=(0, 1)), (x["w"]["a"], x["t"]),
                    (v["w"]["a"], jnp.zeros(3)))
    assert res.grad["w"]["n"] is None and res.hvp["w"]["n"] is None
    assert_tree_close(res.grad["w"]["a"], g[0], rtol=1e-5)
    assert_tree_close(res.grad["t"], g[1], rtol=1e-5)
    assert_tree_close(res.hvp["w"]["a"], hv[0], rtol=1e-4, atol=1e-5)
    assert_tree_close(res.hvp["t"], hv[1], rtol=1e-4, atol=1e-5)


def test_an_equinox_model_s_parameters():
    model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    dag = {"Y": (lambda m, u: eqx.combine(m, static)(u)[0], ["params", "u"]),
           "L": (lambda y: (y - 1.0) ** 2, ["Y"])}
    u = jnp.array([0.1, 0.2, -0.3])
    v = jax.tree.map(jnp.ones_like, params)
    res = daskdag.compute_hvps(dag, {"params": params, "u": u}, {"params": v}, "L", wrt=["params"])
    loss = lambda m: (eqx.combine(m, static)(u)[0] - 1.0) ** 2  # noqa: E731
    g, hv = jax.jvp(jax.grad(loss), (params,), (v,))
    assert_tree_close(res.grad["params"], g, rtol=1e-5)
    assert_tree_close(res.hvp["params"], hv, rtol=1e-4, atol=1e-6)


def test_lazy_form_computes_with_other_dask_work():
    call = daskdag.hvps(seed_dag(), X, V, ["D", "E"])
    res, total = dask.compute(call, dask.delayed(sum)([1, 2]))
    assert total == 3
    assert_tree_close(res["E"].hvp, want("E")[1], rtol=1e-4, atol=1e-5)


def test_what_cannot_be_done_is_named():
    own = dict(seed_dag())
    own["B"] = Node(lambda a: np.asarray(a) ** 2 + 1.0, ["A"],
                    vjp=lambda ct, out, a: (2 * ct * np.asarray(a),))
    with pytest.raises(daskdag.DAGError, match=r"node\(s\) \['B'\] have their own derivative"):
        daskdag.compute_hvps(own, X, V, "D")
    with pytest.raises(daskdag.DAGError, match=r"wrt names node\(s\) \['B'\]: pass the "
                                               r"tangents as a dict"):
        daskdag.compute_hvps(seed_dag(), X, V, "D", wrt=["B"])  # (a node's v: test_sensitivities)
    with pytest.raises(daskdag.DAGError, match="tangent for input 'x' has shape"):
        daskdag.compute_hvps(seed_dag(), X, V[:3], "D")
    with pytest.raises(ValueError, match="output 'B' is not a real scalar"):
        daskdag.compute_hvps(seed_dag(), X, V, "B")


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_on_a_process_cluster_with_pullbacks_moved_between_workers():
    with local_client() as client:
        res = daskdag.compute_hvps(seed_dag(True), X, V, ["D", "E"], client=client)
        for o in ("D", "E"):
            assert_tree_close(res[o].hvp, want(o)[1], rtol=1e-4, atol=1e-5)
        a, b = sorted(client.scheduler_info()["workers"])
        moved, _ = compute_split(client, seed_dag(), X, ["D", "E"], a, b, field="hvp",
                                 lazy=lambda dag, x, outputs: daskdag.hvps(dag, x, V, outputs))
        for o in ("D", "E"):
            assert_tree_close(moved[o][1]["x"], want(o)[1], rtol=1e-4, atol=1e-5)


def test_a_cotangent_for_a_name_that_is_no_output_is_named():
    with pytest.raises(daskdag.DAGError, match="cotangents given for 'C'"):
        daskdag.compute_hvps(seed_dag(), X, V, "D", cotangents={"C": jnp.ones(5)})


def _unused_input_dag():
    """``y`` feeds ``B``, which no output below needs, and ``C``, which ``x`` does not reach."""
    return {"A": (jnp.sin, ["x"]), "B": (jnp.cos, ["y"]), "C": (lambda y: jnp.sum(y), ["y"]),
            "L": (lambda a: jnp.sum(a ** 2), ["A"])}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["threads", pytest.param("cluster", marks=pytest.mark.cluster)])
def test_a_free_input_no_output_needs_and_an_output_no_wrt_input_reaches(where):
    """A free input that feeds only nodes no output needs may be left out of ``x``, or given;
    an output that no ``wrt`` input reaches has a tangent of zeros, as compute_jvps gives; a
    ``v`` for an input outside ``wrt`` is ignored."""
    dag, x, v = _unused_input_dag(), jnp.array([0.5, 1.0]), jnp.ones(2)
    want = jax.jvp(jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2)), (x,), (v,))[1]
    with local_client() if where == "cluster" else contextlib.nullcontext() as client:
        left_out = daskdag.compute_hvps(dag, {"x": x}, {"x": v}, "L", client=client)
        assert_tree_close(left_out.hvp["x"], want)
        given = daskdag.compute_hvps(dag, {"x": x, "y": x}, {"x": v}, "L", client=client)
        assert_tree_close(given.hvp, {"x": want, "y": jnp.zeros(2)})
        only_x = daskdag.compute_hvps(dag, {"x": x, "y": x}, {"x": v, "y": 3 * v}, ["L", "C"],
                                      wrt=["x"], client=client)
        assert_tree_close(only_x["L"].hvp, {"x": want})
        jvp = daskdag.compute_jvps(dag, {"x": x, "y": x}, {"x": v}, "C", client=client)
        assert only_x["C"].tangent is not None
        assert_tree_close(only_x["C"].tangent, jvp.tangent)
        assert_tree_close(only_x["C"].tangent, jnp.zeros(()))
