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


def _sum_sin2(x):
    return jnp.sum(jnp.sin(x) ** 2)


_T = jnp.array([1.0, -0.5, 2.0])
_XS = jnp.arange(6.0).reshape(2, 3) / 4
# entry point -> (call with the one input x given as `x`, its plain-JAX reference at X, or None:
# a check that returns its errors, each within rtol)
ONE_INPUT_CALLS = {
    "compute_grads": (lambda dag, x: daskdag.compute_grads(dag, x, "L").grad, jax.grad(_sum_sin2)(X)),
    "grads": (lambda dag, x: daskdag.grads(dag, x, "L").compute().grad, jax.grad(_sum_sin2)(X)),
    "jacobian": (lambda dag, x: daskdag.jacobian(dag, x, "A").grad, jax.jacrev(jnp.sin)(X)),
    "jacobians": (lambda dag, x: daskdag.jacobians(dag, x, "A").compute().grad,
                  jax.jacrev(jnp.sin)(X)),
    "compute_jvps": (lambda dag, x: daskdag.compute_jvps(dag, x, _T, "L").tangent,
                     jax.jvp(_sum_sin2, (X,), (_T,))[1]),
    "jvps": (lambda dag, x: daskdag.jvps(dag, x, _T, "L").compute().tangent,
             jax.jvp(_sum_sin2, (X,), (_T,))[1]),
    "compute_hvps": (lambda dag, x: daskdag.compute_hvps(dag, x, _T, "L").hvp,
                     jax.jvp(jax.grad(_sum_sin2), (X,), (_T,))[1]),
    "hvps": (lambda dag, x: daskdag.hvps(dag, x, _T, "L").compute().hvp,
             jax.jvp(jax.grad(_sum_sin2), (X,), (_T,))[1]),
    "sweep_grads": (lambda dag, x: daskdag.sweep_grads(dag, jax.tree.map(lambda a: _XS, x),
                                                       "L").grad,
                    jax.vmap(jax.grad(_sum_sin2))(_XS)),
    "check_grads": (lambda dag, x: daskdag.check_grads(dag, x, "L"), None),
    "check_totals": (lambda dag, x: daskdag.check_totals(dag, x, "L"), None),
    "value_and_grad": (lambda dag, x: daskdag.value_and_grad(dag, "L")(x)[1],
                       jax.grad(_sum_sin2)(X)),
    "value_and_jacobian": (lambda dag, x: daskdag.value_and_jacobian(dag, "A")(x)[1],
                           jax.jacrev(jnp.sin)(X)),
    "value_and_jvp": (lambda dag, x: daskdag.value_and_jvp(dag, "L")(x, _T)[1],
                      jax.jvp(_sum_sin2, (X,), (_T,))[1]),
    "value_grad_and_hvp": (lambda dag, x: daskdag.value_grad_and_hvp(dag, "L")(x, _T)[2],
                           jax.jvp(jax.grad(_sum_sin2), (X,), (_T,))[1]),
}


def _one_input_dag():
    sin = Counted(jnp.sin)
    return {"A": (sin, ["x"]), "L": (lambda a: jnp.sum(a ** 2), ["A"])}, sin


@pytest.mark.parametrize("call", ONE_INPUT_CALLS)
def test_one_free_input_given_by_name_or_under_a_wrong_name(call):
    """With one free input, every call takes its value itself or the ``{input_name: value}``
    form (a dict with the input's name as a key), the same; a dict of one array under another
    name is refused, naming the input, before any node runs."""
    run, want = ONE_INPUT_CALLS[call]
    dag, sin = _one_input_dag()
    for x in (X, {"x": X}):
        got = run(dag, x)
        if want is None:
            assert all(e <= 1e-4 for e in got.values()), got
        else:
            assert_tree_close(got, want, rtol=1e-5, atol=1e-6)
    dag, sin = _one_input_dag()
    with pytest.raises(DAGError, match="this DAG's one free input is 'x'; you passed \\{'y': "
                                       "\\.\\.\\.\\}: one array under the name 'y'"):
        run(dag, {"y": X})
    assert sin.calls == sin.abstract == 0


def test_a_dict_is_the_one_input_s_value_unless_it_names_the_input():
    """The two readings of a dict given for a DAG's one free input ``p``: its value (a pytree
    the nodes index), or the ``{input_name: value}`` form when ``p`` is one of its keys; a
    dict that reads as values for other names (nodes, or one array under another name) is
    refused, and its message says how to give it as the value."""
    W, b = jnp.array([0.5, -1.0, 2.0]), jnp.array(0.25)
    loss = lambda p: jnp.sum(jnp.tanh(p["w"] * X)) + p["b"] ** 2  # noqa: E731
    dag = {"L": (loss, ["p"])}
    params = {"w": W, "b": b}
    for given in (params, {"p": params}):
        assert_tree_close(daskdag.compute_grads(dag, given, "L").grad, jax.grad(loss)(params))
    # A dict of one dict (flax's {"params": ...}) is the value too.
    nested = lambda v: loss(v["params"])  # noqa: E731
    r = daskdag.compute_grads({"L": (nested, ["p"])}, {"params": params}, "L")
    assert_tree_close(r.grad, jax.grad(nested)({"params": params}))
    # One array under another name reads as a misnamed input; named, it is the value.
    one = lambda p: jnp.sum(jnp.tanh(p["w"] * X))  # noqa: E731
    with pytest.raises(DAGError, match="one free input is 'p'; you passed \\{'w': \\.\\.\\.\\}.*"
                                       "pass \\{'p': \\{'w': \\.\\.\\.\\}\\}"):
        daskdag.compute_grads({"L": (one, ["p"])}, {"w": W}, "L")
    r = daskdag.compute_grads({"L": (one, ["p"])}, {"p": {"w": W}}, "L")
    assert_tree_close(r.grad, jax.grad(one)({"w": W}))
    # Keys that are all node names read as values for nodes; named, the dict is the value.
    by_node = {"A": (lambda p: p["A"] * p["B"], ["p"]), "B": (lambda a: jnp.sum(a), ["A"])}
    values = {"A": W, "B": W}
    with pytest.raises(DAGError, match="one free input is 'p'; you passed \\{'A': \\.\\.\\., "
                                       "'B': \\.\\.\\.\\}: 'A', 'B' are nodes of the DAG"):
        daskdag.compute_grads(by_node, values, "B")
    r = daskdag.compute_grads(by_node, {"p": values}, "B")
    assert_tree_close(r.grad, jax.grad(lambda p: jnp.sum(p["A"] * p["B"]))(values))
    # The named form gives the one input and nothing else.
    with pytest.raises(DAGError, match="one free input is 'p'; x gives a value for 'q' too, "
                                       "which is not a free input"):
        daskdag.compute_grads(dag, {"p": params, "q": W}, "L")
    with pytest.raises(DAGError, match="one free input is 'x'; tangents give a tangent for 'y' "
                                       "too"):
        daskdag.compute_jvps(_one_input_dag()[0], X, {"x": _T, "y": _T}, "L")


def test_a_misspelt_dep_gets_did_you_mean():
    """A dep misspelt becomes a free input: the error for its missing value names the node
    that names it, the node meant, and that the node meant is then left out."""
    G = Counted(jnp.sin)
    dag = {"G": (G, ["x"]), "H": (lambda g: jnp.sum(g ** 2), ["Gg"])}
    with pytest.raises(DAGError, match="2 free inputs \\['x', 'Gg'\\]: pass x as a dict.*node "
                                       "'H' names dep 'Gg', which is no node, so it is a free "
                                       "input: did you mean 'G'\\? As it is, node 'G' is "
                                       "unused: no node takes it as a dep"):
        daskdag.compute_grads(dag, X, "H")
    with pytest.raises(DAGError, match="no value for input 'Gg' \\(used by \\['H'\\]\\); x has "
                                       "\\['x'\\]; node 'H' names dep 'Gg'.*did you mean 'G'\\?"):
        daskdag.compute_grads(dag, {"x": X}, "H")
    assert G.calls == G.abstract == 0
    # The node meant feeds another node, but none of the outputs asked for.
    dag = {"G": (jnp.sin, ["x"]), "K": (jnp.sum, ["G"]),
           "H": (lambda g, x: jnp.sum(g * x), ["Gg", "x"])}
    with pytest.raises(DAGError, match="did you mean 'G'\\? As it is, node 'G' is used by none "
                                       "of the outputs \\['H'\\]"):
        daskdag.compute_grads(dag, {"x": X}, "H")
    # A misspelt input.
    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a, x: jnp.sum(a * x), ["A", "xx"])}
    with pytest.raises(DAGError, match="no value for input 'xx'.*node 'B' names dep 'xx': did "
                                       "you mean input 'x'\\?"):
        daskdag.compute_grads(dag, {"x": X}, "B")
