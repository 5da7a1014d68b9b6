"""The rule registry (daskdag.rules.vjp.register): a rule registered for a kind of function (here,
a JVP rule for NumPy code that jax.jvp cannot trace) is the one compute_jvps uses for it, once
per call, and direction by direction when batched; without it, the node fails, named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import NodeError
from daskdag.rules.vjp import RULES, register

from .support.numbers import assert_tree_close


class NumpyTanh:
    """NumPy code, which jax.jvp cannot trace, with its own JVP rule (test only)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, a):
        self.calls += 1
        return jnp.asarray(np.tanh(np.asarray(a)))


def _numpy_tanh_jvp(fn, node, args, tangents, active):
    primal = fn(*args)
    (t,) = tangents[0]
    return primal, ((1 - primal ** 2) * t,)


def test_registered_jvp_rule():
    fn = NumpyTanh()
    dag = {"A": (jnp.sin, ["x"]), "B": (fn, ["A"]), "C": (lambda b: jnp.sum(b ** 2), ["B"])}
    x = jnp.linspace(-1, 1, 4)
    v = jnp.arange(4.0)
    composed = lambda x: jnp.sum(jnp.tanh(jnp.sin(x)) ** 2)
    with pytest.raises(NodeError, match="node 'B'"):  # no rule: jax.jvp hands it tracers
        daskdag.compute_jvps(dag, x, v, "C")
    register(NumpyTanh, push=_numpy_tanh_jvp)
    try:
        fn.calls = 0
        res = daskdag.compute_jvps(dag, x, v, ["B", "C"])
        assert fn.calls == 1
        assert_tree_close(res["B"].value, jnp.tanh(jnp.sin(x)))
        assert_tree_close(res["C"].tangent, jax.jvp(composed, (x,), (v,))[1], rtol=1e-5)
        # batched: the rule cannot be vmapped (NumPy), so it runs direction by direction
        res = daskdag.compute_jvps(dag, x, jnp.eye(4), "C", batched=True)
        assert_tree_close(res.tangent, jax.jacfwd(composed)(x), rtol=1e-5, atol=1e-6)
    finally:
        del RULES[NumpyTanh]
