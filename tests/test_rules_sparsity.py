"""daskdag.rules.sparsity: Jacobian patterns from jaxprs, against the nonzeros of jax.jacfwd at
random points (float32): always a superset (sound), equal where the rules are exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from daskdag.model.leaves import is_differentiable
from daskdag.rules.sparsity import jaxpr_pattern


def _random_like(leaf, rng, positive):
    x = rng.standard_normal(np.shape(leaf)).astype(np.float32)
    return jnp.asarray(np.abs(x) + 0.1 if positive else x)


def true_pattern(fn, args, active, points=3, seed=0):
    """Per active arg, the union over ``points`` random points of ``|jacfwd| > 0`` (the first
    point has every differentiable element positive, so relu-like kinks are all seen)."""
    rng = np.random.default_rng(seed)
    flat = [jax.tree.flatten(a) for a in args]
    union = None
    for p in range(points):
        leaves = [[_random_like(x, rng, p == 0) if is_differentiable(x) else x for x in ls]
                  for ls, _ in flat]
        slots = [(i, j) for i, ls in enumerate(leaves) if active[i]
                 for j, x in enumerate(ls) if is_differentiable(x)]
        z0 = jnp.concatenate([jnp.ravel(leaves[i][j]) for i, j in slots] + [jnp.zeros(0)])

        def g(z):
            new, k = [list(ls) for ls in leaves], 0
            for i, j in slots:
                shape = np.shape(leaves[i][j])
                new[i][j] = z[k:k + int(np.prod(shape))].reshape(shape)
                k += int(np.prod(shape))
            out = fn(*(jax.tree.unflatten(tree, ls) for ls, (_, tree) in zip(new, flat)))
            outs = [jnp.ravel(x) for x in jax.tree.leaves(out) if is_differentiable(x)]
            return jnp.concatenate(outs + [jnp.zeros(0)])

        nz = np.abs(np.asarray(jax.jacfwd(g)(z0))) > 0
        union = nz if union is None else union | nz
    result, k = [], 0
    for i, (ls, _) in enumerate(flat):
        if not active[i]:
            result.append(None)
            continue
        width = sum(int(np.prod(np.shape(x))) for x in ls if is_differentiable(x))
        result.append(union[:, k:k + width])
        k += width
    return result


def check(fn, args, active=None, exact=True):
    active = [True] * len(args) if active is None else active
    pattern = jaxpr_pattern(fn, args, active)
    truth = true_pattern(fn, args, active)
    assert pattern is not None
    for p, t, a in zip(pattern, truth, active):
        if not a:
            assert p is None
            continue
        assert p.dtype == bool and p.shape == t.shape
        dense = p.toarray()
        assert not (t & ~dense).any(), "a true dependency missing from the pattern"
        if exact:
            np.testing.assert_array_equal(dense, t)
    return pattern


x12 = np.linspace(-1.0, 1.0, 12, dtype=np.float32)
x20 = np.linspace(-1.0, 1.0, 20, dtype=np.float32)
band = np.diag(np.full(20, 2.0)) + np.diag(np.full(19, -1.0), 1) + np.diag(np.full(19, 0.5), -1)
blocks = np.random.default_rng(1).standard_normal((4, 3, 3)).astype(np.float32) + 3.0
wide = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32) + 3.0
index = np.array([3, 0, 7, 7, 19, 2])
inner = jax.jit(lambda x: jnp.tanh(x[1:]) * x[:-1])

EXACT = {
    "elementwise": lambda x: jnp.sin(x) * jnp.exp(x) + x ** 2 / (1 + jnp.abs(x)),
    "banded": lambda x: jnp.pad(x, 1)[2:] + x * jnp.concatenate([x[1:], x[:1]]),
    "stencil": lambda x: x[2:] - 2 * x[1:-1] + x[:-2],
    "block_matmul": lambda x: (x[:12].reshape(4, 3, 1) * jnp.ones(3)) @ jnp.asarray(blocks),
    "block_self_matmul": lambda x: jnp.matmul(x[:18].reshape(2, 3, 3), x[:18].reshape(2, 3, 3)),
    "batched_matvec": lambda x: jnp.einsum("bij,bj->bi", jnp.asarray(blocks), x[:12].reshape(4, 3)),
    "contract_leading": lambda x: jnp.einsum("ki,kj->ji", x.reshape(4, 5), jnp.asarray(wide)),
    "batch_not_leading": lambda x: jnp.einsum(
        "ibj,jb->bi", jnp.asarray(blocks.transpose(1, 0, 2)), x[:12].reshape(3, 4)),
    "cumsum": jnp.cumsum,
    "cumsum_reverse_2d": lambda x: lax.cumsum(x.reshape(4, 5), axis=0, reverse=True),
    "sum_rows": lambda x: jnp.sum(x.reshape(10, -1), axis=1),
    "constant_index": lambda x: x[index],
    "banded_matvec": lambda x: jnp.asarray(band) @ x,
    "roll": lambda x: jnp.roll(x, 3),
    "jit_inner": lambda x: inner(x) + 1.0,
    "relu": jax.nn.relu,
    "leaky": lambda x: jnp.where(x > 0, x, 0.1 * x),
    "transpose": lambda x: (x.reshape(4, 5).T * jnp.arange(1.0, 5.0)).ravel(),
    "dynamic_slice_constant": lambda x: lax.dynamic_slice(x, (4,), (5,)) * 2,
    "gather_fill": lambda x: x.at[jnp.array([1, 25, 3])].get(mode="fill", fill_value=0.0),
    "split": lambda x: jnp.split(x, 4)[2] * jnp.split(x, 4)[0],
    "softplus_custom_jvp": jax.nn.softplus,
    "checkpoint": jax.checkpoint(lambda x: jnp.sin(x[::2]) * x[1::2]),
    "integer_power_scalar": lambda x: x[3] ** 3 + x,
    "flip_broadcast": lambda x: jnp.flip(x)[:, None] * jnp.ones((1, 2)),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact(name):
    check(EXACT[name], [x20])


def test_reduce_max():
    """Any element of a column may be its maximum: the pattern has them all (a point's
    Jacobian has one)."""
    (pattern,) = check(lambda x: jnp.max(x.reshape(4, 5), axis=0), [x20], exact=False)
    np.testing.assert_array_equal(pattern.toarray(), np.tile(np.eye(5, dtype=bool), 4))


def test_pytrees_with_int_leaves():
    def fn(tree, scale):
        x, n = tree["x"], tree["n"]
        return {"y": x * scale, "count": n + 1, "z": (x[:2] * tree["w"]).sum(), "k": n.sum()}

    args = [{"x": x12, "n": np.arange(3), "w": np.float32(2.0)}, 1.5]
    pattern = check(fn, args)
    assert pattern[0].shape == (13, 13) and pattern[1].shape == (13, 1)


def test_inactive_arg():
    fn = lambda x, w: x * w[:12] + jnp.sum(w) * x[0]
    pattern = check(fn, [x12, x20], active=[True, False])
    assert pattern[1] is None


def test_constant_from_inactive_arg_is_not_assumed_zero():
    fn = lambda x, a: a @ x
    a = np.zeros((12, 12), np.float32)          # zero now, but the pattern may not rely on it
    pattern = jaxpr_pattern(fn, [x12, a], [True, False])
    assert pattern[0].toarray().all()


FALLBACK = {
    "cond": lambda x: lax.cond(x[0] > 0, jnp.sin, lambda y: jnp.cos(y[::-1]), x),
    "fori_loop": lambda x: lax.fori_loop(0, 3, lambda i, y: jnp.roll(y, 1) * y, x),
    "sort": jnp.sort,
    "dynamic_index": lambda x: x[jnp.argmax(x)] * x,
    "scatter": lambda x: x.at[jnp.array([1, 2])].set(x[:2] * 3),
    "norm": lambda x: jnp.linalg.norm(x) * x,
    "scan": lambda x: lax.scan(lambda c, y: (c * y, c + y), 1.0, x)[1],
}


@pytest.mark.parametrize("name", sorted(FALLBACK))
def test_fallback_sound(name):
    check(FALLBACK[name], [x20], exact=False)


def test_custom_vjp_uses_primal_structure():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x) * 2

    f.defvjp(lambda x: (f(x), x), lambda x, g: (2 * jnp.cos(x) * g,))
    pattern = jaxpr_pattern(f, [x12], [True])
    np.testing.assert_array_equal(pattern[0].toarray(), np.eye(12, dtype=bool))


def test_untraceable_returns_none():
    def python_control_flow(x):
        if float(x[0]) > 0:
            return x * 2
        return x

    assert jaxpr_pattern(python_control_flow, [x12], [True]) is None
    assert jaxpr_pattern(lambda x: jnp.asarray(np.sin(x)), [x12], [True]) is None


def test_abstract_args_give_the_same_pattern():
    fn = lambda x, s: x[1:] * x[:-1] * s
    concrete = jaxpr_pattern(fn, [x12, 2.0], [True, True])
    abstract = jaxpr_pattern(fn, [jax.ShapeDtypeStruct((12,), jnp.float32),
                                  jax.ShapeDtypeStruct((), jnp.float32)], [True, True])
    for c, a in zip(concrete, abstract):
        assert (c != a).nnz == 0 and c.shape == a.shape


def test_large_banded():
    def fn(x):
        return jnp.concatenate([x[:1], x[2:] - 2 * x[1:-1] + x[:-2], x[-1:]])

    n = 2000
    (pattern,) = jaxpr_pattern(fn, [np.ones(n, np.float32)], [True])
    assert pattern.shape == (n, n)
    assert abs(pattern.nnz - 3 * n) < 10
    # The positions: rows 0 and n-1 copy x[0] and x[n-1]; row i in between is the second
    # difference x[i+1] - 2 x[i] + x[i-1] (index arithmetic, not the rules' own reading) ...
    rows = np.concatenate([[0], np.repeat(np.arange(1, n - 1), 3), [n - 1]])
    cols = np.concatenate([[0], (np.arange(1, n - 1)[:, None] + [-1, 0, 1]).ravel(), [n - 1]])
    band = np.zeros((n, n), bool)
    band[rows, cols] = True
    # ... which is where jax.jacfwd's Jacobian at a random point is nonzero
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    assert np.array_equal(np.asarray(jax.jacfwd(fn)(x)) != 0, band)
    got = pattern.toarray() != 0
    assert np.array_equal(got, band), (
        f"{int((got & ~band).sum())} positions outside the band, "
        f"{int((band & ~got).sum())} of the band missing")
