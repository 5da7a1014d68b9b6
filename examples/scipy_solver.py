"""A SciPy nonlinear solver with its own VJP (implicit-function theorem) between JAX
nodes, on a cluster.

The steady temperature u of a rod of 48 cells, held at 0 at both ends, with a
conductivity per cell face and a heat source, that loses heat by radiation-like cooling
(c u^3):

    F(u; A, s) = A u + c u^3 - s = 0

A (the conductance matrix, from the log-conductivities) and s (a Gaussian source:
amplitude, centre, width) are JAX nodes of the parameters theta; the solve is
``scipy.optimize.root`` on NumPy arrays, a node of our own with ``Node(fwd=, bwd=)``;
three JAX nodes read the result:

    theta -> A --\\
                  u = root(F(., A, s))  (SciPy)  -> mean_T  (the mean temperature)
    theta -> s --/                               -> hot     (the hottest cell)
                                                 -> loss    (misfit to a wanted profile)

Its VJP is the implicit-function theorem: at the solution,
dF/du du + dF/dA dA + dF/ds ds = 0, so for a cotangent ct on u, solve J^T g = ct with
J = dF/du = A + 3 c diag(u^2), and the cotangents are -g u^T for A and g for s. One
linear solve per backward pass, whatever the number of Newton steps the forward solve
took.

Runs ``daskdag.compute_grads`` on a two-worker ``LocalCluster(processes=True)`` and
compares with the same pipeline in JAX, where the solve is Newton's method unrolled with
``jnp.linalg.solve`` (differentiated through its iterations). Prints the outputs, their
gradients, the solver's statistics and the largest difference to JAX; exits non-zero if
they disagree.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
import scipy.optimize
from distributed import Client, LocalCluster

import daskdag

N, C = 48, 0.5  # cells, cooling coefficient
GRID = (jnp.arange(N) + 0.5) / N  # cell centres on [0, 1]


# JAX: the (N, N) matrix of -div(k grad u), Dirichlet at both ends
def conductance(theta):
    k = jnp.exp(theta[: N + 1]) * N**2  # one conductivity per cell face
    main = k[:-1] + k[1:]
    return jnp.diag(main) - jnp.diag(k[1:-1], 1) - jnp.diag(k[1:-1], -1)


def source(theta):  # JAX: a Gaussian heat source
    amplitude, centre, width = theta[N + 1:]
    return amplitude * jnp.exp(-0.5 * ((GRID - centre) / width) ** 2)


def solve_fwd(A, s):  # SciPy, on NumPy arrays: -> (u, residuals)
    A64, s64 = A.astype(np.float64), s.astype(np.float64)

    def F(u):
        return A64 @ u + C * u**3 - s64, A64 + np.diag(3 * C * u**2)

    sol = scipy.optimize.root(F, np.zeros(N), jac=True, method="hybr", tol=1e-12)
    if not sol.success:
        raise RuntimeError(f"root did not converge: {sol.message}")
    u = sol.x
    J = A64 + np.diag(3 * C * u**2)
    return u.astype(A.dtype), (scipy.linalg.lu_factor(J), u, sol.nfev, A.dtype)


def solve_bwd(residuals, ct):  # implicit-function theorem: one cotangent per dep (A, s)
    lu, u, _, dtype = residuals
    g = scipy.linalg.lu_solve(lu, np.asarray(ct, np.float64), trans=1)  # J^T g = ct
    return (-np.outer(g, u)).astype(dtype), g.astype(dtype)


TARGET = 0.6 * jnp.sin(jnp.pi * GRID)  # the wanted temperature profile

dag = {
    "A": (conductance, ["theta"]),
    "s": (source, ["theta"]),
    "u": daskdag.Node(fwd=solve_fwd, bwd=solve_bwd, deps=["A", "s"]),
    "mean_T": (jnp.mean, ["u"]),
    "hot": (jnp.max, ["u"]),
    "loss": (lambda u: jnp.mean((u - TARGET) ** 2), ["u"]),
}
OUTPUTS = ["mean_T", "hot", "loss"]


# the same pipeline in JAX: Newton's method, unrolled and differentiated
def in_jax(theta):
    A, s = conductance(theta), source(theta)
    u = jnp.zeros(N)
    for _ in range(30):
        u = u - jnp.linalg.solve(A + jnp.diag(3 * C * u**2), A @ u + C * u**3 - s)
    return {"mean_T": jnp.mean(u), "hot": jnp.max(u),
            "loss": jnp.mean((u - TARGET) ** 2)}


def main() -> int:
    theta = jnp.concatenate([jnp.log(jnp.linspace(0.003, 0.006, N + 1)),
                             jnp.array([4.0, 0.35, 0.12])])

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        t = time.perf_counter()
        res = daskdag.compute_grads(dag, theta, OUTPUTS, client=client)
        first = time.perf_counter() - t
        t = time.perf_counter()
        # inputs already there
        res = daskdag.compute_grads(dag, theta, OUTPUTS, client=client)
        again = time.perf_counter() - t
    print(f"compute_grads on 2 workers: {first:.2f} s, then {again:.2f} s")

    for o in OUTPUTS:
        g = np.asarray(res[o].grad)
        shape_grad = np.array2string(g[N + 1:], precision=4)
        print(f"{o:>7} = {float(res[o].value):8.4f}   "
              f"d/d log k: |.|max {np.abs(g[:N + 1]).max():.3e}\n{'':21}"
              f"d/d (amplitude, centre, width): {shape_grad}")
    u, (_, _, nfev, _) = solve_fwd(np.asarray(conductance(theta)),
                                   np.asarray(source(theta)))
    print(f"scipy.optimize.root: {nfev} evaluations of F; "
          "the backward pass: one LU solve")

    want = jax.jit(in_jax)(theta)
    want_grads = jax.jit(jax.jacrev(in_jax))(theta)
    worst = 0.0
    for o in OUTPUTS:
        scale = float(jnp.max(jnp.abs(want_grads[o])))
        worst = max(worst, abs(float(res[o].value - want[o])) / abs(float(want[o])),
                    float(jnp.max(jnp.abs(res[o].grad - want_grads[o]))) / scale)
    print(f"largest relative difference to the same pipeline in JAX\n"
          f"   (Newton unrolled, jnp.linalg.solve): {worst:.2e}")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
