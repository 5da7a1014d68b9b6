r"""A node outside JAX inside a JAX DAG: an implicit Euler step solved with SciPy, with
its own VJP.

    theta -> A (JAX) --\
                        x = solve(A, b)  (SciPy, user VJP) -> loss (JAX)
    theta -> b (JAX) --/

Prints the loss, its gradient, the largest difference to the same DAG written in JAX,
the result of daskdag.check_grads, and the sensitivity d loss / d x at the SciPy node;
exits non-zero if anything disagrees.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

import daskdag

N, DT = 6, 0.1


def system(theta):  # JAX: the matrix of one implicit Euler step, I - dt * K(theta)
    k = jnp.exp(theta[:N])
    K = -jnp.diag(k) + jnp.diag(k[:-1] * 0.5, 1) + jnp.diag(k[1:] * 0.5, -1)
    return jnp.eye(N) - DT * K


def source(theta):  # JAX: the right-hand side
    return jnp.sin(theta[N:]) + 1.0


def solve_fwd(A, b):  # SciPy on NumPy arrays: returns (value, residuals)
    lu = scipy.linalg.lu_factor(A)
    x = scipy.linalg.lu_solve(lu, b)
    return x, (lu, x)


def solve_bwd(residuals, ct):  # one cotangent per dep: (d/dA, d/db)
    lu, x = residuals
    g = scipy.linalg.lu_solve(lu, ct, trans=1)  # A^T g = ct
    return -np.outer(g, x), g


dag = {
    "A": (system, ["theta"]),
    "b": (source, ["theta"]),
    "x": daskdag.Node(fwd=solve_fwd, bwd=solve_bwd, deps=["A", "b"]),
    "loss": (lambda x: jnp.sum((x - 1.0) ** 2), ["x"]),
}


def main() -> int:
    theta = jnp.linspace(-0.5, 0.5, 2 * N)
    res = daskdag.compute_grads(dag, theta, "loss", wrt=["theta", "x"])
    print("loss", res.value)
    print("d loss / d theta", res.grad["theta"])
    print("d loss / d x    ", res.grad["x"])

    def in_jax(theta):
        return jnp.sum((jnp.linalg.solve(system(theta), source(theta)) - 1.0) ** 2)

    value, grad = jax.value_and_grad(in_jax)(theta)
    worst = float(max(abs(res.value - value),
                      jnp.max(jnp.abs(res.grad["theta"] - grad))))
    print(f"largest difference to the same DAG in JAX: {worst:.2e}")
    errors = daskdag.check_grads(dag, theta, "loss")
    print("check_grads, each node's VJP against finite differences:",
          {n: f"{e:.1e}" for n, e in errors.items()})
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
