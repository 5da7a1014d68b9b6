"""Derivatives beyond gradients, on one 5-node DAG over 2,000 inputs: Jacobians in
either mode, a sparse Jacobian (its pattern detected, one pass per colour),
Hessian-vector products, and the outputs' gradients checked against finite differences
of the whole DAG.

    x -> A -> B (a 3-point stencil) -> C -> D -> E,   A -> C,   x -> E

Each result is checked against JAX on the composed function; exits non-zero if one
disagrees.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import daskdag


def stencil(a):
    return jnp.pad(a[2:] - 2 * a[1:-1] + a[:-2], 1)


dag = {"A": (jnp.tanh, ["x"]),
       "B": (stencil, ["A"]),
       "C": (lambda b, a: b * a + jnp.sin(a), ["B", "A"]),
       "D": (lambda c: jnp.exp(-c ** 2), ["C"]),
       "E": (lambda d, x: d + 0.5 * x ** 2, ["D", "x"]),
       "L": (lambda e: jnp.sum(e ** 2), ["E"])}


def composed(x):
    a = jnp.tanh(x)
    e = jnp.exp(-(stencil(a) * a + jnp.sin(a)) ** 2) + 0.5 * x ** 2
    return e, jnp.sum(e ** 2)


x = jnp.linspace(-1.0, 1.0, 2000)
want = jax.jacrev(lambda x: composed(x)[0])(x)
errors = {}

# Jacobians: mode="auto" (the default) picks reverse or forward by size; both give
# jacrev's layout.
for mode in ("rev", "fwd"):
    res = daskdag.jacobian(dag, x[:50], "E", mode=mode)
    errors[f"jacobian mode={mode}"] = float(jnp.max(jnp.abs(
        res.grad - jax.jacrev(lambda x: composed(x)[0])(x[:50]))))

# A sparse Jacobian: the pattern from the DAG and each node's jaxpr, then one pass per
# colour.
# scipy.sparse, 2000 x 2000, a band of 3
pattern = daskdag.jacobian_sparsity(dag, x, "E")
res = daskdag.jacobian(dag, x, "E", sparsity=pattern, sparse=True)
print(f"pattern: {pattern.nnz} nonzeros; Jacobian: {type(res.grad).__name__}")
errors["sparse jacobian"] = float(np.max(np.abs(res.grad.toarray() - np.asarray(want))))

# Hessian-vector products, with the gradient from the same backward pass.
v = jnp.cos(jnp.arange(2000.0))
res = daskdag.compute_hvps(dag, x, v, "L")
grad, hvp = jax.jvp(jax.grad(lambda x: composed(x)[1]), (x,), (v,))
errors["gradient"] = float(jnp.max(jnp.abs(res.grad - grad)) / jnp.max(jnp.abs(grad)))
errors["hvp"] = float(jnp.max(jnp.abs(res.hvp - hvp)) / jnp.max(jnp.abs(hvp)))

# The outputs' gradients against central differences of the whole DAG (each node's:
# check_grads).
print("check_totals:", daskdag.check_totals(dag, x, ["E", "L"]))

for what, error in errors.items():
    print(f"{what}: largest difference to JAX {error:.1e}")
sys.exit(0 if max(errors.values()) < 1e-4 else 1)
