"""The Jacobian of an output with respect to an input it does not read is zeros of the right
shape and dtype, as ``jax.jacrev`` and ``jax.jacfwd`` give it: in every mode and layout, for
eager, jit and vmap nodes, scalar and array leaves, called, prepared and swept."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import Node

KINDS = {"eager": {}, "jit": {"jit": True}, "vmap": {"jit": True, "vmap": True}}
SHAPES = {"scalar": (), "vector": (3,)}


def _dag(kind: str) -> dict:
    opts = KINDS[kind]
    return {"n0": Node(lambda b: jnp.sin(b) * 2.0, ["x1"], **opts),
            "n1": Node(lambda a, n: a * n, ["x0", "n0"], **opts)}


def _inputs(shape: tuple) -> dict:
    return {"x0": np.full(shape, 1.5, np.float32),
            "x1": np.arange(1, 1 + int(np.prod(shape)), dtype=np.float32).reshape(shape)}


def _want(x: dict, output: str):
    """JAX's Jacobian of ``output`` with respect to ``x0`` (zeros for ``n0``)."""
    def n0(x0, x1):
        return jnp.sin(x1) * 2.0

    fn = n0 if output == "n0" else (lambda x0, x1: x0 * n0(x0, x1))
    return jax.jacrev(fn)(jnp.asarray(x["x0"]), jnp.asarray(x["x1"]))


def _x0(grad):
    """The Jacobian with respect to ``x0``, of a result's ``{input: Jacobian}``."""
    return grad["x0"] if isinstance(grad, dict) else grad


def _dense(jac) -> np.ndarray:
    return np.asarray(jac.todense() if hasattr(jac, "todense") else jac)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, shape", [("dense", "scalar"), ("dense", "vector"),
                                           ("sparse", "vector"), ("pattern", "vector")])
@pytest.mark.parametrize("mode", ["rev", "fwd", "auto"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_output_that_does_not_read_the_input(kind, mode, layout, shape):
    """``layout``: dense (``jax.jacrev``'s), ``sparse=True`` (SciPy's), or a detected
    pattern's colours (a sparse layout is for arrays: the scalar's is dense)."""
    x = _inputs(SHAPES[shape])
    opts = {"sparse": True} if layout == "sparse" else \
        {"sparsity": "detect"} if layout == "pattern" else {}
    res = daskdag.jacobian(_dag(kind), x, ["n0", "n1"], wrt=["x0"], mode=mode, **opts)
    for output in ("n0", "n1"):
        want, got = _want(x, output), _x0(res[output].grad)
        if layout == "sparse":
            got = _dense(got).reshape(want.shape)
        assert np.shape(got) == want.shape and np.asarray(got).dtype == want.dtype, output
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    assert not np.any(_dense(_x0(res["n0"].grad)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", ["rev", "fwd"])
@pytest.mark.parametrize("kind", KINDS)
def test_prepared_and_swept(kind, mode, shape):
    x = _inputs(SHAPES[shape])
    f = daskdag.value_and_jacobian(_dag(kind), "n0", wrt=["x0"], mode=mode)
    _, jac = f(x)
    jac = _x0(jac)
    want = _want(x, "n0")
    assert np.shape(jac) == want.shape and not np.any(np.asarray(jac))
    items = {name: np.stack([v, v + 1.0]) for name, v in x.items()}
    res = daskdag.sweep_jacobians(_dag(kind), items, "n0", wrt=["x0"], mode=mode,
                                  batched=["x0", "x1"])
    grad = _x0(res.grad)
    assert np.shape(grad) == (2, *want.shape) and not np.any(np.asarray(grad))
