"""On a cluster, a stage whose differentiated inputs are small call inputs carries its backward
pass as its dense Jacobian (:mod:`daskdag.graph.dense`): no value task and no backward task of
its own, the gradient task applies it. Every path that builds such a graph gives the numbers of
JAX's own transforms of the composed function, and those of the schedule with a backward task
per stage (``daskdag.dense-inputs: 0``); the scheduler shows which tasks ran.
"""

import graphlib
import time

import dask
import distributed
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import Node

from .support.keys import key_kind, key_label
from .support.numbers import assert_tree_close

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

X = jnp.linspace(0.2, 1.0, 5)
W = {"a": jnp.linspace(0.5, 1.5, 5), "b": jnp.array([0.3, -0.2])}
S = jnp.float32(1.5)  # an input no gradient is asked of
INPUTS = {"x": X, "w": W, "s": S}
WRT = ["x", "w"]
OFF = {"daskdag.dense-inputs": 0}


def branch(i):
    def f(x):
        return x ** 2 * (i + 1.0) + jnp.sin(x)
    return f


def make_dag(remat_branch: bool = False) -> dict:
    """``P+Q``, a fused stage of two exposed values taking x and w (12 elements); ``S0..S2``,
    eager branches of x; ``K``, a node of the constant s; ``R``, an eager node of P and K
    (whose deps are nodes: the usual schedule); two scalar outputs."""
    dag = {
        "P": Node(lambda x: jnp.tanh(x * 2.0), ["x"], jit=True),
        "Q": Node(lambda P, w: P * w["a"] + jnp.sum(w["b"]), ["P", "w"], jit=True),
        "K": (lambda s: s * 3.0, ["s"]),
        "R": (lambda P, K: jnp.sin(P) * K, ["P", "K"]),
        "L1": (lambda Q, R, *S: jnp.sum(Q) + jnp.sum(R ** 2) + sum(jnp.sum(s ** 2) for s in S),
               ["Q", "R", "S0", "S1", "S2"]),
        "L2": (lambda Q, S0: jnp.sum(Q * S0), ["Q", "S0"]),
    }
    for i in range(3):
        dag[f"S{i}"] = Node(branch(i), ["x"], remat=remat_branch and i == 1)
    return dag


def composed(dag, output):
    """The DAG as one function of its inputs (a dict), evaluated in topological order."""
    entries = {n: (e.fn, e.deps) if isinstance(e, Node) else e for n, e in dag.items()}
    order = graphlib.TopologicalSorter({n: [d for d in deps if d in entries]
                                        for n, (_, deps) in entries.items()}).static_order()

    def f(inputs):
        values = dict(inputs)
        for name in order:
            fn, deps = entries[name]
            values[name] = fn(*(values[d] for d in deps))
        return values[output]
    return f


def of(inputs, wrt=WRT):
    """Split ``inputs`` into the differentiated ones and the rest, for JAX's transforms."""
    held = {k: v for k, v in inputs.items() if k not in wrt}
    return {k: inputs[k] for k in wrt}, held


def kinds(stream) -> set:
    """``(kind, label)`` of every daskdag task the scheduler ran."""
    return {(key_kind(t["key"]), key_label(t["key"])) for t in stream.data}


def on_cluster(client, call, dense: bool):
    """``call()`` with the dense schedule on or off, and the kinds of tasks it ran."""
    with dask.config.set({} if dense else OFF), distributed.get_task_stream(client) as stream:
        out = call()
    return out, kinds(stream)


def assert_dense(ran_dense: set, ran_plain: set, stages=("P+Q", "S0", "S2")):
    for s in stages:
        assert ("fwd", s) in ran_dense and ("fwd", s) in ran_plain
        assert ("bwd", s) not in ran_dense and ("val", s) not in ran_dense
        assert ("bwd", s) in ran_plain
    assert ("bwd", "R") in ran_dense  # (deps that are nodes: a backward task of its own)


def test_gradients_same_as_jax_and_as_the_task_per_stage_schedule(client):
    dag = make_dag()
    call = lambda: daskdag.compute_grads(dag, INPUTS, ["L1", "L2"], wrt=WRT, client=client)
    dense, ran_dense = on_cluster(client, call, True)
    plain, ran_plain = on_cluster(client, call, False)
    diff, held = of(INPUTS)
    for o in ("L1", "L2"):
        value, grad = jax.value_and_grad(lambda d: composed(dag, o)({**d, **held}))(diff)
        for res in (dense[o], plain[o]):
            assert_tree_close(res.value, value, rtol=1e-5)
            assert_tree_close(res.grad, grad, rtol=1e-5)
    assert_dense(ran_dense, ran_plain)


def test_jacobians_same(client):
    dag = make_dag()
    for mode in ("rev", "fwd"):
        call = lambda: daskdag.jacobian(dag, INPUTS, ["L2", "Q"], wrt=WRT, mode=mode,
                                        client=client)
        dense, ran_dense = on_cluster(client, call, True)
        plain, _ = on_cluster(client, call, False)
        diff, held = of(INPUTS)
        for o in ("L2", "Q"):
            jac = jax.jacrev(lambda d: composed(dag, o)({**d, **held}))(diff)
            assert_tree_close(dense[o].grad, jac, rtol=1e-5)
            assert_tree_close(plain[o].grad, jac, rtol=1e-5)
        if mode == "rev":
            assert ("bwd", "S0") not in ran_dense and ("fwd", "S0") in ran_dense


def test_hvps_same(client):
    dag = make_dag()
    v = {"x": jnp.linspace(1.0, -1.0, 5), "w": {"a": jnp.full(5, 0.5), "b": jnp.array([1.0, 2.0])}}
    call = lambda: daskdag.compute_hvps(dag, INPUTS, v, "L1", wrt=WRT, client=client)
    dense, _ = on_cluster(client, call, True)
    plain, _ = on_cluster(client, call, False)
    diff, held = of(INPUTS)
    f = lambda d: composed(dag, "L1")({**d, **held})
    hvp = jax.jvp(jax.grad(f), (diff,), (v,))[1]
    for res in (dense, plain):
        assert_tree_close(res.value, f(diff), rtol=1e-5)
        assert_tree_close(res.grad, jax.grad(f)(diff), rtol=1e-5)
        assert_tree_close(res.hvp, hvp, rtol=1e-5)


def test_jvps_same(client):
    dag = make_dag()
    t = {"x": jnp.ones(5), "w": {"a": jnp.zeros(5), "b": jnp.ones(2)}, "s": jnp.float32(0.0)}
    call = lambda: daskdag.compute_jvps(dag, INPUTS, t, ["L1", "L2"], client=client)
    dense, _ = on_cluster(client, call, True)
    plain, _ = on_cluster(client, call, False)
    for o in ("L1", "L2"):
        value, tangent = jax.jvp(composed(dag, o), (INPUTS,), (t,))
        for res in (dense[o], plain[o]):
            assert_tree_close(res.value, value, rtol=1e-5)
            assert_tree_close(res.tangent, tangent, rtol=1e-5)


def test_sweeps_same(client):
    dag = make_dag()
    xs = jnp.stack([X + 0.1 * k for k in range(6)])
    call = lambda: daskdag.sweep_grads(dag, {**INPUTS, "x": xs}, "L1", batched=["x"],
                                       wrt=WRT, client=client)
    dense, _ = on_cluster(client, call, True)
    plain, _ = on_cluster(client, call, False)
    f = lambda x, w: composed(dag, "L1")({"x": x, "w": w, "s": S})
    values, (gx, gw) = jax.vmap(jax.value_and_grad(f, argnums=(0, 1)), in_axes=(0, None))(xs, W)
    for res in (dense, plain):
        assert_tree_close(res.value, values, rtol=1e-5)
        assert_tree_close(res.grad["x"], gx, rtol=1e-5)
        assert_tree_close(res.grad["w"], jax.tree.map(lambda g: g, gw), rtol=1e-5)


def test_a_remat_node_keeps_its_backward_task(client):
    dag = make_dag(remat_branch=True)
    call = lambda: daskdag.compute_grads(dag, INPUTS, "L1", wrt=WRT, client=client)
    dense, ran_dense = on_cluster(client, call, True)
    plain, ran_plain = on_cluster(client, call, False)
    diff, held = of(INPUTS)
    value, grad = jax.value_and_grad(lambda d: composed(dag, "L1")({**d, **held}))(diff)
    for res in (dense, plain):
        assert_tree_close(res.value, value, rtol=1e-5)
        assert_tree_close(res.grad, grad, rtol=1e-5)
    assert ("bwd", "S1") in ran_dense  # (remat: recomputed in its backward task, as before)
    assert_dense(ran_dense, ran_plain)


def test_a_large_output_keeps_its_pullback_and_the_numbers():
    """More rows than a dense Jacobian is made from (:data:`daskdag.graph.dense.MOST_ROWS`):
    the stage's pullback travels to the gradient task instead, with the same numbers."""
    from .support.clusters import local_client

    big = lambda x: jnp.outer(jnp.sin(x), jnp.arange(200.0))
    dag = {"Big": (big, ["x"]), "M": (lambda Big: Big[:, :3] * 2.0, ["Big"]),
           "L": (lambda Big, M: jnp.sum(Big ** 2) + jnp.sum(M), ["Big", "M"])}
    with local_client(2) as client:
        res, ran = on_cluster(client, lambda: daskdag.compute_grads(dag, X, "L", client=client),
                              True)
    f = lambda x: jnp.sum(big(x) ** 2) + jnp.sum(big(x)[:, :3] * 2.0)
    assert_tree_close(res.value, f(X), rtol=1e-5)
    assert_tree_close(res.grad, jax.grad(f)(X), rtol=1e-5)
    assert ("fwd", "Big") in ran and ("bwd", "Big") not in ran


def test_a_numpy_node_with_its_own_vjp(client):
    """A node outside JAX (its pullback cannot be vmapped): its Jacobian is made row by row."""
    def np_sin(x):
        return np.sin(np.asarray(x))

    def np_sin_vjp(ct, out, x):
        return (np.asarray(ct) * np.cos(np.asarray(x)),)

    dag = {"N": Node(np_sin, ["x"], vjp=np_sin_vjp), "M": (lambda N: N * 2.0, ["N"]),
           "L": (lambda N, M: jnp.sum(N ** 3) + jnp.sum(M), ["N", "M"])}
    call = lambda: daskdag.compute_grads(dag, X, "L", client=client)
    dense, ran_dense = on_cluster(client, call, True)
    plain, ran_plain = on_cluster(client, call, False)
    f = lambda x: jnp.sum(jnp.sin(x) ** 3) + jnp.sum(2.0 * jnp.sin(x))
    for res in (dense, plain):
        assert_tree_close(res.value, f(X), rtol=1e-5)
        assert_tree_close(res.grad, jax.grad(f)(X), rtol=1e-5)
    assert ("bwd", "N") not in ran_dense and ("bwd", "N") in ran_plain


def test_the_fault_tests_dag_takes_the_dense_schedule(client):
    """tests/test_lost_workers.py kills every worker mid-call on its DAG: its first stage (A+B,
    of x and w) is dense, so those tests hold the dense schedule through lost workers too."""
    from .test_lost_workers import X as FX, W as FW, check_grads, make_dag as fault_dag

    call = lambda: daskdag.compute_grads(fault_dag(0.0), {"x": FX, "w": FW}, ["C", "E"],
                                         client=client)
    res, ran = on_cluster(client, call, True)
    check_grads(res)
    assert ("fwd", "A+B") in ran and ("bwd", "A+B") not in ran


def test_a_wide_dag_runs_one_task_per_branch(client):
    """The issue-30 shape: branches of a small input and one head. Per branch only its forward
    task runs; the head's task and one gradient task follow."""
    n = 12

    def wait_branch(i):
        def f(x):
            time.sleep(0.01)
            return jnp.sin(x * (i + 1))
        return f

    dag = {f"B{i}": (wait_branch(i), ["x"]) for i in range(n)}
    dag["head"] = (lambda *b: sum(jnp.sum(v) for v in b), [f"B{i}" for i in range(n)])
    call = lambda: daskdag.compute_grads(dag, X, "head", client=client)
    res, ran = on_cluster(client, call, True)
    f = lambda x: sum(jnp.sum(jnp.sin(x * (i + 1))) for i in range(n))
    assert_tree_close(res.value, f(X), rtol=1e-5)
    assert_tree_close(res.grad, jax.grad(f)(X), rtol=1e-5)
    per_kind = {}
    for kind, label in ran:
        per_kind.setdefault(kind, set()).add(label)
    assert per_kind["fwd"] == {f"B{i}" for i in range(n)} | {"head"}
    assert per_kind.get("bwd", set()) == set()  # (the head's cotangents, taken inside the gradient task)
    assert per_kind["val"] == {"head"} and per_kind["grad"] == {"head"}
