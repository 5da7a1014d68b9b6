"""What the tests compare and count: trees of arrays close to each other, traces and calls
counted, and the functions of the example DAG (examples/seed_dag.py's shape)."""

import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np


# check_grads' default tolerances, float32 and float64 (the cube root of machine epsilon, twice)
RTOL32 = 2 * float(np.finfo(np.float32).eps) ** (1 / 3)
RTOL64 = 2 * float(np.finfo(np.float64).eps) ** (1 / 3)


def assert_tree_close(actual, expected, rtol=1e-5, atol=1e-6):
    """Same pytree structure, leaves equal within tolerance."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


class TraceLog(list):
    """A list that node functions append to as they are traced. It pickles as a reference to
    itself in this process, so its growing does not change the content token of the functions
    that close over it (a plain list would: daskdag would then rightly trace them anew on the
    next call, as after any in-place change to what a function closes over)."""

    def __reduce__(self):
        _TRACE_LOGS[id(self)] = self
        return _trace_log, (id(self),)


_TRACE_LOGS: "weakref.WeakValueDictionary[int, TraceLog]" = weakref.WeakValueDictionary()


def _trace_log(key: int):
    # Looked up through the module: a global read here would travel, by value, with the log.
    # In another process (a worker), a list of its own: traces there are not counted.
    return getattr(sys.modules.get(__name__), "_TRACE_LOGS", {}).get(key, [])


class Counted:
    """Wraps a node function and counts its calls: ``calls`` on values (JAX's vjp and jvp
    tracers carry them), ``abstract`` on shapes alone (``jax.eval_shape``, ``jax.jit``'s trace)."""

    def __init__(self, fn):
        self.fn, self.calls, self.abstract = fn, 0, 0

    def __call__(self, *args):
        if any(type(a).__name__ == "DynamicJaxprTracer" for a in jax.tree.leaves(args)):
            self.abstract += 1
        else:
            self.calls += 1
        return self.fn(*args)


def seed_functions():
    """The example DAG (the shape of examples/seed_dag.py) with concrete functions (x -> A -> B -> C -> D, B -> E)."""
    return {
        "x_to_A": lambda x: jnp.sin(x) * 2.0,
        "A_to_B": lambda A: A ** 2 + 1.0,
        "B_to_C": lambda B: jnp.cumsum(B) / 3.0,
        "C_to_D": lambda C: jnp.sum(jnp.log(C)),
        "B_to_E": lambda B: jnp.sum(jnp.sqrt(B) * jnp.arange(B.shape[0])),
    }


def two_node_dag():
    """x -> A = 2 sin x -> B = sum(A ** 2): a small DAG for tests about where and whether a call
    runs. Its functions are made inside a function, so cloudpickle ships them by value to worker
    processes."""
    return {"A": (lambda x: jnp.sin(x) * 2, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}


def two_node_grad(x):
    """The gradient of :func:`two_node_dag`'s B, by jax.grad of the composed function."""
    return jax.grad(lambda x: jnp.sum((jnp.sin(x) * 2) ** 2))(x)
