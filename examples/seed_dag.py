"""The DAG from the question that started daskdag, computed with one call.

    x -> A -> B -> C -> D
              B -> E

Prints each output's value and gradient as the README's example does (the lines it
shows), then how often each node's function ran and the largest difference to plain JAX
(``jax.value_and_grad`` of the composed function); exits 1 if they disagree.
"""

import sys
from collections import Counter

import jax
import jax.numpy as jnp

import daskdag


calls = Counter()  # node function -> times called


def x_to_A(x):
    calls["A"] += 1
    return jnp.tanh(x) * 2.0


def A_to_B(A):
    calls["B"] += 1
    return jnp.outer(A, A) + jnp.eye(A.shape[0])


def B_to_C(B):
    calls["C"] += 1
    return jnp.linalg.solve(B, jnp.ones(B.shape[0]))


def C_to_D(C):
    calls["D"] += 1
    return jnp.sum(C ** 2)


def B_to_E(B):
    calls["E"] += 1
    # Python control flow on a value: fine, nodes run eagerly.
    if jnp.trace(B) > 10:
        return jnp.log(jnp.trace(B))
    return jnp.trace(B) / 10


dag = {
    "A": (x_to_A, ["x"]),
    "B": (A_to_B, ["A"]),
    "C": (B_to_C, ["B"]),
    "D": (C_to_D, ["C"]),
    "E": (B_to_E, ["B"]),
}

composed = {
    "D": lambda x: C_to_D(B_to_C(A_to_B(x_to_A(x)))),
    "E": lambda x: B_to_E(A_to_B(x_to_A(x))),
}

if __name__ == "__main__":
    x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0], dtype=jnp.float32)
    res = daskdag.compute_grads(dag, x, ["D", "E"])
    ran = dict(sorted(calls.items()))  # (before plain JAX calls the functions too)
    print(res["D"].value, res["D"].grad)  # (as README.md's example prints them)
    print(res["E"].value, res["E"].grad)
    worst = 0.0
    for name, r in res.items():
        value, grad = jax.value_and_grad(composed[name])(x)
        diff = max(float(jnp.abs(r.value - value)),
                   float(jnp.max(jnp.abs(r.grad - grad))))
        worst = max(worst, diff)
    print(f"node function calls for both outputs: {ran}")
    ok = worst <= 1e-5
    print("agrees with plain JAX (jax.value_and_grad of the composed function): "
          f"max |diff| {worst:.2e}" if ok
          else f"DISAGREES with plain JAX (max |diff| {worst:.2e})")
    sys.exit(0 if ok else 1)
