"""Every user error names what it concerns; node failures keep the original as __cause__. (A node
that raises KeyboardInterrupt or SystemExit, and Ctrl-C: test_interrupts.py.)"""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import DAGError, Node, NodeError
from .support.numbers import Counted, assert_tree_close

X = jnp.arange(3.0)
ok = lambda a: a * 2


@pytest.mark.parametrize("dag, match", [
    ([("A", ok)], "must be a dict"),
    ({}, "empty"),
    ({1: (ok, ["x"])}, "node names must be strings, got 1"),
    ({"A": ok}, "node 'A': expected \\(fn, \\[deps\\]\\)"),
    ({"A": (ok, ["x"], 3)}, "node 'A': expected"),
    ({"A": ("not callable", ["x"])}, "node 'A': fn is not callable"),
    ({"A": (ok, "x")}, "node 'A': deps must be a list of names.*did you mean \\['x'\\]"),
    ({"A": (ok, ["x", 2])}, "node 'A': dep 2 is not a string"),
    ({"A": Node(ok, [None])}, "node 'A': dep None is not a string"),
])
def test_malformed_dag(dag, match):
    with pytest.raises(DAGError, match=match):
        daskdag.compute_grads(dag, X, "A")


def test_cycle_shows_its_path():
    dag = {"A": (ok, ["x", "C"]), "B": (ok, ["A"]), "C": (ok, ["B"]), "D": (ok, ["C"])}
    with pytest.raises(DAGError, match="cycle") as e:
        daskdag.compute_grads(dag, X, "D")
    path = str(e.value).split(": ", 1)[1].split(" (")[0].split(" -> ")
    assert path[0] == path[-1] and set(path) == {"A", "B", "C"}
    for a, b in zip(path, path[1:]):  # each feeds the next
        assert a in dag[b][1]


def test_self_loop():
    with pytest.raises(DAGError, match="cycle: A -> A"):
        daskdag.compute_grads({"A": (ok, ["A"])}, X, "A")


def test_unknown_output():
    dag = {"A": (ok, ["x"])}
    with pytest.raises(DAGError, match="output 'Z' is not a node of the DAG"):
        daskdag.compute_grads(dag, X, ["A", "Z"])
    with pytest.raises(DAGError, match="output 'x' is a free input, not a node"):
        daskdag.compute_grads(dag, X, "x")
    with pytest.raises(DAGError, match="no outputs"):
        daskdag.compute_grads(dag, X, [])


def test_missing_and_unknown_input_values():
    dag = {"A": (lambda x, w: x * w, ["x", "w"]), "B": (jnp.sum, ["A"])}
    with pytest.raises(DAGError, match="no value for input 'w' \\(used by \\['A'\\]\\)"):
        daskdag.compute_grads(dag, {"x": X}, "B")
    with pytest.raises(DAGError, match="'q', which is not a free input"):
        daskdag.compute_grads(dag, {"x": X, "w": X, "q": X}, "B")
    with pytest.raises(DAGError, match="2 free inputs \\['x', 'w'\\]: pass x as a dict"):
        daskdag.compute_grads(dag, X, "B")


def test_bad_wrt():
    dag = {"A": (lambda x, i: jnp.sum(x[i]), ["x", "i"])}
    inputs = {"x": X, "i": jnp.array([0, 1])}
    with pytest.raises(DAGError, match="wrt names 'z', which is neither a given free input .* nor a node"):
        daskdag.compute_grads(dag, inputs, "A", wrt=["z"])
    with pytest.raises(DAGError, match="wrt names input 'i', which has no floating-point array leaf"):
        daskdag.compute_grads(dag, inputs, "A", wrt=["i"])
    with pytest.raises(DAGError, match="no input to differentiate: none of .* has a floating-point"):
        daskdag.compute_grads({"A": (ok, ["n"])}, jnp.arange(3), "A")


def test_non_scalar_output_needs_a_cotangent():
    dag = {"A": (jnp.sin, ["x"])}
    with pytest.raises(ValueError, match="output 'A' is not a real scalar: it is an array of "
                                         "shape \\(3,\\).*cotangents=\\{'A': ct\\}"):
        daskdag.compute_grads(dag, X, "A")
    with pytest.raises(ValueError, match="cotangent for output 'A' is an array of shape \\(2,\\)"):
        daskdag.compute_grads(dag, X, "A", cotangents={"A": jnp.ones(2)})
    with pytest.raises(DAGError, match="cotangents given for 'B', which is not a requested output"):
        daskdag.compute_grads(dag, X, "A", cotangents={"B": 1.0})


def test_node_exception_names_the_node_and_keeps_the_cause():
    def bad(a):
        raise ZeroDivisionError("boom")

    dag = {"A": (ok, ["x"]), "B": (bad, ["A"]), "C": (jnp.sum, ["B"])}
    with pytest.raises(NodeError, match="node 'B' failed in its forward pass: ZeroDivisionError: boom") as e:
        daskdag.compute_grads(dag, X, "C")
    assert e.value.node == "B" and isinstance(e.value.__cause__, ZeroDivisionError)

    again = pickle.loads(pickle.dumps(e.value))  # travels back from distributed workers intact
    assert again.node == "B" and isinstance(again.__cause__, ZeroDivisionError)


def test_concretization_error_gets_a_hint():
    dag = {"A": (lambda x: x * float(x[0]), ["x"]), "B": (jnp.sum, ["A"])}
    with pytest.raises(NodeError, match="(?s)node 'A'.*ConcretizationTypeError.*its own VJP, daskdag\\.Node\\(fwd="):
        daskdag.compute_grads(dag, X, "B")
    dag = {"A": (lambda x: jnp.asarray(np.asarray(x)), ["x"]), "B": (jnp.sum, ["A"])}
    with pytest.raises(NodeError, match="(?s)node 'A'.*TracerArrayConversionError.*its own VJP, daskdag\\.Node\\(fwd="):
        daskdag.compute_grads(dag, X, "B")


def branchy(x):
    if x[0] > 0:  # Python control flow on a value: fine eagerly, not when traced by jax.jit
        return jnp.sin(x)
    return jnp.cos(x)


def test_control_flow_under_jit_hints_to_drop_jit():
    dag = {"A": Node(branchy, ["x"], jit=True), "B": (jnp.sum, ["A"])}
    with pytest.raises(NodeError, match="(?s)node 'A'.*TracerBoolConversionError.*Hint: .*drop jit=True") as e:
        daskdag.compute_grads(dag, X, "B")
    assert isinstance(e.value.__cause__, jax.errors.TracerBoolConversionError)
    # as the hint says: the same node without jit=True works
    dag["A"] = Node(branchy, ["x"])
    assert_tree_close(daskdag.compute_grads(dag, X, "B").grad, jax.grad(lambda x: jnp.sum(branchy(x)))(X))


@pytest.mark.parametrize("deps", [["x"], ["i"]], ids=["differentiated", "constant"])
def test_node_returning_none_is_named(deps):
    forgot_return = Counted(lambda a: None)
    after = Counted(lambda x, i, a: jnp.sum(x))
    dag = {"A": (forgot_return, deps), "B": (after, ["x", "i", "A"])}
    with pytest.raises(NodeError, match="node 'A' failed in its forward pass: TypeError: its "
                                        "function returned None; a node must return its value") as e:
        daskdag.compute_grads(dag, {"x": X, "i": jnp.arange(2)}, "B", wrt=["x"])
    assert e.value.node == "A" and forgot_return.calls == 1 and after.calls == 0
    with pytest.raises(NodeError, match="node 'A'.*returned None"):  # as an output too
        daskdag.compute_grads(dag, {"x": X, "i": jnp.arange(2)}, "A", wrt=["x"])


def test_complex_cotangent_for_a_real_output_is_refused():
    dag = {"A": (jnp.sin, ["x"])}
    with pytest.raises(ValueError, match="cotangent for output 'A' is complex.*but the output is "
                                         "real.*imaginary part would be dropped"):
        daskdag.compute_grads(dag, X, "A", cotangents={"A": jnp.ones(3) * (1 + 2j)})
    # a complex output takes it: the gradient is jax.vjp's
    dag = {"A": (lambda x: jnp.exp(1j * x), ["x"])}
    ct = jnp.ones(3) * (1 + 2j)
    got = daskdag.compute_grads(dag, X, "A", cotangents={"A": ct}).grad
    assert_tree_close(got, jax.vjp(lambda x: jnp.exp(1j * x), X)[1](ct)[0])


def test_progress_bar_on_threads(capsys):
    dag = {"A": (jnp.sin, ["x"]), "B": (jnp.sum, ["A"])}
    daskdag.compute_grads(dag, X, "B")
    assert capsys.readouterr().out == ""
    res = daskdag.compute_grads(dag, X, "B", progress=True)
    assert "100% Completed" in capsys.readouterr().out  # dask.diagnostics.ProgressBar's
    assert_tree_close(res.grad, jnp.cos(X))
