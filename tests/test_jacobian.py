"""daskdag.jacobian against jax.jacrev of the composed function: vector and pytree outputs and
inputs, eager, jitted and mixed nodes, chunked rows, each node called once, clear errors, and
on a process cluster with the pullbacks moved between workers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import Node
from .support.clusters import compute_split, local_client
from .support.numbers import Counted, assert_tree_close

W = jnp.asarray(np.random.default_rng(0).standard_normal((6, 6)).astype(np.float32) / 3)


def branch(h):
    if jnp.sum(h) > 0:  # Python control flow on a value: eager only
        return jnp.tanh(h)
    return jnp.sin(h)


FUNCTIONS = {"A": lambda x: jnp.tanh(W @ x), "B": branch, "C": lambda b, a: (b * a)[:4] ** 2,
             "D": lambda c: jnp.cumsum(c) + jnp.sum(c)}


def chain(jit: bool, counted: dict | None = None):
    f = counted or FUNCTIONS
    return {"A": Node(f["A"], ["x"], jit=jit), "B": Node(f["B"], ["A"]),
            "C": Node(f["C"], ["B", "A"], jit=jit), "D": Node(f["D"], ["C"], jit=jit)}


def composed(x):
    a = FUNCTIONS["A"](x)
    c = FUNCTIONS["C"](FUNCTIONS["B"](a), a)
    return {"A": a, "C": c, "D": FUNCTIONS["D"](c)}


X = jnp.linspace(-1.0, 1.5, 6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("chunk_size", [None, 3], ids=["all-rows", "chunks-of-3"])
def test_jacobians_of_several_outputs_match_jacrev_and_each_node_runs_once(jit, chunk_size):
    counted = {k: Counted(v) for k, v in FUNCTIONS.items()}
    res = daskdag.jacobian(chain(jit, counted), X, ["A", "C", "D"], chunk_size=chunk_size)
    for o in ("A", "C", "D"):
        assert_tree_close(res[o].value, composed(X)[o], rtol=1e-5)
        assert_tree_close(res[o].grad, jax.jacrev(lambda x: composed(x)[o])(X), rtol=1e-5)
    assert all(f.calls == 1 for k, f in counted.items() if not jit or k == "B")  # eager: once
    # mode="auto" counts the outputs' elements by tracing the nodes on shapes (B cannot be).
    assert all(f.abstract <= 1 for k, f in counted.items() if not jit or k == "B")


def test_a_scalar_output_s_jacobian_is_its_gradient_and_an_unused_input_gets_zeros():
    dag = {"S": (lambda x: jnp.sum(jnp.sin(x) ** 2), ["x"]), "T": (lambda y: y * 2.0, ["y"])}
    x, y = jnp.arange(3.0), jnp.ones((2, 2))
    res = daskdag.jacobian(dag, {"x": x, "y": y}, ["S", "T"])
    assert_tree_close(res["S"].grad["x"], jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(x))
    assert_tree_close(res["S"].grad["y"], jnp.zeros((2, 2)))
    assert_tree_close(res["T"].grad["y"], jax.jacrev(lambda y: y * 2.0)(y))
    assert res["T"].grad["x"].shape == (2, 2, 3) and not np.any(res["T"].grad["x"])


def test_pytree_inputs_and_outputs_have_jacrev_s_layout():
    """A dict input with an integer leaf (held constant: None), a tuple output with an integer
    leaf (None), a matrix leaf: jacrev's output-of-input structure, leaves shaped
    output_leaf.shape + input_leaf.shape."""
    def enc(p):
        return {"h": jnp.tanh(p["w"] @ p["b"]), "n": p["n"] + 1}

    def heads(e):
        return (e["h"][:2] * 3.0, jnp.outer(e["h"], e["h"]), e["n"])

    p = {"w": jnp.arange(12.0).reshape(3, 4) / 10, "b": jnp.linspace(0.0, 1.0, 4), "n": jnp.int32(2)}
    res = daskdag.jacobian({"E": (enc, ["p"]), "H": (heads, ["E"])}, p, "H")
    floats = {"w": p["w"], "b": p["b"]}
    want = jax.jacrev(lambda f: heads(enc({**f, "n": p["n"]}))[:2])(floats)
    got = res.grad
    assert isinstance(got, tuple) and len(got) == 3 and got[2] is None
    for k in (0, 1):
        assert got[k]["n"] is None
        assert_tree_close({n: got[k][n] for n in floats}, want[k], rtol=1e-5)
    assert got[1]["w"].shape == (3, 3, 3, 4)


def test_a_complex_output_is_named():
    with pytest.raises(ValueError, match="output 'C' is complex.*jax.jacrev"):
        daskdag.jacobian({"C": (lambda x: x * (1 + 2j), ["x"])}, jnp.ones(3), "C")


def test_bad_chunk_size_is_named():
    with pytest.raises(daskdag.DAGError, match="chunk_size must be a positive integer, got 0"):
        daskdag.jacobian(chain(False), X, "D", chunk_size=0)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_on_a_process_cluster_with_pullbacks_moved_between_workers():
    with local_client() as client:
        res = daskdag.jacobian(chain(True), X, ["C", "D"], client=client)
        for o in ("C", "D"):
            assert_tree_close(res[o].grad, jax.jacrev(lambda x: composed(x)[o])(X), rtol=1e-5)
        a, b = sorted(client.scheduler_info()["workers"])
        moved, _ = compute_split(client, chain(False), X, ["C", "D"], a, b, lazy=daskdag.jacobians)
        for o in ("C", "D"):
            assert_tree_close(moved[o][1]["x"], jax.jacrev(lambda x: composed(x)[o])(X), rtol=1e-5)


def test_several_inputs_and_a_pytree_output_have_jacrev_s_layout():
    """With several free inputs, the Jacobian of a pytree output is the output's structure of
    ``{input: ...}``, as ``jax.jacrev`` of a function of the dict of inputs gives it."""
    def p(x, t):
        return {"s": jnp.sum(x * t), "v": x * 2.0}

    dag = {"P": (p, ["x", "t"])}
    inputs = {"x": jnp.array([1.0, 2.0]), "t": jnp.array([3.0, 4.0])}
    res = daskdag.jacobian(dag, inputs, "P")
    want = jax.jacrev(lambda d: p(d["x"], d["t"]))(inputs)
    assert jax.tree.structure(res.grad) == jax.tree.structure(want)
    assert_tree_close(res.grad, want)


# -- scalar leaves ---------------------------------------------------------------------------------

def _sparse_sparsities(rows: int, widths: dict) -> list:
    """The sparsity arguments to try: none, detected, and given (every entry may be nonzero)."""
    given = {i: np.ones((rows, w), bool) for i, w in widths.items()}
    return [None, "detect", given if len(given) > 1 else next(iter(given.values()))]


@pytest.mark.parametrize("mode", ["rev", "fwd", "auto"])
def test_a_jacobian_between_scalars_is_jacrev_s_scalar(mode):
    """A scalar output of a scalar input: a ``()`` Jacobian as jax.jacrev gives it, dense or
    sparse, with a pattern detected or given, and through value_and_jacobian."""
    dag = {"y": (lambda x: jnp.sin(x) * 2.0, ["x"])}
    x = jnp.asarray(0.5)
    want = jax.jacrev(lambda x: jnp.sin(x) * 2.0)(x)
    assert want.shape == ()
    for sparsity in _sparse_sparsities(1, {"x": 1}):
        res = daskdag.jacobian(dag, x, "y", mode=mode, sparsity=sparsity)
        assert res.grad.shape == () and res.value.shape == ()
        assert_tree_close(res.grad, want)
        res = daskdag.jacobian(dag, x, "y", mode=mode, sparsity=sparsity, sparse=True)
        assert res.grad.shape == (1, 1)
        np.testing.assert_allclose(res.grad.toarray(), [[want]], rtol=1e-6)
    value, jac = daskdag.value_and_jacobian(dag, "y", mode=mode)(x)
    assert_tree_close(value, jnp.sin(x) * 2.0)
    assert jac.shape == () and np.allclose(jac, want)


@pytest.mark.parametrize("mode", ["rev", "fwd", "auto"])
def test_scalar_leaves_of_pytree_inputs_and_outputs_have_jacrev_s_layout(mode):
    """A scalar input beside a vector one, and an output pytree with a scalar leaf beside a
    vector one: each block laid out as jax.jacrev gives it (scalar by scalar: ``()``)."""
    def p(a, s):
        return {"t": jnp.sum(a) * s, "v": a * s}

    dag = {"y": (lambda a, s: jnp.sum(a) * s, ["a", "s"]), "P": (p, ["a", "s"])}
    inputs = {"a": jnp.arange(3.0), "s": jnp.asarray(2.0)}
    want = {"y": jax.jacrev(lambda d: jnp.sum(d["a"]) * d["s"])(inputs),
            "P": jax.jacrev(lambda d: p(d["a"], d["s"]))(inputs)}
    assert want["y"]["s"].shape == () and want["P"]["t"]["s"].shape == ()
    for sparsity in _sparse_sparsities(1, {"a": 3, "s": 1}):
        res = daskdag.jacobian(dag, inputs, "y", mode=mode, sparsity=sparsity)
        assert_tree_close(res.grad, want["y"])
    res = daskdag.jacobian(dag, inputs, ["y", "P"], mode=mode)
    for o in ("y", "P"):
        assert jax.tree.structure(res[o].grad) == jax.tree.structure(want[o])
        assert_tree_close(res[o].grad, want[o])
    detected = daskdag.jacobian(dag, inputs, ["y", "P"], mode=mode, sparsity="detect")
    assert_tree_close(detected["P"].grad, want["P"])
    sparse = daskdag.jacobian(dag, inputs, "y", mode=mode, sparse=True)
    np.testing.assert_allclose(sparse.grad["s"].toarray(), [[want["y"]["s"]]])
    np.testing.assert_allclose(sparse.grad["a"].toarray(), [want["y"]["a"]])
    values, jacs = daskdag.value_and_jacobian(dag, ["y", "P"], mode=mode)(inputs)
    assert_tree_close(jacs["y"], want["y"])
    assert_tree_close(jacs["P"], want["P"])
