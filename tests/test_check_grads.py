"""check_grads: each node's VJP against central differences of that node alone."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import GradientCheckError, Node, NodeError

from .support.clusters import local_client
from .support.numbers import RTOL32, RTOL64, Counted


def scaled_vjp(fn, factor):
    """``fn`` with a VJP ``factor`` times the right one."""
    wrong = jax.custom_vjp(fn)

    def fwd(*args):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp

    def bwd(vjp, g):
        return tuple(factor * c for c in vjp(g))

    wrong.defvjp(fwd, bwd)
    return wrong


def cumsum3(b):
    return jnp.cumsum(b) / 3.0


def test_nodes_off_the_gradient_path_run_once_and_are_not_checked():
    const = Counted(lambda w: jnp.cos(w))
    dag = {"K": (const, ["w"]), "A": (lambda x, k: jnp.sin(x) * k, ["x", "K"]),
           "S": (jnp.sum, ["A"])}
    inputs = {"x": jnp.linspace(0.1, 1.0, 7), "w": jnp.linspace(1.0, 2.0, 7)}
    checked = daskdag.check_grads(dag, inputs, "S", wrt=["x"])
    assert set(checked) == {"A", "S"} and const.calls == 1


@pytest.mark.parametrize("jit", [False, True])
def test_float64_pytree_with_int_leaf(x64, jit):
    def head(p):  # the int leaf is held constant: a float there would fail to index
        return jnp.tanh(p["w"][p["i"]] * p["s"])

    dag = {"A": Node(head, ["p"], jit=jit),
           "B": Node(lambda a, p: a * jnp.exp(p["w"][:3]), ["A", "p"], jit=jit),
           "C": Node(lambda b: jnp.sum(jnp.log1p(b ** 2)), ["B"], jit=jit)}
    p = {"w": jnp.linspace(-1.0, 1.5, 6), "i": jnp.array([4, 0, 2]), "s": 1.3}
    assert p["w"].dtype == jnp.float64
    checked = daskdag.check_grads(dag, p, "C")
    assert set(checked) == {"A", "B", "C"}
    assert all(r <= RTOL64 for r in checked.values()), checked


def test_wrong_vjp_is_named_not_its_neighbours(seed, x5):
    dag, _, _ = seed
    dag = {**dag, "C": (scaled_vjp(cumsum3, 2.0), ["B"])}
    with pytest.raises(GradientCheckError) as e:
        daskdag.check_grads(dag, x5, ["D", "E"])
    err = e.value
    assert (err.node, err.dep, err.position, err.others) == ("C", "B", 0, ())
    assert err.ad == pytest.approx(2 * err.fd, rel=0.02)  # the VJP's inner product is doubled
    assert err.error == pytest.approx(abs(err.fd - err.ad)) and err.error > err.tolerance
    assert err.eps == pytest.approx(float(np.finfo(np.float32).eps) ** (1 / 3))
    assert str(err).startswith("node 'C': its VJP disagrees with finite differences for dep 'B' "
                               "(position 0): <u, J v> = ")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) and (back.node, back.dep, back.fd) == (err.node, err.dep, err.fd)
    # Fixed, the same DAG passes: nothing else was wrong.
    daskdag.check_grads({**dag, "C": (cumsum3, ["B"])}, x5, ["D", "E"])


def test_wrong_cotangent_for_one_dep_of_two():
    def mul(a, b):
        return a * b

    wrong = jax.custom_vjp(mul)
    wrong.defvjp(lambda a, b: (a * b, (a, b)), lambda r, g: (g * r[1], -g * r[0]))  # b's sign
    dag = {"A": (jnp.sin, ["x"]), "B": (jnp.cos, ["x"]), "S": (wrong, ["A", "B"]),
           "T": (jnp.sum, ["S"])}
    with pytest.raises(GradientCheckError, match="node 'S': .* dep 'B' \\(position 1\\)") as e:
        daskdag.check_grads(dag, jnp.linspace(0.2, 1.2, 8), "T")
    assert e.value.ad == pytest.approx(-e.value.fd, rel=0.02)


def test_swapped_cotangents_and_every_failing_node_counted():
    def lin(a, b):
        return 2.0 * a + 5.0 * b

    swapped = jax.custom_vjp(lin)
    swapped.defvjp(lambda a, b: (lin(a, b), None), lambda _, g: (5.0 * g, 2.0 * g))
    dag = {"A": (jnp.sin, ["x"]), "S": (swapped, ["A", "x"]),
           "U": (scaled_vjp(jnp.tanh, -1.0), ["S"]), "T": (jnp.sum, ["U"])}
    with pytest.raises(GradientCheckError) as e:
        daskdag.check_grads(dag, jnp.linspace(0.2, 1.2, 8), "T")
    assert (e.value.node, e.value.dep, e.value.others) == ("S", "A", ("U",))
    assert "; 1 other node failed too: 'U'" in str(e.value)


def test_subtle_error_in_float64_is_caught(x64):
    n = 64  # a vector output: the tolerance must not grow with its size
    x = jnp.linspace(-2.0, 2.0, n)
    dag = {"A": (lambda x: jnp.sin(x) * jnp.exp(x / 4), ["x"]),
           "B": (scaled_vjp(lambda a: jnp.tanh(a) * 2 + a ** 3, 1.05), ["A"]),
           "C": (lambda b: jnp.sum(b ** 2), ["B"])}
    with pytest.raises(GradientCheckError) as e:
        daskdag.check_grads(dag, x, "C")
    assert (e.value.node, e.value.dep) == ("B", "A")
    assert e.value.ad == pytest.approx(1.05 * e.value.fd, rel=1e-4)
    ok = daskdag.check_grads({**dag, "B": (lambda a: jnp.tanh(a) * 2 + a ** 3, ["A"])}, x, "C")
    assert max(ok.values()) <= RTOL64


def test_large_float32_values_pass():
    x = jnp.float32(1e3) + jnp.arange(16, dtype=jnp.float32) * 37.1
    dag = {"A": (lambda x: x ** 2 / 1e3 + 3 * x, ["x"]),
           "B": (lambda a, x: jnp.sqrt(a) * x, ["A", "x"]),
           "C": (lambda b: jnp.sum(jnp.log(b)), ["B"])}
    checked = daskdag.check_grads(dag, x, "C")
    assert set(checked) == {"A", "B", "C"} and max(checked.values()) <= RTOL32
    with pytest.raises(GradientCheckError, match="node 'B'"):  # and a wrong VJP there still fails
        daskdag.check_grads({**dag, "B": (scaled_vjp(lambda a, x: jnp.sqrt(a) * x, 2.0),
                                          ["A", "x"])}, x, "C")


def test_complex_node():
    dag = {"A": (lambda x: jnp.exp(1j * x) * (x + 2.0), ["x"]),
           "B": (lambda a: jnp.sum(jnp.abs(a * (1 - 0.5j)) ** 2), ["A"])}
    x = jnp.linspace(0.0, 2.0, 5)
    assert max(daskdag.check_grads(dag, x, "B").values()) <= RTOL32
    with pytest.raises(GradientCheckError, match="node 'A'"):
        daskdag.check_grads({**dag, "A": (scaled_vjp(lambda x: jnp.exp(1j * x) * (x + 2.0), 1j),
                                          ["x"])}, x, "B")


# abs, with three elements within 3e-7 of its kink at 0, among others of size 1 to 2
KINKED = [1e-7, 1.0, -2e-7, 2.0, 3e-7, -1.5]
KINK_DAG = {"A": (jnp.abs, ["x"]), "D": (lambda a: jnp.sum(a * jnp.arange(1.0, 7.0)), ["A"])}


def test_a_smaller_eps_passes_where_the_default_step_crosses_a_kink(x64):
    """The guides: a non-smooth node may fail where the step crosses a kink; pass a smaller eps.
    The default step (6.1e-6 of the leaf's RMS magnitude, 1.3) crosses 0 at the three small
    elements, and the check fails; eps=1e-9 stays on their side of it and passes. The step used
    is the one passed (a larger one fails too, and says so)."""
    x = jnp.asarray(KINKED)
    with pytest.raises(GradientCheckError) as e:
        daskdag.check_grads(KINK_DAG, x, "D")
    assert (e.value.node, e.value.dep) == ("A", "x")
    assert e.value.eps == pytest.approx(float(np.finfo(np.float64).eps) ** (1 / 3))
    checked = daskdag.check_grads(KINK_DAG, x, "D", eps=1e-9)
    assert set(checked) == {"A", "D"} and max(checked.values()) <= RTOL64
    with pytest.raises(GradientCheckError) as e:
        daskdag.check_grads(KINK_DAG, x, "D", eps=1e-3)
    assert e.value.node == "A" and e.value.eps == 1e-3
    # Away from the kink the default passes: the failure was the kink's.
    daskdag.check_grads(KINK_DAG, x + jnp.sign(x) * 0.5, "D")


def slightly_wrong_dag(factor):
    """A node B whose VJP is ``factor`` times the right one, between two right ones."""
    return {"A": (lambda x: jnp.sin(x) * jnp.exp(x / 4), ["x"]),
            "B": (scaled_vjp(lambda a: jnp.tanh(a) * 2 + a ** 3, factor), ["A"]),
            "C": (lambda b: jnp.sum(b ** 2), ["B"])}


def test_rtol_decides_what_passes(x64):
    """A VJP 5% off fails at the default rtol (1.2e-5 in float64) and passes at rtol=0.1, which
    returns its error, 0.05 / 1.05; one 2e-6 off passes at the default and fails at 1e-7."""
    x = jnp.linspace(-2.0, 2.0, 16)
    with pytest.raises(GradientCheckError, match="node 'B'") as e:
        daskdag.check_grads(slightly_wrong_dag(1.05), x, "C")
    assert e.value.error > e.value.tolerance
    found = daskdag.check_grads(slightly_wrong_dag(1.05), x, "C", rtol=0.1)
    assert found["B"] == pytest.approx(0.05 / 1.05, rel=1e-3)
    assert max(found["A"], found["C"]) <= RTOL64
    found = daskdag.check_grads(slightly_wrong_dag(1 + 2e-6), x, "C")
    assert found["B"] == pytest.approx(2e-6, rel=1e-2) and max(found.values()) <= RTOL64
    with pytest.raises(GradientCheckError, match="node 'B'") as e:
        daskdag.check_grads(slightly_wrong_dag(1 + 2e-6), x, "C", rtol=1e-7)
    assert e.value.others == ()  # (A and C, right, still pass)


def test_a_node_that_raises_is_a_node_error(seed, x5):
    dag, _, _ = seed

    def broken(b):
        raise ZeroDivisionError("boom")

    with pytest.raises(NodeError, match="node 'C' failed in its forward pass") as e:
        daskdag.check_grads({**dag, "C": (broken, ["B"])}, x5, "D")
    assert e.value.node == "C" and isinstance(e.value.__cause__, ZeroDivisionError)

    def bad_bwd(_, g):
        raise ValueError("no backward")

    no_vjp = jax.custom_vjp(cumsum3)
    no_vjp.defvjp(lambda b: (cumsum3(b), None), bad_bwd)
    with pytest.raises(NodeError, match="node 'C' failed in its backward pass"):
        daskdag.check_grads({**dag, "C": (no_vjp, ["B"])}, x5, "D")


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_on_a_cluster(seed, x5):
    pytest.importorskip("distributed")
    dag, _, _ = seed
    with local_client() as client:
        checked = daskdag.check_grads(dag, x5, ["D", "E"], client=client)
        assert set(checked) == set("ABCDE") and max(checked.values()) <= RTOL32
        with pytest.raises(GradientCheckError) as e:
            daskdag.check_grads({**dag, "C": (scaled_vjp(cumsum3, 2.0), ["B"])}, x5, ["D", "E"],
                                client=client)
        assert (e.value.node, e.value.dep, e.value.others) == ("C", "B", ())
