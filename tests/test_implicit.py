"""Implicit nodes and coupled groups (daskdag.Implicit, daskdag.coupled): values and every
derivative kind against implicit differentiation written by hand (NumPy and SciPy: the solution,
then the implicit function theorem's linear solves) and against central finite differences, on
threads and on a two-worker LocalCluster; non-convergence; the capabilities of other nodes
(sweeps, prepared calls, store=, a cluster that cannot import this module)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
import scipy.optimize

import daskdag
from daskdag import Implicit, coupled

pytestmark = pytest.mark.usefixtures("x64")
TOL = dict(rtol=1e-7, atol=1e-9)
# A cluster's workers compute as JAX does by default, in float32 (x64 is this process's setting)
WORKERS_TOL = dict(rtol=1e-4, atol=1e-6)


# --- 1. A scalar equation: u**3 + u = a * p; L = p * u**2 ----------------------------------------

def scalar_dag(**options) -> dict:
    return {"u": Implicit(lambda u, a, p: u ** 3 + u - a * p, ["a", "p"], guess=jnp.array(0.0),
                          **options),
            "L": (lambda u, p: p * u ** 2, ["u", "p"])}


def scalar_by_hand(a: float, p: float) -> tuple[float, dict]:
    """L and dL/d(a, p): u from a real root, du = (p da + a dp) / (3u^2 + 1)."""
    u = scipy.optimize.brentq(lambda u: u ** 3 + u - a * p, -100, 100, xtol=1e-15)
    du_da, du_dp = p / (3 * u ** 2 + 1), a / (3 * u ** 2 + 1)
    return p * u ** 2, {"a": 2 * p * u * du_da, "p": u ** 2 + 2 * p * u * du_dp}


SCALAR = {"a": np.array(1.7), "p": np.array(0.6)}  # (NumPy: float64 under the x64 fixture)


# --- 2. A vector system: A u + 0.1 u**3 = b; L = sum(sin(u)) + u . b -----------------------------

N = 5


def vector_dag(**options) -> dict:
    return {"u": Implicit(lambda u, A, b: A @ u + 0.1 * u ** 3 - b, ["A", "b"],
                          guess=jnp.zeros(N), **options),
            "L": (lambda u, b: jnp.sum(jnp.sin(u)) + u @ b, ["u", "b"])}


def vector_inputs(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    A = np.eye(N) * 3 + 0.3 * rng.standard_normal((N, N))
    return {"A": A, "b": rng.standard_normal(N)}


def vector_by_hand(A, b) -> tuple[float, dict, np.ndarray]:
    """L, dL/d(A, b) by the adjoint: J^T lam = dL/du, J = A + 0.3 diag(u^2); and u."""
    A, b = np.asarray(A), np.asarray(b)
    u = scipy.optimize.fsolve(lambda u: A @ u + 0.1 * u ** 3 - b, np.zeros(N), xtol=1e-12)
    lam = np.linalg.solve((A + 0.3 * np.diag(u ** 2)).T, np.cos(u) + b)
    return float(np.sum(np.sin(u)) + u @ b), {"A": -np.outer(lam, u), "b": u + lam}, u


# --- 3. A coupled group: Sellar's two disciplines -------------------------------------------------

def sellar_dag(solver: str = "newton", **options) -> dict:
    disciplines = {"y1": (lambda z, x, y2: z[0] ** 2 + z[1] + x - 0.2 * y2, ["z", "x", "y2"]),
                   "y2": (lambda z, y1: jnp.sqrt(y1) + z[0] + z[1], ["z", "y1"])}
    return {**coupled(disciplines, guess={"y1": 1.0, "y2": 1.0}, solver=solver, **options),
            "obj": (lambda z, x, y1, y2: x ** 2 + z[1] + y1 + jnp.exp(-y2), ["z", "x", "y1", "y2"]),
            "con": (lambda y1, y2: jnp.stack([3.16 - y1, y2 - 24.0]), ["y1", "y2"])}


SELLAR = {"z": np.array([1.9776, 0.0]), "x": np.array(0.0)}  # (near the published optimum)


def sellar_by_hand(z, x) -> tuple[float, dict, tuple]:
    """obj and d obj/d(z, x): y by fixed-point iteration, dy/dp = (I - dF/dy)^-1 dF/dp."""
    z, x = np.asarray(z), float(x)
    y1 = y2 = 1.0
    for _ in range(200):
        y1 = z[0] ** 2 + z[1] + x - 0.2 * y2
        y2 = np.sqrt(y1) + z[0] + z[1]
    dF_dy = np.array([[0.0, -0.2], [0.5 / np.sqrt(y1), 0.0]])
    dF_dp = np.array([[2 * z[0], 1.0, 1.0], [1.0, 1.0, 0.0]])  # by (z0, z1, x)
    dy_dp = np.linalg.solve(np.eye(2) - dF_dy, dF_dp)
    direct = np.array([0.0, 1.0, 2 * x])
    total = direct + np.array([1.0, -np.exp(-y2)]) @ dy_dp
    return x ** 2 + z[1] + y1 + np.exp(-y2), {"z": total[:2], "x": total[2]}, (y1, y2)


# --- Finite differences of the DAG's values -----------------------------------------------------

def central(f, x: dict, eps: float = 1e-6) -> dict:
    """Central differences of the scalar ``f(x)`` by each leaf of ``x``."""
    out = {}
    for name, value in x.items():
        value = np.asarray(value, float)
        grad = np.zeros_like(value)
        for i in np.ndindex(value.shape):
            up, down = value.copy(), value.copy()
            up[i] += eps
            down[i] -= eps
            grad[i] = (f({**x, name: jnp.asarray(up)})
                       - f({**x, name: jnp.asarray(down)})) / (2 * eps)
        out[name] = grad
    return out


def close(got, want, **tol) -> None:
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), **(tol or TOL))


PROBLEMS = {
    "scalar": (scalar_dag, SCALAR, "L", lambda x: scalar_by_hand(float(x["a"]), float(x["p"]))[:2]),
    "vector": (vector_dag, vector_inputs(), "L", lambda x: vector_by_hand(x["A"], x["b"])[:2]),
    "coupled": (sellar_dag, SELLAR, "obj", lambda x: sellar_by_hand(x["z"], x["x"])[:2]),
}


# --- Values and gradients against the hand-written ones, and finite differences -------------------

@pytest.mark.parametrize("problem", PROBLEMS)
def test_gradients_agree_with_implicit_differentiation_by_hand_and_finite_differences(problem):
    make, x, output, by_hand = PROBLEMS[problem]
    dag = make()
    res = daskdag.compute_grads(dag, x, output)
    value, grad = by_hand(x)
    np.testing.assert_allclose(res.value, value, **TOL)
    close(res.grad, grad)
    fd = central(lambda y: float(daskdag.compute_grads(dag, y, output).value), x)
    close(res.grad, fd, rtol=1e-5, atol=1e-7)


def test_a_coupled_group_by_gauss_seidel_agrees_with_newton_and_the_hand_written_one():
    by_gs = daskdag.compute_grads(sellar_dag("gauss-seidel"), SELLAR, ["obj", "y1", "y2"],
                                  cotangents={"y1": 1.0, "y2": 1.0})
    value, grad, (y1, y2) = sellar_by_hand(SELLAR["z"], SELLAR["x"])
    np.testing.assert_allclose([by_gs["y1"].value, by_gs["y2"].value], [y1, y2], **TOL)
    close(by_gs["obj"].grad, grad)
    (solve,) = by_gs["obj"].info.solves["cycle(y1,y2)"]
    newton = daskdag.compute_grads(sellar_dag(), SELLAR, "obj").info.solves["cycle(y1,y2)"][0]
    assert solve["iterations"] > newton["iterations"] >= 1  # (Gauss-Seidel converges linearly)
    assert solve["residual"] < 1e-9 and newton["residual"] < 1e-9


# --- Every derivative kind, on threads and on a cluster -----------------------------------------

def _every_kind(make, x: dict, output: str, by_hand, client=None) -> None:
    tol = TOL if client is None else WORKERS_TOL
    value, grad = by_hand(x)
    leaves = {k: np.asarray(v, float) for k, v in x.items()}
    dag = make()
    res = daskdag.compute_grads(dag, x, output, client=client)
    close(res.grad, grad, **tol)
    # Each solve is in the call's info, told by the workers on a cluster.
    assert set(res.info.solves) == {n for n, e in dag.items() if isinstance(e, Implicit)}
    assert all(len(s) == 1 and s[0]["residual"] < 1e-4 for s in res.info.solves.values())
    for mode in ("rev", "fwd"):  # a scalar output: the Jacobian is the gradient
        close(daskdag.jacobian(dag, x, output, mode=mode, client=client).grad, grad, **tol)
    rng = np.random.default_rng(1)
    v = {k: jnp.asarray(rng.standard_normal(a.shape)) for k, a in leaves.items()}
    jvp = daskdag.compute_jvps(dag, x, v, output, client=client)
    np.testing.assert_allclose(jvp.tangent, sum(np.sum(grad[k] * v[k]) for k in grad), **tol)

    def hand_grad_along(t: float) -> dict:
        return by_hand({k: jnp.asarray(leaves[k] + t * np.asarray(v[k])) for k in leaves})[1]

    eps = 1e-5
    up, down = hand_grad_along(eps), hand_grad_along(-eps)
    hvp = daskdag.compute_hvps(dag, x, v, output, client=client)
    close(hvp.hvp, {k: (np.asarray(up[k]) - np.asarray(down[k])) / (2 * eps) for k in grad},
          **(dict(rtol=1e-5, atol=1e-6) if client is None else dict(rtol=1e-3, atol=1e-5)))
    close(hvp.grad, grad, **tol)


@pytest.mark.parametrize("problem", PROBLEMS)
def test_every_derivative_kind_on_threads(problem):
    _every_kind(*PROBLEMS[problem])


@pytest.mark.cluster
@pytest.mark.timeout(240)
@pytest.mark.parametrize("problem", PROBLEMS)
def test_every_derivative_kind_on_a_two_worker_cluster(problem, client):
    _every_kind(*PROBLEMS[problem], client=client)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_concurrent_calls_on_one_client_each_get_their_own_solves(client):
    """Two threads call at once on one client, each with its own equation (a node of the same
    name) and new inputs at each call: the workers tell every solve to the client, and each
    call keeps its own."""
    barrier, out = threading.Barrier(2), {}

    def call(name: str, a: float, maxiter: int) -> None:
        dag = scalar_dag(maxiter=maxiter)  # (another residual each: nothing in common)
        barrier.wait()
        out[name] = [daskdag.compute_grads(dag, {"a": jnp.array(a), "p": jnp.array(p)}, "L",
                                           client=client).info.solves for p in (1.0, 2.0, 3.0)]

    threads = [threading.Thread(target=call, args=(n, a, m))
               for n, a, m in (("a", 1.0, 40), ("b", -3.0, 41))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in "ab":  # one solve a call, not the other thread's too
        assert [len(s["u"]) for s in out[name]] == [1, 1, 1], out[name]
        assert all(s["u"][0]["residual"] < 1e-4 for s in out[name])


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_a_cluster_that_cannot_import_this_module_solves_and_differentiates(cli_client):
    value, grad = sellar_by_hand(SELLAR["z"], SELLAR["x"])[:2]
    res = daskdag.compute_grads(sellar_dag(), SELLAR, "obj", client=cli_client)
    np.testing.assert_allclose(res.value, value, **WORKERS_TOL)
    close(res.grad, grad, **WORKERS_TOL)
    ((solve,),) = res.info.solves.values()  # told by the worker that solved
    assert solve["iterations"] >= 1 and solve["residual"] < 1e-4
    vector = daskdag.jacobian(vector_dag(), vector_inputs(), "L", mode="fwd", client=cli_client)
    close(vector.grad, vector_by_hand(**vector_inputs())[1], **WORKERS_TOL)


# --- Non-convergence -----------------------------------------------------------------------------

def no_root_dag(**options) -> dict:  # u**2 + a = 0 has no real root for a > 0
    return {"before": (lambda a: a * 2.0, ["a"]),
            "u": Implicit(lambda u, b: u ** 2 + b, ["before"], guess=jnp.array(1.0), **options),
            "L": (lambda u: u ** 2, ["u"])}


@pytest.mark.parametrize("jit", [False, True])
def test_a_solve_that_does_not_converge_names_the_node_residual_and_iterations(jit):
    with pytest.raises(daskdag.NodeError) as raised:
        daskdag.compute_grads(no_root_dag(jit=jit, maxiter=7), jnp.array(1.0), "L")
    e = raised.value
    assert e.node == "u" and isinstance(e.original, daskdag.SolveError)
    message = str(e)
    assert "node 'u'" in message and "did not converge" in message
    assert "residual norm" in message and "iterations (maxiter 7)" in message


def test_too_few_iterations_report_the_residual_reached():
    dag = vector_dag(maxiter=1)
    with pytest.raises(daskdag.NodeError, match=r"residual norm [0-9.e-]+ after 1 iterations "
                                                r"\(maxiter 1\), tolerance"):
        daskdag.compute_grads(dag, vector_inputs(), "L")


def test_items_that_do_not_converge_fail_alone_in_a_sweep():
    """errors='collect': the items whose equation has no root fail, naming the node; the others
    keep their values and gradients (nothing computed is lost)."""
    a = np.array([-1.0, 0.5, -4.0, 2.0])  # u**2 = -2a: roots for a < 0 only
    res = daskdag.sweep_grads(no_root_dag(), a, "L", errors="collect")
    assert sorted(res.failed) == [1, 3]
    assert all(isinstance(e.original, daskdag.SolveError) and e.node == "u"
               for e in res.failed.values())
    for i in (0, 2):
        want = jax.grad(lambda a: -2 * a)(a[i])  # u**2 = -2a
        np.testing.assert_allclose(res.value[i], -2 * a[i], **TOL)
        np.testing.assert_allclose(res.grad[i], want, **TOL)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_solve_that_does_not_converge_on_a_worker_names_the_node(client):
    with pytest.raises(daskdag.NodeError, match="node 'u'.*did not converge.*residual norm"):
        daskdag.compute_grads(no_root_dag(), jnp.array(1.0), "L", client=client)


# --- Sweeps, prepared calls, store= -------------------------------------------------------------

@pytest.mark.parametrize("vmap", [False, True])
def test_a_sweep_solves_each_item(vmap):
    items = [vector_inputs(seed) for seed in range(4)]
    bs = np.stack([i["b"] for i in items])
    A = items[0]["A"]
    res = daskdag.sweep_grads(vector_dag(vmap=vmap), {"A": A, "b": bs}, "L", batched=["b"],
                              wrt=["A", "b"])
    for i, b in enumerate(bs):
        value, grad, _ = vector_by_hand(A, b)
        np.testing.assert_allclose(res.value[i], value, **TOL)
        close({k: res.grad[k][i] for k in grad}, grad)


@pytest.mark.parametrize("jit", [False, True])
def test_a_prepared_call_sees_a_changed_coefficient_and_records_its_solves(jit):
    """A global the residual reads, rebound between calls (the solve is compiled, and kept
    between calls): the next call solves the new equation, never a stale one; and back again.
    Each call's info lists its solve."""
    global STIFFNESS
    STIFFNESS = 1.0

    def residual(u, a):
        return STIFFNESS * u ** 3 + u - a

    f = daskdag.value_and_grad({"u": Implicit(residual, ["a"], guess=jnp.array(0.0), jit=jit)},
                               "u")
    a = jnp.array(2.0)
    for stiffness in (1.0, 1.0, 4.0, 4.0, 1.0):
        STIFFNESS = stiffness
        value, grad = f(a)
        u = scipy.optimize.brentq(lambda u, s=stiffness: s * u ** 3 + u - 2.0, -10, 10,
                                  xtol=1e-15)
        np.testing.assert_allclose(value, u, **TOL)
        np.testing.assert_allclose(grad, 1 / (3 * stiffness * u ** 2 + 1), **TOL)
        (solve,) = f.info.solves["u"]
        assert solve["iterations"] >= 1 and solve["residual"] < 1e-9


def test_a_residual_reaching_changed_state_by_any_path_is_solved_anew():
    """Between calls of one prepared function, a NumPy array the residual reaches through an
    object is changed in place, then an equinox module's weight is replaced in the DAG's
    entry: each next call solves the new equation (compiled solves are kept, never stale)."""
    eqx = pytest.importorskip("equinox")

    class Springs:
        def __init__(self, k):
            self.k = k

    springs = Springs(np.array([1.0, 2.0]))

    def residual(u, f):
        return springs.k * u + u ** 3 - f

    class Layer(eqx.Module):
        w: jax.Array

        def __call__(self, u, f):
            return self.w * u + u ** 3 - f

    f = jnp.array([1.0, 3.0])

    def solution(k):
        return np.array([scipy.optimize.brentq(lambda v, k=k, f=f: k * v + v ** 3 - f, -9, 9,
                                               xtol=1e-15) for k, f in zip(k, np.asarray(f))])

    dag = {"u": Implicit(residual, ["f"], guess=jnp.zeros(2)), "L": (jnp.sum, ["u"])}
    g = daskdag.value_and_grad(dag, "L")
    np.testing.assert_allclose(g(f)[0], solution([1.0, 2.0]).sum(), **TOL)
    springs.k[:] = [3.0, 0.5]  # (in place)
    np.testing.assert_allclose(g(f)[0], solution([3.0, 0.5]).sum(), **TOL)

    dag["u"] = Implicit(Layer(jnp.array([2.0, 2.0])), ["f"], guess=jnp.zeros(2))
    np.testing.assert_allclose(g(f)[0], solution([2.0, 2.0]).sum(), **TOL)
    dag["u"] = Implicit(eqx.tree_at(lambda m: m.w, dag["u"].residual, jnp.array([0.5, 4.0])),
                        ["f"], guess=jnp.zeros(2))
    value, grad = g(f)
    np.testing.assert_allclose(value, solution([0.5, 4.0]).sum(), **TOL)
    u = solution([0.5, 4.0])
    np.testing.assert_allclose(grad, 1 / (np.array([0.5, 4.0]) + 3 * u ** 2), **TOL)


@pytest.mark.parametrize("jit", [False, True])
def test_a_guess_changed_in_place_or_deps_reordered_is_seen_by_a_prepared_call(jit):
    """u**2 = 2a + b has two roots: the guess picks one. A NumPy guess changed in place
    between calls moves the solution to the other root; then the entry's deps list,
    reordered in place, changes the equation to u**2 = 2b + a. Each next call gives the new
    answer and gradient, never a stale one."""
    guess = np.array(1.0)
    entry = Implicit(lambda u, a, b: u ** 2 - 2 * a - b, ["a", "b"], guess=guess, jit=jit)
    f = daskdag.value_and_grad({"u": entry}, "u")
    x = {"a": jnp.array(4.0), "b": jnp.array(1.0)}
    value, grad = f(x)  # u = 3, du = (2 da + db) / 2u
    np.testing.assert_allclose([value, grad["a"], grad["b"]], [3.0, 1 / 3, 1 / 6], **TOL)
    guess[...] = -1.0
    value, grad = f(x)
    np.testing.assert_allclose([value, grad["a"], grad["b"]], [-3.0, -1 / 3, -1 / 6], **TOL)
    entry.deps[:] = ["b", "a"]  # u**2 = 2b + a = 6
    value, grad = f(x)
    u = -np.sqrt(6.0)
    np.testing.assert_allclose([value, grad["a"], grad["b"]], [u, 1 / (2 * u), 1 / u], **TOL)


@pytest.mark.parametrize("vmap", [False, True])
def test_a_sweep_names_the_items_that_did_not_converge(vmap):
    a = np.array([-1.0, 0.5, -4.0, 2.0])  # no root where a > 0
    with pytest.raises(daskdag.NodeError, match="node 'u'.*did not converge") as raised:
        daskdag.sweep_grads(no_root_dag(vmap=vmap), a, "L")
    assert raised.value.item == 1  # (a batched solve's failure: its chunk run item by item)


def test_a_stored_call_resumes_without_solving_again(tmp_path):
    dag = sellar_dag()
    first = daskdag.compute_grads(dag, SELLAR, "obj", store=tmp_path / "call")
    assert first.info.solves["cycle(y1,y2)"]
    again = daskdag.compute_grads(dag, SELLAR, "obj", store=tmp_path / "call")
    assert again.info.solves == {}  # (read back from the store)
    np.testing.assert_array_equal(again.grad["z"], first.grad["z"])
    np.testing.assert_array_equal(again.value, first.value)


def test_an_implicit_node_on_fixed_data_is_solved_once_across_calls():
    """A jit=True implicit node that reads only data the calls do not move is kept between
    calls (daskdag.reuse) and not solved again; its gradient still flows to the moving input."""
    dag = {"u": Implicit(lambda u, d: u ** 3 + u - d, ["data"], guess=jnp.zeros(3), jit=True),
           "loss": (lambda p, u: jnp.sum(p * u ** 2), ["p", "u"])}
    data = jnp.array([1.0, 2.0, 10.0])
    u = np.array([scipy.optimize.brentq(lambda v, d=d: v ** 3 + v - d, -5, 5, xtol=1e-15)
                  for d in np.asarray(data)])
    infos = []
    for step in range(3):
        p = jnp.ones(3) * (step + 1.0)
        res = daskdag.compute_grads(dag, {"p": p, "data": data}, "loss", wrt=["p"])
        np.testing.assert_allclose(res.grad["p"], u ** 2, **TOL)
        np.testing.assert_allclose(res.value, np.sum(np.asarray(p) * u ** 2), **TOL)
        infos.append(res.info)
    assert len(infos[0].solves["u"]) == 1 and infos[0].reused == ()
    assert all(i.reused == ("u",) and i.solves == {} for i in infos[1:])


def test_a_large_system_is_solved_matrix_free(monkeypatch):
    """Over DENSE_UNKNOWNS unknowns, Newton's steps and the adjoint are GMRES on products with
    the Jacobian: never formed. A tridiagonal system of 2,000 unknowns."""
    n = 2000

    def residual(u, b):
        lap = 2 * u - jnp.pad(u[1:], (0, 1)) - jnp.pad(u[:-1], (1, 0))
        return lap + u ** 3 - b

    def formed(*_):
        raise AssertionError("a Jacobian was formed")

    from daskdag.model import implicit
    monkeypatch.setattr(implicit, "_dense", formed)
    b = jnp.asarray(np.random.default_rng(0).standard_normal(n))
    dag = {"u": Implicit(residual, ["b"], guess=jnp.zeros(n)),
           "L": (lambda u: jnp.sum(u ** 2), ["u"])}
    res = daskdag.compute_grads(dag, b, "L")

    def tridiagonal(u):  # the Jacobian T = 2I - offdiagonals + diag(3u^2), banded (symmetric)
        return np.stack([np.r_[0.0, -np.ones(n - 1)], 2 + 3 * u ** 2, np.r_[-np.ones(n - 1), 0.0]])

    u = np.asarray(b).copy()  # by hand: Newton's steps, each a banded solve
    for _ in range(50):
        r = np.asarray(residual(jnp.asarray(u), b))
        if np.max(np.abs(r)) < 1e-13:
            break
        u -= scipy.linalg.solve_banded((1, 1), tridiagonal(u), r)
    assert np.max(np.abs(np.asarray(residual(jnp.asarray(u), b)))) < 1e-12
    want = scipy.linalg.solve_banded((1, 1), tridiagonal(u), 2 * u)  # T^T lam = dL/du = 2u
    np.testing.assert_allclose(res.grad, want, rtol=1e-6, atol=1e-9)


# --- Bad input ----------------------------------------------------------------------------------

def test_a_cycle_outside_a_group_is_refused_naming_its_nodes_and_the_way_out():
    dag = {"y1": (lambda x, y2: x - y2, ["x", "y2"]), "y2": (lambda y1: y1 / 2, ["y1"])}
    with pytest.raises(daskdag.DAGError, match=r"cycle: y[12] -> y[12] -> y[12].*daskdag.coupled"):
        daskdag.compute_grads(dag, jnp.array(1.0), "y1")


@pytest.mark.parametrize("entry, match", [
    (Implicit(lambda u, a: u - a, ["a"]), "node 'u': give guess="),
    (Implicit(lambda u, a: u - a, ["a"], guess=0.0, solver="bisect"), "node 'u': solver must be"),
    (Implicit(lambda u, a: u - a, ["a"], guess=0.0, solver="gauss-seidel"),
     "node 'u': solver='gauss-seidel' is for coupled groups"),
    (Implicit(lambda u, a: u - a, ["a"], guess=0.0, linear_solver="lu"),
     "node 'u': linear_solver must be"),
    (Implicit(lambda u, a: u - a, ["a"], guess=0.0, maxiter=0), "node 'u': maxiter must be"),
    (Implicit(lambda u, a: u - a, ["a"], guess=0.0, rtol=-1.0), "node 'u': rtol must be"),
])
def test_a_malformed_implicit_node_is_refused_naming_it(entry, match):
    with pytest.raises(daskdag.DAGError, match=match):
        daskdag.compute_grads({"u": entry}, jnp.array(1.0), "u")


def test_a_residual_not_shaped_like_its_unknowns_is_refused_naming_the_node():
    dag = {"u": Implicit(lambda u, a: jnp.sum(u) - a, ["a"], guess=jnp.zeros(3)),
           "L": (jnp.sum, ["u"])}
    with pytest.raises(daskdag.NodeError, match=r"node 'u': the residual returns float64\[\], "
                                                r"but the unknowns .* are float64\[3\]"):
        daskdag.compute_grads(dag, jnp.array(1.0), "L")


def test_a_malformed_group_is_refused_naming_it():
    with pytest.raises(daskdag.DAGError, match=r"coupled group 'cycle\(y1,y2\)': guess must give "
                                               r"a starting value for each of its nodes"):
        coupled({"y1": (lambda y2: y2, ["y2"]), "y2": (lambda y1: y1, ["y1"])}, guess={"y1": 0.0})
    with pytest.raises(daskdag.DAGError, match="node 'y2': expected"):
        coupled({"y1": (lambda y2: y2, ["y2"]), "y2": "y1"}, guess={"y1": 0.0, "y2": 0.0})
    with pytest.raises(daskdag.DAGError, match="node 'y2': expected"):  # (deps "y1": a string)
        coupled({"y1": (lambda y2: y2, ["y2"]), "y2": (lambda y1: y1, "y1")},
                guess={"y1": 0.0, "y2": 0.0})


def test_a_user_solver_is_used_and_its_result_checked():
    """``solver=`` a callable (here optimistix's Newton): the derivative is still the implicit
    function theorem's; a solver that stops short is a SolveError."""
    optx = pytest.importorskip("optimistix")
    calls = []

    def newton(f, u0):
        calls.append(threading.get_ident())
        return optx.root_find(lambda u, _: f(u), optx.Newton(rtol=1e-12, atol=1e-12), u0).value

    make = lambda **o: {"u": Implicit(lambda u, a, p: u ** 3 + u - a * p, ["a", "p"],  # noqa: E731
                                      guess=jnp.array(0.0), solver=newton, **o),
                        "L": (lambda u, p: p * u ** 2, ["u", "p"])}
    res = daskdag.compute_grads(make(), SCALAR, "L")
    close(res.grad, scalar_by_hand(float(SCALAR["a"]), float(SCALAR["p"]))[1])
    assert calls and res.info.solves["u"][0]["iterations"] is None
    with pytest.raises(daskdag.NodeError, match="did not converge.*after the solver"):
        daskdag.compute_grads({"u": Implicit(lambda u, a: u - a, ["a"], guess=jnp.array(0.0),
                                             solver=lambda f, u0: u0 + 1.0)}, jnp.array(3.0), "u")
