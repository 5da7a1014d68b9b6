"""Every kind in every form, three rounds at new points of the same shapes, counting XLA
compilations (``jax.monitoring``'s backend compile events): ``python compiles_child.py
[--no-sweeps]``, run by
tests/test_compiles.py in a process of its own (with JAX where the test puts it). Prints one
JSON line: the compilations of each round, and where ``jax`` was imported from."""

import json
import sys

import dask
import jax
import jax.numpy as jnp
import numpy as np

import daskdag

COMPILES = [0]


def _count(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)

W = np.array([[0.5, -0.2, 0.1], [0.3, 0.8, -0.4], [0.2, 0.1, 0.9]], np.float32)


def trunk(p):
    return jnp.tanh(W @ p)


def gate(t):  # eager: Python control flow on a value (one branch taken: one program)
    if not jnp.all(jnp.isfinite(t)):
        raise FloatingPointError("the trunk is not finite")
    return t * 2.0


def head(g, p):
    return jnp.sin(g * p)


def loss(h):
    return jnp.sum(h ** 2)


DAG = {"T": daskdag.Node(trunk, ["p"], jit=True, vmap=True), "G": (gate, ["T"]),
       "H": daskdag.Node(head, ["G", "p"], jit=True, vmap=True), "L": (loss, ["H"])}
JIT = {"T": daskdag.Node(trunk, ["p"], jit=True, vmap=True),
       "H": daskdag.Node(lambda t, p: jnp.sin(t * p), ["T", "p"], jit=True, vmap=True),
       "L": daskdag.Node(loss, ["H"], jit=True, vmap=True)}


def calls(p: np.ndarray, ps: np.ndarray, v: np.ndarray, prepared: dict, sweeps: bool) -> list:
    """One call of every kind in every form at ``p`` (and, where ``sweeps``, sweeps over
    ``ps``)."""
    x, t = {"p": p}, {"p": v}
    out = []
    for dag in (DAG, JIT):
        out += [daskdag.compute_grads(dag, x, ["L"]),
                daskdag.jacobian(dag, x, ["H"], mode="rev"),
                daskdag.jacobian(dag, x, ["H"], mode="fwd"),
                daskdag.compute_jvps(dag, x, t, ["H"]),
                daskdag.compute_hvps(dag, x, t, ["L"])]
        out += dask.compute(daskdag.grads(dag, x, ["L"]), daskdag.jacobians(dag, x, ["H"]),
                            daskdag.jvps(dag, x, t, ["H"]), daskdag.hvps(dag, x, t, ["L"]))
        fs = prepared.setdefault(id(dag), (
            daskdag.value_and_grad(dag, "L"), daskdag.value_and_jacobian(dag, "H"),
            daskdag.value_and_jvp(dag, "H"), daskdag.value_grad_and_hvp(dag, "L")))
        out += [fs[0](x), fs[1](x), fs[2](x, t), fs[3](x, t)]
        if not sweeps:
            continue
        out.append(fs[0].sweep({"p": ps}, batched=["p"]))
        xs, ts = {"p": ps}, {"p": np.tile(v, (len(ps), 1))}
        b = {"batched": ["p"]}
        out += [daskdag.sweep_grads(dag, xs, ["L"], **b),
                daskdag.sweep_jacobians(dag, xs, ["H"], **b),
                daskdag.sweep_jvps(dag, xs, ts, ["H"], **b),
                daskdag.sweep_hvps(dag, xs, ts, ["L"], **b)]
    return out


def main() -> None:
    rng = np.random.default_rng(0)
    rounds, prepared, grads = [], {}, []
    for _ in range(3):
        p = rng.normal(size=3).astype(np.float32)
        ps = rng.normal(size=(8, 3)).astype(np.float32)
        v = rng.normal(size=3).astype(np.float32)
        before = COMPILES[0]
        res = calls(p, ps, v, prepared, sweeps="--no-sweeps" not in sys.argv)
        rounds.append(COMPILES[0] - before)
        composed = jax.grad(lambda q: loss(head(gate(trunk(q)), q)))(p)
        grad = res[0]["L"].grad
        grad = grad["p"] if isinstance(grad, dict) else grad
        grads.append(float(jnp.max(jnp.abs(grad - composed))))
    print(json.dumps({"compiles": rounds, "jax": jax.__file__, "grad_error": max(grads)}))


if __name__ == "__main__":
    sys.exit(main())
