"""sweep_grads as users run it: sweeps with no items or no successful item keep their shapes."""

import jax
import jax.numpy as jnp
import numpy as np

import daskdag


def encode(x, w):
    return jnp.tanh(w @ x)


# -- 3 and 4. no items, no successful item ----------------------------------------------------------

def pytree_dag():
    """A pytree input, a shared input and a pytree output that is not a scalar."""
    def f(p, w):
        return {"s": jnp.sin(p["a"]) @ w, "t": jnp.sum(p["c"] ** 2)}

    return {"Z": (f, ["p", "w"])}, f


def pytree_inputs(n):
    return {"p": {"a": jnp.ones((n, 2, 3)), "c": jnp.ones((n, 4))}, "w": jnp.ones((3, 5))}


def item_shapes(fn, inputs, batched):
    """One item's value and gradients, shaped by jax itself on the composed function."""
    one = {i: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:] if i in batched else a.shape,
                                                          a.dtype), v) for i, v in inputs.items()}
    return jax.eval_shape(fn, *one.values()), one


def test_no_items_gives_shaped_empty_results():
    dag, f = pytree_dag()
    inputs = pytree_inputs(0)
    ct = {"s": jnp.ones((2, 5)), "t": jnp.float32(1.0)}
    res = daskdag.sweep_grads(dag, inputs, "Z", batched=["p"], wrt=["p", "w"], cotangents={"Z": ct})
    value, one = item_shapes(f, inputs, batched=["p"])
    for got, want in [(res.value, value), (res.grad["p"], one["p"]), (res.grad["w"], one["w"])]:
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.shape == (0, *w.shape) and g.dtype == w.dtype
    assert res.failed == {}


def test_no_items_with_a_node_that_cannot_be_traced_gives_value_none():
    def branchy(h):
        return jnp.sum(h) if jnp.sum(h) > 0 else -jnp.sum(h)  # Python control flow on a value

    dag = {"H": (encode, ["x", "w"]), "B": (branchy, ["H"])}
    res = daskdag.sweep_grads(dag, {"x": jnp.ones((0, 3)), "w": jnp.eye(3)}, "B", batched=["x"])
    assert res.value is None  # the documented fallback
    assert res.grad["x"].shape == (0, 3)


def failing_backward():
    @jax.custom_vjp
    def g(h):
        return jnp.sum(h ** 2)

    def bwd(_, ct):
        raise ArithmeticError("no gradient here")

    g.defvjp(lambda h: (g(h), None), bwd)
    return g


def test_collect_where_every_item_fails_returns_nan_rows():
    dag, f = pytree_dag()
    g = failing_backward()
    dag = {**dag, "L": (lambda z: g(z["s"]) + z["t"], ["Z"])}
    inputs = pytree_inputs(5)
    res = daskdag.sweep_grads(dag, inputs, ["Z", "L"], batched=["p"], errors="collect",
                              cotangents={"Z": {"s": jnp.ones((2, 5)), "t": jnp.float32(1.0)}})
    value, one = item_shapes(lambda p, w: (f(p, w), g(f(p, w)["s"])), inputs, batched=["p"])
    for o, want in zip(["Z", "L"], value):
        assert sorted(res[o].failed) == list(range(5))
        assert all(e.phase == "backward" for e in res[o].failed.values())
        for got, w in [(res[o].value, want), (res[o].grad["p"], one["p"])]:
            assert jax.tree.structure(got) == jax.tree.structure(w)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(w)):
                assert a.shape == (5, *b.shape) and a.dtype == b.dtype and np.isnan(a).all()
