"""Node(remat=True) and daskdag.remat: gradients against jax.grad of the composed function and
of its jax.checkpoint-wrapped nodes (eager, jit and custom-VJP nodes, mixed chains, Jacobians,
sweeps); each remat node run twice, forward then again in its backward task, others once; the
residual sizes Dask sees, with and without remat; the config default; and on a process cluster
with a remat node's backward task on another worker than its forward task."""

import os

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dask.sizeof import sizeof
from distributed.protocol import deserialize, serialize

import daskdag
from daskdag import DAGError, Node
from daskdag.rules.vjp import RematPullback
from .support.clusters import RunLog, compute_split, local_client
from .support.numbers import Counted, assert_tree_close

W = jnp.asarray(np.random.default_rng(0).standard_normal((6, 6)).astype(np.float32) / 3)
X = jnp.linspace(-1.0, 1.5, 6)


def a_fn(x):
    return jnp.tanh(W @ x)


def b_fn(a):
    if jnp.sum(a) > 0:  # Python control flow on a value: eager only
        return jnp.tanh(a) * 1.5
    return jnp.sin(a)


def c_fn(b, a):
    return jnp.cos(b * a) + a


def d_fn(c):
    return jnp.sum(c ** 2)


def e_fn(b):
    return jnp.sum(jnp.sqrt(b ** 2 + 1.0) * jnp.arange(6.0))


# c_fn with its own rule (fwd/bwd: NumPy code), the same derivative
def c_fwd(b, a):
    return np.cos(b * a) + a, (b, a)


def c_bwd(res, ct):
    b, a = res
    s = -np.sin(b * a) * ct
    return s * a, s * b + ct


def dag_of(remat, counted=None, custom=False, jit=False):
    f = counted or {"A": a_fn, "B": b_fn, "C": c_fn, "D": d_fn, "E": e_fn}
    c = (Node(fwd=c_fwd, bwd=c_bwd, deps=["B", "A"], remat=remat) if custom
         else Node(f["C"], ["B", "A"], remat=remat, jit=jit))
    return {"A": Node(f["A"], ["x"], remat=remat, jit=jit), "B": Node(f["B"], ["A"], remat=remat),
            "C": c, "D": Node(f["D"], ["C"], remat=remat, jit=jit),
            "E": Node(f["E"], ["B"], remat=remat)}


def composed(x, wrap=lambda f: f):
    a = wrap(a_fn)(x)
    b = wrap(b_fn)(a) if wrap is not jax.checkpoint else b_fn(a)  # (b_fn branches on a value)
    c = wrap(c_fn)(b, a)
    return {"D": wrap(d_fn)(c), "E": wrap(e_fn)(b)}


@pytest.mark.parametrize("kind", ["eager", "jit", "custom"])
@pytest.mark.parametrize("remat", [True, False, "mixed"])
def test_gradients_equal_jax_grad_and_jax_checkpoint(kind, remat):
    if remat == "mixed":  # remat nodes between others, in and out of chains
        dag = dag_of(False, custom=kind == "custom", jit=kind == "jit")
        for n in ("B", "C"):
            dag[n] = Node(dag[n].fn, dag[n].deps, jit=dag[n].jit, fwd=dag[n].fwd,
                          bwd=dag[n].bwd, remat=True)
    else:
        dag = dag_of(remat, custom=kind == "custom", jit=kind == "jit")
    res = daskdag.compute_grads(dag, X, ["D", "E"])
    for o in ("D", "E"):
        value, grad = jax.value_and_grad(lambda x: composed(x)[o])(X)
        _, checkpointed = jax.value_and_grad(lambda x: composed(x, jax.checkpoint)[o])(X)
        assert_tree_close(res[o].value, value, rtol=1e-5)
        assert_tree_close(res[o].grad, grad, rtol=1e-5, atol=1e-6)
        assert_tree_close(res[o].grad, checkpointed, rtol=1e-5, atol=1e-6)


def counted_functions():
    return {k: Counted(f) for k, f in {"A": a_fn, "B": b_fn, "C": c_fn, "D": d_fn,
                                       "E": e_fn}.items()}


@pytest.mark.parametrize("fuse", [True, False])
def test_a_remat_node_runs_twice_once_per_backward_task_others_once(fuse):
    f = counted_functions()
    dag = dag_of(False, f)
    dag["B"] = Node(f["B"], ["A"], remat=True)  # B feeds C and E: both outputs' cotangents
    with dask.config.set({"daskdag.fuse-chains": fuse}):
        res = daskdag.compute_grads(dag, X, ["D", "E"])
    # B: its forward pass, then once more in its one backward task, for D and E together
    assert {k: c.calls for k, c in f.items()} == {"A": 1, "B": 2, "C": 1, "D": 1, "E": 1}
    assert_tree_close(res["D"].grad, jax.grad(lambda x: composed(x)["D"])(X), rtol=1e-5)
    f = counted_functions()
    daskdag.compute_grads(dag_of(True, f), X, ["D", "E"])
    assert {k: c.calls for k, c in f.items()} == {k: 2 for k in f}
    f = counted_functions()
    daskdag.compute_grads(dag_of(False, f), X, ["D", "E"])
    assert {k: c.calls for k, c in f.items()} == {k: 1 for k in f}


def test_a_remat_node_no_gradient_passes_through_runs_once():
    a = Counted(a_fn)
    dag = {"A": Node(a, ["t"], remat=True), "L": (lambda a, x: jnp.sum(a * x), ["A", "x"])}
    res = daskdag.compute_grads(dag, {"t": X, "x": 2.0 * X}, "L", wrt=["x"])
    assert a.calls == 1
    assert_tree_close(res.grad["x"], a_fn(X), rtol=1e-6)


def test_the_user_s_own_rule_is_redone():
    runs = []

    def fwd(b, a):
        runs.append("fwd")
        return c_fwd(b, a)

    def bwd(res, ct):
        runs.append("bwd")
        return c_bwd(res, ct)

    dag = dag_of(False)
    dag["C"] = Node(fwd=fwd, bwd=bwd, deps=["B", "A"], remat=True)
    res = daskdag.compute_grads(dag, X, "D")
    assert runs == ["fwd", "fwd", "bwd"]
    assert_tree_close(res.grad, jax.grad(lambda x: composed(x)["D"])(X), rtol=1e-5, atol=1e-6)


def test_the_config_default():
    f = counted_functions()
    dag = {"A": (f["A"], ["x"]), "B": (f["B"], ["A"]), "D": Node(f["D"], ["B"], remat=False)}
    with dask.config.set({"daskdag.remat": True}):
        res = daskdag.compute_grads(dag, X, "D")
    assert {k: f[k].calls for k in dag} == {"A": 2, "B": 2, "D": 1}
    assert_tree_close(res.grad, jax.grad(lambda x: d_fn(b_fn(a_fn(x))))(X), rtol=1e-5)
    assert daskdag.config.get("remat") is False
    with dask.config.set({"daskdag.remat": True}):
        spec = daskdag.model.spec.parse({"A": (a_fn, ["x"]), "B": Node(b_fn, ["A"]),
                                         "C": Node(b_fn, ["B"], remat=False)})
    assert [spec.nodes[n].remat for n in "ABC"] == [True, True, False]


def test_a_bad_remat_is_named():
    with pytest.raises(DAGError, match="node 'A': remat must be True, False or None"):
        daskdag.compute_grads({"A": Node(a_fn, ["x"], remat="yes")}, X, "A")


def test_jacobians_and_sweeps_with_remat():
    dag = dag_of(True)
    res = daskdag.jacobian(dag, X, ["D", "E"], chunk_size=2)
    for o in ("D", "E"):
        assert_tree_close(res[o].grad, jax.jacrev(lambda x: composed(x)[o])(X), rtol=1e-5)
    xs = jnp.stack([X, -X, 0.5 * X])
    for vmap in (False, True):
        dag = dag_of(True)
        dag["C"] = Node(c_fn, ["B", "A"], remat=True, vmap=vmap)
        res = daskdag.sweep_grads(dag, xs, ["D", "E"], chunk_size=2)
        for o in ("D", "E"):
            want = jnp.stack([jax.grad(lambda x: composed(x)[o])(x) for x in xs])
            assert_tree_close(res[o].grad, want, rtol=1e-5, atol=1e-6)


# -- residual sizes -------------------------------------------------------------------------------

N, M = 500, 2000


def wide(x, w):
    return jnp.sum(jnp.tanh(x[:, None] * w), axis=0)


def forward_result(dag, inputs, wrt):
    """The forward task of node H as Dask holds it: ``(values, pullback)``."""
    with dask.config.set({"daskdag.close-stages": False, "daskdag.fuse-chains": False}):
        call = daskdag.grads(dag, inputs, "L", wrt=wrt)
    dsk = dict(call.__dask_graph__())
    [key] = [k for k in dsk if k.startswith("fwd:H-")]
    return dask.get(dsk, key), call


@pytest.mark.parametrize("remat", [False, True])
def test_residual_sizes_as_dask_sees_them(remat):
    w = jnp.asarray(np.random.default_rng(1).standard_normal((N, M)).astype(np.float32))
    inputs = {"x": jnp.linspace(0.0, 1.0, N), "w": w}
    dag = {"H": Node(wide, ["x", "w"], remat=remat), "L": (lambda h: jnp.sum(h ** 2), ["H"])}
    (values, pullback), call = forward_result(dag, inputs, ["x"])
    # JAX's tanh keeps its output and 1 - its output: two (N, M) float32 arrays. The input w,
    # which the backward task holds anyway, is not counted.
    held = 0 if remat else 2 * N * M * 4
    assert abs(sizeof(pullback) - held) <= 0.02 * N * M * 4
    assert abs(sizeof((values, pullback)) - held) <= 0.02 * N * M * 4 + sizeof(values) + 1024
    if remat:
        assert isinstance(pullback.pullbacks[0], RematPullback)
        assert sizeof(pullback) == 0
    grad = jax.grad(lambda x: jnp.sum(wide(x, w) ** 2))(inputs["x"])
    assert_tree_close(call.compute().grad["x"], grad, rtol=1e-4)


def test_a_remat_pullback_travels_as_its_node():
    (values, pullback), _ = forward_result(
        {"H": Node(wide, ["x", "w"], remat=True), "L": (jnp.sum, ["H"])},
        {"x": jnp.ones(4), "w": jnp.ones((4, 3))}, ["x", "w"])
    header, frames = serialize(pullback)
    assert sum(len(memoryview(f)) for f in frames) < 20_000
    moved = deserialize(header, frames)
    ct = (jnp.arange(3.0),)
    args = (jnp.ones(4), jnp.ones((4, 3)))
    want = jax.vjp(wide, *args)[1](ct[0])
    got = moved((ct,), args)
    assert_tree_close([g[0] for g in got], list(want), rtol=1e-6)


# -- on a cluster ---------------------------------------------------------------------------------

@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_on_a_process_cluster_with_the_backward_task_on_another_worker(tmp_path):
    log = RunLog(tmp_path / "runs")
    f = {"A": a_fn, "B": log.wrap("B", b_fn), "C": c_fn, "D": d_fn, "E": e_fn}
    dag = dag_of(False, f)
    dag["B"] = Node(f["B"], ["A"], remat=True)
    dag["C"] = Node(fwd=c_fwd, bwd=c_bwd, deps=["B", "A"], remat=True)
    with local_client() as client:
        a, b = sorted(client.scheduler_info()["workers"])
        pids = client.run(os.getpid)
        moved, ran = compute_split(client, dag, X, ["D", "E"], a, b)
        # B ran forward on a, and again in its backward task, on b
        assert log.pids("B") == [pids[a], pids[b]], log.runs()
        for o in ("D", "E"):
            value, grad = jax.value_and_grad(lambda x: composed(x)[o])(X)
            assert_tree_close(moved[o][0], value, rtol=1e-5)
            assert_tree_close(moved[o][1]["x"], grad, rtol=1e-5, atol=1e-6)
        with dask.config.set({"daskdag.remat": True}):
            res = daskdag.compute_grads(dag_of(None), X, ["D", "E"], client=client)
        for o in ("D", "E"):
            assert_tree_close(res[o].grad, jax.grad(lambda x: composed(x)[o])(X), rtol=1e-5)
