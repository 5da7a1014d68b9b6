"""Each node runs at most once per call; unrequested nodes never run; outputs share forward tasks."""

import jax
import jax.numpy as jnp
import dask
from dask.core import get_dependencies

import daskdag

from .conftest import key_kind, key_label, key_outputs


def test_each_node_called_once_for_many_outputs(seed, x5):
    dag, f, _ = seed
    cts = {"B": jnp.ones(5), "C": jnp.ones(5)}
    daskdag.compute_grads(dag, x5, ["B", "C", "D", "E"], cotangents=cts)
    assert {k: v.calls for k, v in f.items()} == dict.fromkeys(f, 1)


def test_unrequested_nodes_never_run(seed, x5):
    dag, f, _ = seed
    daskdag.compute_grads(dag, x5, ["E"])
    assert f["B_to_C"].calls == 0 and f["C_to_D"].calls == 0
    assert f["x_to_A"].calls == f["A_to_B"].calls == f["B_to_E"].calls == 1


def test_node_without_differentiated_input_runs_plainly():
    seen = {}

    def scale(c):  # depends only on the constant c
        seen["tracer"] = isinstance(c, jax.core.Tracer)
        return c * 2.0

    dag = {"S": (scale, ["c"]), "y": (lambda s, x: jnp.sum(s * x), ["S", "x"])}
    inputs = {"c": jnp.ones(3), "x": jnp.arange(3.0)}
    r = daskdag.compute_grads(dag, inputs, "y", wrt=["x"])  # S and y: one stage, one task
    assert seen["tracer"] is False
    assert jnp.allclose(r.grad["x"], 2.0)
    with dask.config.set({"daskdag.fuse-chains": False}):  # S a stage of its own
        r = daskdag.compute_grads(dag, inputs, "y", wrt=["x"])
        graph = daskdag.grads(dag, inputs, "y", wrt=["x"])
    assert seen["tracer"] is False and jnp.allclose(r.grad["x"], 2.0)
    keys = [str(k) for k in _keys(graph)]
    parts = {(key_kind(k), key_label(k), key_outputs(k)) for k in keys}
    assert ("fwd", "S", "") in parts  # its value is its forward task's result
    assert ("val", "S", "") not in parts and ("bwd", "S", "y") not in parts
    assert ("bwd", "y", "y") in parts


def _tasks(call):
    """The low-level Dask graph of a lazy call (``daskdag.grads``)."""
    return dict(call.__dask_graph__())


def _keys(graph):
    return _tasks(graph).keys()


def _deps(graph):
    g = _tasks(graph)
    return {str(k): {str(d) for d in get_dependencies(g, k)} for k in g}


def test_outputs_share_one_set_of_forward_keys(seed, x5):
    dag, _, _ = seed
    both = daskdag.grads(dag, x5, ["D", "E"])
    fwd = lambda g: {k for k in map(str, _keys(g)) if key_kind(k) == "fwd"}

    # One forward task per stage (chains of nodes), each node in one of them.
    assert sorted(map(key_label, fwd(both))) == ["A+B", "C+D", "E"]

    # One backward task pulls both outputs' cotangents back through A+B, from its single forward
    # task; it takes E's from E's own stage, D's from C+D's.
    deps = _deps(both)
    (fwd_ab,) = [k for k in deps if key_kind(k) == "fwd" and key_label(k) == "A+B"]
    (bwd_ab,) = [k for k in deps if key_kind(k) == "bwd" and key_label(k) == "A+B"]
    assert key_outputs(bwd_ab) == "D+E" and fwd_ab in deps[bwd_ab]
    assert {key_label(d) for d in deps[bwd_ab] if key_kind(d) == "bwd"} == {"E", "C+D"}

    # Node by node (fusion off), the outputs' keys are those each gets when asked for alone.
    with dask.config.set({"daskdag.fuse-chains": False}):
        both = daskdag.grads(dag, x5, ["D", "E"])
        only_d = daskdag.grads(dag, x5, ["D"])
        only_e = daskdag.grads(dag, x5, ["E"])
    assert sorted(map(key_label, fwd(both))) == ["A", "B", "C", "D", "E"]
    assert fwd(both) == fwd(only_d) | fwd(only_e)
    assert fwd(only_d) & fwd(only_e) == {k for k in fwd(both) if key_label(k) in "AB"}


def test_chains_fuse_but_fan_out_keeps_its_tasks():
    """x -> A -> B -> {C, D}; C -> E: A+B and C+E fuse, D stays alone; every node once."""
    calls = []

    def node(name, f):
        return lambda *a: (calls.append(name), f(*a))[1]

    dag = {"A": (node("A", jnp.sin), ["x"]), "B": (node("B", jnp.cos), ["A"]),
           "C": (node("C", jnp.tanh), ["B"]), "D": (node("D", jnp.sum), ["B"]),
           "E": (node("E", jnp.sum), ["C"])}
    x = jnp.linspace(0.0, 1.0, 4)
    graph = daskdag.grads(dag, x, ["D", "E"])
    assert sorted(key_label(k) for k in map(str, _keys(graph)) if key_kind(k) == "fwd") == \
        ["A+B", "C+E", "D"]
    res = daskdag.compute_grads(dag, x, ["D", "E"])
    assert sorted(calls) == ["A", "B", "C", "D", "E"]
    f = lambda x: jnp.cos(jnp.sin(x))
    assert jnp.allclose(res["D"].grad, jax.grad(lambda x: jnp.sum(f(x)))(x))
    assert jnp.allclose(res["E"].grad, jax.grad(lambda x: jnp.sum(jnp.tanh(f(x))))(x))


def test_graph_layers_follow_placement_not_node_count():
    """A 300-node chain is one stage, in one graph layer (one ``delayed`` call per task made
    building quadratic); a GPU node in the middle splits it and adds layers annotated with its
    resources, holding exactly its own forward and backward tasks."""
    def f(h):
        return jnp.sin(h)

    names = [f"n{i}" for i in range(300)]
    dag = {n: (f, [prev]) for n, prev in zip(names, ["x"] + names)}
    graph = daskdag.grads(dag, jnp.float32(0.5), names[-1])
    assert len(graph.__dask_graph__().layers) == 1
    assert [key_label(k) for k in map(str, _keys(graph)) if key_kind(k) == "fwd"] == \
        ["n0+298more+n299"]
    with dask.config.set({"daskdag.fuse-chains": False}):
        graph = daskdag.grads(dag, jnp.float32(0.5), names[-1])
    assert len(graph.__dask_graph__().layers) == 1
    assert sum(key_kind(k) == "fwd" for k in _keys(graph)) == 300

    dag["n150"] = daskdag.Node(f, ["n149"], device="gpu")
    graph = daskdag.grads(dag, jnp.float32(0.5), names[-1])
    layers = graph.__dask_graph__().layers.values()
    placed = [str(k) for layer in layers if layer.annotations for k in layer]
    # forward before n150, n150, after it; backward down to n150, n150, below it
    assert [bool(layer.annotations) for layer in layers] == [False, True, False, True, False]
    assert all(layer.annotations == {"resources": {"GPU": 1}} for layer in layers if layer.annotations)
    assert {key_kind(k) for k in placed} == {"fwd", "val", "bwd"}
    assert all(key_label(k) == "n150" for k in placed) and len(placed) == 3
