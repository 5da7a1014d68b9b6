"""Sensitivities at any node: ``wrt`` naming nodes gives d output / d node value from the same
backward pass, against ``jax.vjp`` of the sub-function from that node to the output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import DAGError, Node
from .support.numbers import Counted, assert_tree_close, seed_functions

F = seed_functions()


def seed_dag(jit=False, vmap=False):
    f = {k: Counted(v) for k, v in F.items()}
    return {"A": Node(f["x_to_A"], ["x"], jit=jit, vmap=vmap),
            "B": Node(f["A_to_B"], ["A"], jit=jit, vmap=vmap),
            "C": Node(f["B_to_C"], ["B"], jit=jit, vmap=vmap),
            "D": Node(f["C_to_D"], ["C"], jit=jit, vmap=vmap),
            "E": Node(f["B_to_E"], ["B"], jit=jit, vmap=vmap)}, f


X = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
A = F["x_to_A"](X)
B = F["A_to_B"](A)
C = F["B_to_C"](B)
TO_D = {"x": lambda x: F["C_to_D"](F["B_to_C"](F["A_to_B"](F["x_to_A"](x)))),
        "B": lambda B: F["C_to_D"](F["B_to_C"](B)), "C": F["C_to_D"]}
AT = {"x": X, "B": B, "C": C}


@pytest.mark.parametrize("jit", [False, True])
def test_gradients_at_nodes_from_the_same_backward_pass(jit):
    dag, f = seed_dag(jit)
    res = daskdag.compute_grads(dag, X, ["D", "E"], wrt=["x", "B", "C"])
    # no extra forward work (jit: traced once, on shapes)
    assert all(fn.calls + (fn.abstract if jit else 0) == 1 for fn in f.values())
    assert set(res["D"].grad) == {"x", "B", "C"}
    for name in ("x", "B", "C"):
        _, vjp = jax.vjp(TO_D[name], AT[name])
        assert_tree_close(res["D"].grad[name], vjp(1.0)[0], rtol=1e-5)
    assert_tree_close(res["E"].grad["B"], jax.grad(F["B_to_E"])(B), rtol=1e-5)
    assert_tree_close(res["E"].grad["C"], jnp.zeros_like(C))  # E does not depend on C


def test_the_output_itself_and_a_node_with_no_path():
    dag, f = seed_dag()
    res = daskdag.compute_grads(dag, X, "C", wrt=["C", "E"], cotangents={"C": jnp.arange(5.0)})
    assert_tree_close(res.grad["C"], jnp.arange(5.0))  # d C / d C applied to the seed
    assert_tree_close(res.grad["E"], jnp.zeros(()))  # no output needs E: it ran, once, for this
    assert f["B_to_E"].calls == 1 and f["C_to_D"].calls == 0


def test_nodes_alone_in_wrt_leave_the_inputs_constant():
    dag, f = seed_dag()
    res = daskdag.compute_grads(dag, X, "D", wrt="B")
    assert set(res.grad) == {"B"}
    assert_tree_close(res.grad["B"], jax.grad(TO_D["B"])(B), rtol=1e-5)
    assert f["x_to_A"].calls == 1 and f["A_to_B"].calls == 1


def test_jacobian_with_respect_to_a_node():
    dag, _ = seed_dag(jit=True)
    res = daskdag.jacobian(dag, X, ["C", "D"], wrt=["x", "B"])
    assert_tree_close(res["C"].grad["B"], jax.jacrev(F["B_to_C"])(B), rtol=1e-5)
    assert_tree_close(res["D"].grad["B"], jax.grad(TO_D["B"])(B), rtol=1e-5)
    assert_tree_close(res["C"].grad["x"], jax.jacrev(lambda x: F["B_to_C"](F["A_to_B"](F["x_to_A"](x))))(X),
                      rtol=1e-5)


@pytest.mark.parametrize("vmap", [False, True])
def test_per_item_gradients_at_a_node_in_a_sweep(vmap):
    dag, _ = seed_dag(vmap=vmap)
    xs = jnp.stack([X, X * 0.5, X + 1.0])
    res = daskdag.sweep_grads(dag, xs, "D", wrt=["x", "B"], chunk_size=2)
    Bs = jax.vmap(lambda x: F["A_to_B"](F["x_to_A"](x)))(xs)
    assert_tree_close(res.grad["B"], jax.vmap(jax.grad(TO_D["B"]))(Bs), rtol=1e-5)
    assert_tree_close(res.grad["x"], jax.vmap(jax.grad(TO_D["x"]))(xs), rtol=1e-5)


def test_a_custom_vjp_node_in_wrt():
    def bwd(res, ct):
        return (np.asarray(ct) * 2.0 * res,)

    dag = {"S": Node(fwd=lambda x: (np.asarray(x) ** 2, np.asarray(x)), bwd=bwd, deps=["x"]),
           "T": (lambda s: jnp.sum(jnp.sin(s)), ["S"])}
    res = daskdag.compute_grads(dag, X, "T", wrt=["x", "S"])
    assert_tree_close(res.grad["S"], jnp.cos(X ** 2), rtol=1e-5)
    assert_tree_close(res.grad["x"], jnp.cos(X ** 2) * 2 * X, rtol=1e-5)


def test_unknown_name_in_wrt():
    dag, _ = seed_dag()
    with pytest.raises(DAGError, match="wrt names 'Q', which is neither a given free input "
                                       r"\['x'\] nor a node"):
        daskdag.compute_grads(dag, X, "D", wrt=["Q"])


def test_gradient_at_a_node_with_integer_leaves_holds_them():
    dag = {"P": (lambda x: {"w": x * 2.0, "n": jnp.arange(3)}, ["x"]),
           "L": (lambda p: jnp.sum(p["w"] ** 2) * p["n"][2], ["P"])}
    res = daskdag.compute_grads(dag, X, "L", wrt=["P"])
    assert res.grad["P"]["n"] is None
    np.testing.assert_allclose(res.grad["P"]["w"], 2 * (X * 2.0) * 2, rtol=1e-6)


# -- forward kinds: a change added at a node ---------------------------------------------------

def _added(x, dB):
    """The seed DAG's D and E with a change ``dB`` added at B's value (what ``wrt`` naming B
    means in every kind: its gradient is the sensitivity to that change)."""
    b = F["A_to_B"](F["x_to_A"](x)) + dB
    return {"D": F["C_to_D"](F["B_to_C"](b)), "E": F["B_to_E"](b)}


VX = jnp.array([1.0, -1.0, 0.5, 0.25, 2.0])
VB = jnp.linspace(-0.3, 0.3, 5)


@pytest.mark.parametrize("jit", [False, True])
def test_jvps_with_a_tangent_added_at_a_node(jit):
    """``compute_jvps(wrt=["x", "B"])``: x's tangent pushed through, B's added at B's value:
    ``jax.jvp`` of the DAG with a change added at B, along (vx, vB); B's alone, the inputs
    held."""
    dag, _ = seed_dag(jit)
    res = daskdag.compute_jvps(dag, X, {"x": VX, "B": VB}, ["D", "E"], wrt=["x", "B"])
    _, want = jax.jvp(_added, (X, jnp.zeros(5)), (VX, VB))
    for o in "DE":
        assert_tree_close(res[o].tangent, want[o], rtol=1e-4, atol=1e-5)
    res = daskdag.compute_jvps(dag, X, {"B": VB}, "D", wrt=["B"])
    _, want = jax.jvp(lambda dB: _added(X, dB)["D"], (jnp.zeros(5),), (VB,))
    assert_tree_close(res.tangent, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(daskdag.NodeError, match=r"tangent given for this node has leaves "
                                                 r"shaped \[\(3,\)\], but its value"):
        daskdag.compute_jvps(dag, X, {"B": VX[:3]}, "D", wrt=["B"])


def test_hvps_at_a_node():
    """``compute_hvps(wrt=["x", "B"])``: gradient and Hessian-vector product of the DAG with a
    change added at B, by x and by that change, as ``jax.jvp(jax.grad(...))`` gives them."""
    dag, _ = seed_dag()
    res = daskdag.compute_hvps(dag, X, {"x": VX, "B": VB}, "D", wrt=["x", "B"])
    grad, hvp = jax.jvp(jax.grad(lambda x, dB: _added(x, dB)["D"], (0, 1)),
                        (X, jnp.zeros(5)), (VX, VB))
    for k, name in enumerate(("x", "B")):
        assert_tree_close(res.grad[name], grad[k], rtol=1e-4, atol=1e-5)
        assert_tree_close(res.hvp[name], hvp[k], rtol=1e-3, atol=1e-4)


def test_per_item_jvps_at_a_node_in_a_sweep():
    """``sweep_jvps`` with a node in ``wrt``: the node's tangent (shared) added per item."""
    dag, _ = seed_dag()
    xs = jnp.stack([X, X + 0.5, X - 0.25])
    res = daskdag.sweep_jvps(dag, xs, {"x": jnp.ones_like(xs), "B": VB}, "E", wrt=["x", "B"])
    want = jax.vmap(lambda x: jax.jvp(lambda x, dB: _added(x, dB)["E"],
                                      (x, jnp.zeros(5)), (jnp.ones(5), VB))[1])(xs)
    assert_tree_close(res.tangent, want, rtol=1e-4, atol=1e-5)
