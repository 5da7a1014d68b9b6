"""Nodes outside JAX with the user's own VJP (daskdag.custom): SciPy and NumPy code inside a JAX
DAG, against the same DAG written in JAX; Jacobians and sweeps through them; their pullbacks
moved to another worker of a cluster that cannot import this module; bad rules named."""

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import daskdag
from daskdag import DAGError, Node, NodeError
from .support.clusters import RunLog, compute_split, live_workers
from .support.numbers import Counted, assert_tree_close

N = 4


# -- a linear solve in SciPy (fwd/bwd form) -------------------------------------------------------

class Solved(NamedTuple):  # residuals of the user's own class: they travel by value
    lu: tuple
    x: np.ndarray


def solve_fwd(A, b):
    assert isinstance(A, np.ndarray) and isinstance(b, np.ndarray)  # values, never tracers
    lu = scipy.linalg.lu_factor(A)
    x = scipy.linalg.lu_solve(lu, b)
    return x, Solved(lu, x)


def solve_bwd(res, ct):
    assert isinstance(ct, np.ndarray)
    g = scipy.linalg.lu_solve(res.lu, ct, trans=1)  # A^T g = ct
    return -np.outer(g, res.x), g


def make_A(w):
    return jnp.eye(N) * 4.0 + jnp.reshape(w[:N * N], (N, N)) * 0.5


def make_b(w):
    return jnp.sin(w[N * N:])


def solve_dag(**solve):
    return {"A": (make_A, ["w"]), "b": (make_b, ["w"]),
            "x": Node(deps=["A", "b"], **solve),
            "L": (lambda x: jnp.sum(x ** 2) + x[0], ["x"]),
            "M": (lambda x, b: jnp.dot(x, b), ["x", "b"])}


def solve_jax(w):
    x = jnp.linalg.solve(make_A(w), make_b(w))
    return {"x": x, "L": jnp.sum(x ** 2) + x[0], "M": jnp.dot(x, make_b(w))}


W = jnp.linspace(-0.8, 1.1, N * N + N, dtype=jnp.float32)


def solve_vjp(ct, x, A, b):
    g = scipy.linalg.solve(A.T, ct)
    return -np.outer(g, x), g


FORMS = {"fwd/bwd": dict(fwd=solve_fwd, bwd=solve_bwd),
         "vjp=": dict(fn=lambda A, b: scipy.linalg.solve(A, b), vjp=solve_vjp)}


@pytest.mark.parametrize("form", FORMS)
def test_scipy_solve_inside_a_jax_dag_matches_the_jax_dag(form):
    fwd = Counted(FORMS[form].get("fwd") or FORMS[form]["fn"])
    rules = {**FORMS[form], ("fwd" if "fwd" in FORMS[form] else "fn"): fwd}
    res = daskdag.compute_grads(solve_dag(**rules), W, ["L", "M"])
    assert fwd.calls == 1  # once, for both outputs
    for o in ("L", "M"):
        value, grad = jax.value_and_grad(lambda w: solve_jax(w)[o])(W)
        assert_tree_close(res[o].value, value, rtol=1e-5)
        assert_tree_close(res[o].grad, grad, rtol=1e-4, atol=1e-6)


def test_jacobian_through_a_user_vjp_goes_row_by_row():
    calls = []

    def bwd(res, ct):
        calls.append(type(ct))
        return solve_bwd(res, ct)

    res = daskdag.jacobian(solve_dag(fwd=solve_fwd, bwd=bwd), W, ["x", "L"], chunk_size=3)
    assert_tree_close(res["x"].grad, jax.jacrev(lambda w: solve_jax(w)["x"])(W), rtol=1e-4, atol=1e-6)
    assert_tree_close(res["L"].grad, jax.grad(lambda w: solve_jax(w)["L"])(W), rtol=1e-4, atol=1e-6)
    assert calls == [np.ndarray] * (N + 1)  # each row once, as NumPy, never a tracer


# -- an explicit Euler loop in NumPy (fn with vjp=), item by item and vectorized ------------------

STEPS, H = 40, 0.05


def euler(y0, k):
    """y' = -k * y**3 + sin(y), integrated with explicit Euler in NumPy, in place."""
    y = np.array(y0, dtype=np.float64)
    for _ in range(STEPS):
        y += H * (-k * y ** 3 + np.sin(y))
    return y.astype(np.result_type(y0))


def euler_fwd(y0, k):
    ys = [np.asarray(y0, np.float64)]
    for _ in range(STEPS):
        y = ys[-1]
        ys.append(y + H * (-k * y ** 3 + np.sin(y)))
    return ys[-1].astype(np.result_type(y0)), (np.stack(ys[:-1]), np.asarray(k, np.float64))


def euler_bwd(res, ct):
    """The adjoint loop, backwards over the stored trajectory; works on one item or a chunk
    (a leading item axis on y and ct, k shared or per item)."""
    ys, k = res
    gy, gk = np.asarray(ct, np.float64), np.zeros_like(k)
    for y in ys[::-1]:
        gk_step = gy * H * -(y ** 3)
        gk = gk + (gk_step.sum(-1) if k.ndim < y.ndim else gk_step)
        gy = gy * (1.0 + H * (-3.0 * k[..., None] * y ** 2 if k.ndim < y.ndim else -3.0 * k * y ** 2)
                   + H * np.cos(y))
    return gy.astype(np.float32), gk.astype(np.float32)


def euler_batched_fwd(y0, k):
    """A chunk at once: y0 (items, n), k (items,)."""
    return euler_fwd(y0, np.asarray(k)[:, None] * np.ones_like(y0))


def euler_batched_bwd(res, ct):
    gy, gk = euler_bwd(res, ct)
    return gy, gk.sum(-1)


def euler_jax(y0, k):
    y = y0
    for _ in range(STEPS):
        y = y + H * (-k * y ** 3 + jnp.sin(y))
    return y


def ode_dag(node):
    return {"y0": (lambda p: jnp.tanh(p["a"]), ["p"]), "k": (lambda p: p["k"] ** 2, ["p"]),
            "Y": node, "L": (lambda Y: jnp.sum(jnp.cos(Y)), ["Y"])}


def ode_jax(p):
    return jnp.sum(jnp.cos(euler_jax(jnp.tanh(p["a"]), p["k"] ** 2)))


P = {"a": jnp.array([0.3, -0.6, 0.9], jnp.float32), "k": jnp.float32(0.7)}


def test_numpy_euler_loop_with_vjp_matches_the_jax_loop():
    node = Node(euler, ["y0", "k"], vjp=lambda ct, y, y0, k: euler_bwd(euler_fwd(y0, k)[1], ct))
    res = daskdag.compute_grads(ode_dag(node), P, "L")
    value, grad = jax.value_and_grad(ode_jax)(P)
    assert_tree_close(res.value, value, rtol=1e-5)
    assert_tree_close(res.grad, grad, rtol=1e-4)


def test_sweep_item_by_item_and_vectorized_through_numpy_code():
    ps = {"a": jnp.stack([P["a"] * s for s in (1.0, -0.5, 2.0, 0.1, 1.5)]),
          "k": jnp.array([0.7, 1.0, 0.2, 1.3, 0.5], jnp.float32)}
    expected = jax.vmap(jax.value_and_grad(ode_jax))(ps)
    for node in (Node(fwd=euler_fwd, bwd=euler_bwd, deps=["y0", "k"]),
                 Node(fwd=euler_batched_fwd, bwd=euler_batched_bwd, deps=["y0", "k"], vmap=True)):
        res = daskdag.sweep_grads(ode_dag(node), ps, "L", chunk_size=2)
        assert_tree_close(res.value, expected[0], rtol=1e-5)
        assert_tree_close(res.grad, expected[1], rtol=1e-4)


def test_vectorized_user_node_gets_the_chunk_at_once():
    shapes = []

    def fwd(y0, k):
        shapes.append(y0.shape)
        return euler_batched_fwd(y0, k)

    ps = {"a": jnp.ones((6, 3), jnp.float32), "k": jnp.full(6, 0.5, jnp.float32)}
    daskdag.sweep_grads(ode_dag(Node(fwd=fwd, bwd=euler_batched_bwd, deps=["y0", "k"], vmap=True)),
                        ps, "L", chunk_size=4)
    assert sorted(shapes) == [(2, 3), (4, 3)]


# -- travelling ------------------------------------------------------------------------------------

@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_on_a_cli_cluster_with_the_backward_task_on_another_worker(cli_client, tmp_path):
    a, b = sorted(live_workers(cli_client))
    pids = cli_client.run(os.getpid)
    log = RunLog(tmp_path / "runs")
    dag = solve_dag(fwd=log.wrap("fwd", solve_fwd), bwd=log.wrap("bwd", solve_bwd))
    moved, _ = compute_split(cli_client, dag, W, ["L", "M"], a, b)
    # the user's fwd ran once, on a; its bwd on b alone, with the residuals it made on a
    assert log.pids("fwd") == [pids[a]] and set(log.pids("bwd")) == {pids[b]}, log.runs()
    for o in ("L", "M"):
        value, grad = jax.value_and_grad(lambda w: solve_jax(w)[o])(W)
        assert_tree_close(moved[o][0], value, rtol=1e-5)
        assert_tree_close(moved[o][1]["w"], grad, rtol=1e-4, atol=1e-6)
    # and as a user calls it, with a sweep of the vectorized Euler node
    ps = {"a": jnp.stack([P["a"] * s for s in (1.0, -0.5, 2.0)]), "k": jnp.array([0.7, 1.0, 0.2])}
    node = Node(fwd=euler_batched_fwd, bwd=euler_batched_bwd, deps=["y0", "k"], vmap=True)
    res = daskdag.sweep_grads(ode_dag(node), ps, "L", client=cli_client)
    assert_tree_close(res.grad, jax.vmap(jax.grad(ode_jax))(ps), rtol=1e-4)


# -- bad rules, named ------------------------------------------------------------------------------

def _bad(bwd):
    return solve_dag(fwd=solve_fwd, bwd=bwd)


@pytest.mark.parametrize("bwd, message", [
    (lambda res, ct: (solve_bwd(res, ct)[1],),
     r"node 'x' failed in its backward pass: ValueError: its bwd returned a tuple of 1; "
     r"expected a tuple of 2 cotangent\(s\), one per dep \['A', 'b'\]"),
    (lambda res, ct: solve_bwd(res, ct)[1],
     r"its bwd returned a ndarray; expected a tuple of 2"),
    (lambda res, ct: (solve_bwd(res, ct)[0], np.ones(N + 1)),
     rf"its bwd returned a cotangent of shape \({N + 1},\) for dep 'b', expected \({N},\)"),
    (lambda res, ct: (solve_bwd(res, ct)[0].T[:2], solve_bwd(res, ct)[1]),
     rf"cotangent of shape \(2, {N}\) for dep 'A', expected \({N}, {N}\)"),
    (lambda res, ct: ({"A": 1.0}, None),
     rf"its bwd returned a dict as the cotangent for dep 'A', expected an array of shape \({N}, {N}\)"),
    (lambda res, ct: (solve_bwd(res, ct)[0], (ct, ct)),
     rf"its bwd returned a tuple as the cotangent for dep 'b', expected an array of shape \({N},\)"),
])
def test_a_bad_bwd_is_named_with_what_was_expected(bwd, message):
    with pytest.raises(NodeError, match=message) as e:
        daskdag.compute_grads(_bad(bwd), W, "L")
    assert e.value.node == "x" and e.value.phase == "backward"


def test_none_cotangents_mean_zeros():
    res = daskdag.compute_grads(_bad(lambda res, ct: (None, solve_bwd(res, ct)[1])), W, "L")
    expected = jax.grad(lambda w: jnp.sum((x := jnp.linalg.solve(jax.lax.stop_gradient(make_A(w)),
                                                                make_b(w))) ** 2) + x[0])(W)
    assert_tree_close(res.grad, expected, rtol=1e-4, atol=1e-6)


def test_fwd_must_return_a_pair():
    dag = solve_dag(fwd=lambda A, b: solve_fwd(A, b)[0], bwd=solve_bwd)
    with pytest.raises(NodeError, match=r"node 'x' failed in its forward pass: .*its fwd returned "
                                        r"a ndarray, expected a pair \(value, residuals\)"):
        daskdag.compute_grads(dag, W, "L")


@pytest.mark.parametrize("node, message", [
    (Node(fwd=solve_fwd, deps=["A", "b"]), "node 'x': give fwd and bwd together"),
    (Node(lambda A, b: A, ["A", "b"], fwd=solve_fwd, bwd=solve_bwd), "either fn .* or fwd and bwd"),
    (Node(deps=["A", "b"], vjp=solve_vjp), "node 'x': vjp= and jvp= need the node's fn"),
    (Node(scipy.linalg.solve, ["A", "b"], vjp=solve_vjp, jit=True), "node 'x': jit=True does not apply"),
    (Node(scipy.linalg.solve, ["A", "b"], vjp="nope"), "node 'x': vjp is not callable"),
])
def test_malformed_rules_are_named(node, message):
    with pytest.raises(DAGError, match=message):
        daskdag.compute_grads({**solve_dag(), "x": node}, W, "L")


def test_a_node_with_jvp_alone_is_named_when_differentiated_in_reverse():
    node = Node(scipy.linalg.solve, ["A", "b"], jvp=lambda args, tangents: None)
    with pytest.raises(DAGError, match="node 'x' is differentiated but has no VJP, only jvp="):
        daskdag.compute_grads({**solve_dag(), "x": node}, W, "L")
    # not differentiated, it just runs
    dag = {"A": (make_A, ["c"]), "b": (make_b, ["c"]), "x": node,
           "L": (lambda x, w: jnp.sum(x) * jnp.sum(w ** 2), ["x", "w"])}
    res = daskdag.compute_grads(dag, {"c": W, "w": W}, "L", wrt=["w"])
    x = jnp.linalg.solve(make_A(W), make_b(W))
    assert_tree_close(res.grad["w"], jnp.sum(x) * 2 * W, rtol=1e-4)


# -- forward mode ------------------------------------------------------------------------------------

def solve_jvp(args, tangents):
    (A, b), (dA, db) = args, tangents
    assert isinstance(dA, np.ndarray) and isinstance(db, np.ndarray)
    x = scipy.linalg.solve(A, b)
    return x, scipy.linalg.solve(A, db - dA @ x)


def test_jvps_through_a_user_jvp_rule_match_jax():
    dag = solve_dag(fn=lambda A, b: scipy.linalg.solve(A, b), vjp=solve_vjp, jvp=solve_jvp)
    v = jnp.cos(jnp.arange(W.size, dtype=jnp.float32))
    res = daskdag.compute_jvps(dag, W, v, ["x", "L", "M"])
    for o in ("x", "L", "M"):
        value, tangent = jax.jvp(lambda w: solve_jax(w)[o], (W,), (v,))
        assert_tree_close(res[o].value, value, rtol=1e-5)
        assert_tree_close(res[o].tangent, tangent, rtol=1e-4, atol=1e-6)
    basis = jnp.eye(W.size, dtype=jnp.float32)[:5]  # five directions: one rule call each
    res = daskdag.compute_jvps(dag, W, basis, "x", batched=True)
    assert_tree_close(res.tangent, jax.jacfwd(lambda w: solve_jax(w)["x"])(W)[:, :5].T,
                      rtol=1e-4, atol=1e-6)


def test_forward_mode_needs_a_jvp_rule_and_checks_what_it_returns():
    with pytest.raises(DAGError, match="node 'x' carries a tangent but has no jvp= rule"):
        daskdag.compute_jvps(solve_dag(**FORMS["vjp="]), W, jnp.ones_like(W), "L")
    bad = solve_dag(fn=lambda A, b: scipy.linalg.solve(A, b),
                    jvp=lambda args, t: (solve_jvp(args, t)[0], np.ones(N + 1)))
    with pytest.raises(NodeError, match=rf"node 'x' failed in its forward pass: ValueError: its "
                                        rf"jvp returned a tangent of shape \({N + 1},\) for the "
                                        rf"output, expected \({N},\)"):
        daskdag.compute_jvps(bad, W, jnp.ones_like(W), "L")


# -- gradient checks -----------------------------------------------------------------------------

def test_check_grads_passes_on_right_rules_and_names_a_wrong_one(x64):
    w = jnp.asarray(W, jnp.float64)
    for form in FORMS.values():
        errors = daskdag.check_grads(solve_dag(**form), w, ["L", "M"])
        assert set(errors) == {"A", "b", "x", "L", "M"} and max(errors.values()) < 1e-5

    def off(res, ct):  # A's cotangent 1 % off: the kind of slip a hand-written VJP makes
        gA, gb = solve_bwd(res, ct)
        return gA * 1.01, gb

    with pytest.raises(daskdag.GradientCheckError, match=r"node 'x': its VJP disagrees with "
                                                         r"finite differences for dep 'A'") as e:
        daskdag.check_grads(solve_dag(fwd=solve_fwd, bwd=off), w, "L")
    assert e.value.node == "x" and e.value.dep == "A" and e.value.others == ()


def test_weights_changed_in_place_between_calls_are_seen_forward_and_backward():
    w = np.array(make_A(W))  # closed over by fwd and bwd: hashed once per call, still seen

    def fwd(b):
        x = np.linalg.solve(w, b)
        return x, x

    def bwd(x, ct):
        return (np.linalg.solve(w.T, ct),)

    dag = {"b": (make_b, ["v"]), "x": Node(fwd=fwd, bwd=bwd, deps=["b"]),
           "L": (lambda x: jnp.sum(x ** 2), ["x"])}

    def expected(v):
        return jax.value_and_grad(lambda v: jnp.sum(jnp.linalg.solve(jnp.asarray(w), make_b(v)) ** 2))(v)

    for scale in (1.0, 2.0, 0.5):
        w[:] = np.asarray(make_A(W)) * scale
        res = daskdag.compute_grads(dag, W, "L")
        value, grad = expected(W)
        assert_tree_close(res.value, value, rtol=1e-5)
        assert_tree_close(res.grad, grad, rtol=1e-4, atol=1e-6)


def test_gradients_have_jax_s_types_whoever_computed_them():
    """A Python float and a float32 array through a node of the user's own NumPy code get the
    gradients a JAX node gives them: JAX arrays of the inputs' JAX dtypes (float32)."""
    numpy_node = Node(lambda a, s: np.sum(np.asarray(a) * s), ["a", "s"],
                      vjp=lambda ct, out, a, s: (ct * np.full(np.shape(a), s), ct * np.sum(a)))
    jax_node = (lambda a, s: jnp.sum(a * s), ["a", "s"])
    x = {"a": jnp.arange(3.0), "s": 2.0}
    for node in (numpy_node, jax_node):
        g = daskdag.compute_grads({"L": node}, x, "L").grad
        assert isinstance(g["a"], jax.Array) and g["a"].dtype == jnp.float32
        assert isinstance(g["s"], jax.Array) and g["s"].dtype == jnp.float32
        assert_tree_close(g["s"], jnp.sum(jnp.arange(3.0)))
