"""Random DAGs checked against plain JAX on the composed function (hypothesis, derandomized):
values and gradients, every Jacobian mode, JVPs, HVPs, sweeps, and outputs asked in any order.

A DAG draws 2-6 nodes, each a smooth op of one or two earlier nodes or free inputs (three
inputs, vectors ``x`` and ``y`` and a scalar ``s``, some of which no node may use), and 1-3
outputs among the nodes; an op of scalars, or a sum, gives a scalar (``()``) node, so inputs
and outputs have scalar leaves as well as vector ones. Each output is summed into a scalar
node for gradients and HVPs; explicit examples make sure that a scalar input reaches a scalar
output."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import daskdag
from .support.numbers import assert_tree_close

UNARY = {"sin": jnp.sin, "tanh": jnp.tanh, "square": lambda a: a * a,
         "cumsum": jnp.cumsum, "scale": lambda a: 0.5 * a + 1.0, "sum": jnp.sum}
BINARY = {"mul": lambda a, b: a * b, "add": lambda a, b: a + b,
          "sin_mul": lambda a, b: jnp.sin(a) * b}
INPUTS = ("x", "y", "s")
N = 3  # elements of each vector input


@st.composite
def dags(draw):
    nodes, names = {}, list(INPUTS)
    for k in range(draw(st.integers(2, 6))):
        name = f"n{k}"
        if draw(st.booleans()):
            op = draw(st.sampled_from(sorted(UNARY)))
            deps = [draw(st.sampled_from(names))]
            nodes[name] = (UNARY[op], deps)
        else:
            op = draw(st.sampled_from(sorted(BINARY)))
            deps = [draw(st.sampled_from(names)), draw(st.sampled_from(names))]
            nodes[name] = (BINARY[op], deps)
        names.append(name)
    outputs = draw(st.lists(st.sampled_from(sorted(nodes)), min_size=1, max_size=3, unique=True))
    return nodes, outputs


def composed(nodes, name):
    """The function of ``{input: value}`` that node ``name`` computes, in plain JAX."""
    def f(values):
        memo = dict(values)

        def value(n):
            if n not in memo:
                fn, deps = nodes[n]
                memo[n] = fn(*(value(d) for d in deps))
            return memo[n]
        return value(name)
    return f


def free_inputs(nodes):
    """The DAG's free inputs: those some node takes (the outputs may need fewer)."""
    return [i for i in INPUTS if any(i in deps for _, deps in nodes.values())]


def as_arg(values: dict):
    """``values`` as a call takes them: the value alone for a DAG of one free input."""
    return next(iter(values.values())) if len(values) == 1 else values


def by_input(grad, names):
    """A result's gradient as ``{input: grad}`` (with one free input it is the grad alone)."""
    return {names[0]: grad} if len(names) == 1 else grad


def with_sums(nodes, outputs):
    """The DAG with a scalar node ``L_o = sum(o)`` per output, and those names."""
    dag = dict(nodes)
    for o in outputs:
        dag[f"L_{o}"] = (jnp.sum, [o])
    return dag, [f"L_{o}" for o in outputs]


X = {"x": jnp.array([0.3, -0.7, 1.1]), "y": jnp.array([0.9, 0.2, -0.4]), "s": jnp.asarray(0.6)}
V = {"x": jnp.array([1.0, -0.5, 0.25]), "y": jnp.array([0.5, 1.0, -1.0]), "s": jnp.asarray(-0.5)}
#: Scalars in and out: n0 and n2 scalars of the scalar input s alone, n3 of s and x.
SCALARS = ({"n0": (UNARY["sin"], ["s"]), "n1": (BINARY["sin_mul"], ["n0", "x"]),
            "n2": (BINARY["mul"], ["n0", "s"]), "n3": (UNARY["sum"], ["n1"])},
           ["n0", "n2", "n3"])
SETTINGS = settings(derandomize=True, max_examples=12, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
TOL = dict(rtol=2e-4, atol=2e-5)


@SETTINGS
@given(dags())
@example(SCALARS)
@example(({"n0": (UNARY["tanh"], ["s"])}, ["n0"]))
def test_gradients_and_outputs_in_any_order(drawn):
    nodes, outputs = drawn
    dag, scalars = with_sums(nodes, outputs)
    x = {i: X[i] for i in free_inputs(nodes)}
    forward = daskdag.compute_grads(dag, as_arg(x), scalars)
    backward = daskdag.compute_grads(dag, as_arg(x), scalars[::-1])
    assert list(forward) == scalars and list(backward) == scalars[::-1]
    for s in scalars:
        value, grad = jax.value_and_grad(composed(dag, s))(x)
        for res in (forward[s], backward[s]):
            assert_tree_close(res.value, value, **TOL)
            assert_tree_close(by_input(res.grad, list(x)), grad, **TOL)


@SETTINGS
@given(dags(), st.sampled_from(["rev", "fwd", "auto"]))
@example(SCALARS, "rev")
@example(SCALARS, "fwd")
@example(SCALARS, "auto")
@example(({"n0": (UNARY["tanh"], ["s"])}, ["n0"]), "auto")
def test_jacobians_in_every_mode(drawn, mode):
    nodes, outputs = drawn
    x = {i: X[i] for i in free_inputs(nodes)}
    res = daskdag.jacobian(nodes, as_arg(x), outputs, mode=mode)
    for o in outputs:
        want = jax.jacrev(composed(nodes, o))(x)
        assert_tree_close(by_input(res[o].grad, list(x)), want, **TOL)


@SETTINGS
@given(dags())
@example(SCALARS)
@example(({"n0": (UNARY["tanh"], ["s"])}, ["n0"]))
def test_jvps_and_hvps(drawn):
    nodes, outputs = drawn
    x = {i: X[i] for i in free_inputs(nodes)}
    v = {i: V[i] for i in x}
    arg, tangent = as_arg(x), as_arg(v)
    jvps = daskdag.compute_jvps(nodes, arg, tangent, outputs)
    for o in outputs:
        value, want = jax.jvp(composed(nodes, o), (x,), (v,))
        assert_tree_close(jvps[o].value, value, **TOL)
        assert_tree_close(jvps[o].tangent, want, **TOL)
    dag, scalars = with_sums(nodes, outputs)
    hvps = daskdag.compute_hvps(dag, arg, tangent, scalars)
    for s in scalars:
        want = jax.jvp(jax.grad(composed(dag, s)), (x,), (v,))[1]
        assert_tree_close(by_input(hvps[s].hvp, list(x)), want, **TOL)


@SETTINGS
@given(dags())
@example(SCALARS)
@example(({"n0": (UNARY["tanh"], ["s"])}, ["n0"]))
def test_sweeps(drawn):
    nodes, outputs = drawn
    dag, scalars = with_sums(nodes, outputs)
    xs = {i: jnp.stack([X[i] * (1 + 0.1 * k) for k in range(4)]) for i in free_inputs(nodes)}
    res = daskdag.sweep_grads(dag, as_arg(xs), scalars, chunk_size=3)
    for s in scalars:
        values, grads = jax.vmap(jax.value_and_grad(composed(dag, s)))(xs)
        assert_tree_close(np.asarray(res[s].value), values, **TOL)
        assert_tree_close(by_input(res[s].grad, list(xs)), grads, **TOL)
