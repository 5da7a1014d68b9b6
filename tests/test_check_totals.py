"""check_totals: the outputs' gradients against central differences of the composed DAG. It
passes where they agree (eager, jitted, pytrees, several inputs, on a cluster), names the output
and input where a node's own VJP is wrong, and runs the DAG as often as it says."""

import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import Node
from .support.clusters import local_client
from .support.numbers import RTOL64, Counted, seed_functions

X = jnp.linspace(0.1, 1.0, 5)


def seed_dag(jit=False, f=None):
    f = f or seed_functions()
    return {"A": Node(f["x_to_A"], ["x"], jit=jit), "B": Node(f["A_to_B"], ["A"], jit=jit),
            "C": Node(f["B_to_C"], ["B"], jit=jit), "D": Node(f["C_to_D"], ["C"], jit=jit),
            "E": Node(f["B_to_E"], ["B"], jit=jit)}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_agreeing_gradients_pass_and_the_dag_runs_as_often_as_documented(jit):
    counted = {k: Counted(f) for k, f in seed_functions().items()}
    found = daskdag.check_totals(seed_dag(jit, counted), X, ["D", "E", "C"])
    assert set(found) == {"D", "E", "C"} and all(0 <= r <= 9.8e-3 for r in found.values())
    if not jit:  # 1 + 2 * 2 plain evaluations, 2 under compute_grads
        assert all(f.calls == 7 for f in counted.values())


def test_a_wrong_vjp_is_named_by_output_and_input():
    dag = seed_dag()
    dag["B"] = Node(lambda a: np.asarray(a) ** 2 + 1.0, ["A"],
                    vjp=lambda ct, out, a: (3 * ct * np.asarray(a),))  # should be 2 *
    with pytest.raises(daskdag.TotalCheckError,
                       match=r"output 'D': its gradient by input 'x' disagrees.*other pair "
                             r"failed too: 'E' by 'x'") as info:
        daskdag.check_totals(dag, X, ["D", "E"])
    assert isinstance(info.value, daskdag.GradientCheckError)
    assert (info.value.output, info.value.input) == ("D", "x")
    assert info.value.error > info.value.tolerance


def test_several_pytree_inputs_with_held_leaves_and_a_pytree_output():
    def p(w, t):
        return {"y": jnp.tanh(w["a"] * t) * w["n"], "z": w["a"] ** 3, "k": w["n"]}

    dag = {"P": (p, ["w", "t"])}
    x = {"w": {"a": jnp.array([0.5, -1.0, 2.0]), "n": 2}, "t": jnp.array([1.0, 0.3, -0.7])}
    assert daskdag.check_totals(dag, x, "P")["P"] <= 9.8e-3
    with pytest.raises(daskdag.DAGError, match=r"wrt names node\(s\) \['P'\]"):
        daskdag.check_totals(dag, x, "P", wrt=["P"])


def test_a_smaller_eps_passes_where_the_default_step_crosses_a_kink(x64):
    """abs with three elements within 3e-7 of its kink at 0: the default step (6.1e-6 of the
    input's RMS magnitude) crosses it and the check fails; eps=1e-9 passes (the guides' advice);
    the step used is the one passed."""
    dag = {"A": (jnp.abs, ["x"]), "D": (lambda a: jnp.sum(a * jnp.arange(1.0, 7.0)), ["A"])}
    x = jnp.asarray([1e-7, 1.0, -2e-7, 2.0, 3e-7, -1.5])
    with pytest.raises(daskdag.TotalCheckError) as e:
        daskdag.check_totals(dag, x, "D")
    assert (e.value.output, e.value.input) == ("D", "x")
    assert e.value.eps == pytest.approx(float(np.finfo(np.float64).eps) ** (1 / 3))
    assert daskdag.check_totals(dag, x, "D", eps=1e-9)["D"] <= RTOL64
    with pytest.raises(daskdag.TotalCheckError) as e:
        daskdag.check_totals(dag, x, "D", eps=1e-3)
    assert e.value.eps == 1e-3
    assert daskdag.check_totals(dag, x + jnp.sign(x) * 0.5, "D")["D"] <= RTOL64  # (the kink's)


def slightly_wrong_dag(factor):
    """A node B whose own VJP is ``factor`` times the right one."""
    def b(a):
        return np.tanh(a) * 2 + a ** 3

    return {"A": (lambda x: jnp.sin(x) * jnp.exp(x / 4), ["x"]),
            "B": Node(b, ["A"], vjp=lambda ct, out, a: (factor * ct * (2 / np.cosh(a) ** 2
                                                                        + 3 * a ** 2),)),
            "C": (lambda b: jnp.sum(b ** 2), ["B"])}


def test_rtol_decides_what_passes(x64):
    """The whole gradient 5% off fails at the default rtol and passes at rtol=0.1, which returns
    its error, 0.05 / 1.05; 2e-6 off passes at the default and fails at rtol=1e-7."""
    x = jnp.linspace(-2.0, 2.0, 16)
    with pytest.raises(daskdag.TotalCheckError) as e:
        daskdag.check_totals(slightly_wrong_dag(1.05), x, "C")
    assert e.value.error > e.value.tolerance
    found = daskdag.check_totals(slightly_wrong_dag(1.05), x, "C", rtol=0.1)
    assert found["C"] == pytest.approx(0.05 / 1.05, rel=1e-3)
    found = daskdag.check_totals(slightly_wrong_dag(1 + 2e-6), x, "C")
    assert found["C"] == pytest.approx(2e-6, rel=1e-2)
    with pytest.raises(daskdag.TotalCheckError):
        daskdag.check_totals(slightly_wrong_dag(1 + 2e-6), x, "C", rtol=1e-7)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_on_a_process_cluster():
    with local_client() as client:
        found = daskdag.check_totals(seed_dag(), X, ["D", "E"], client=client)
        assert all(r <= 9.8e-3 for r in found.values())
