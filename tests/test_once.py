"""Each node runs at most once per call; unrequested nodes never run; outputs share forward tasks."""

import jax
import jax.numpy as jnp
import dask
from dask.core import get_dependencies

import daskdag
from daskdag.api import build_graph


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
    r = daskdag.compute_grads(dag, inputs, "y", wrt=["x"])
    assert seen["tracer"] is False
    _, _, graph = build_graph(dag, inputs, "y", wrt=["x"])
    keys = [str(k) for k in _keys(graph)]
    assert not any(k.startswith(("pb-S-", "bwd-y-S-")) for k in keys)
    assert any(k.startswith("pb-y-") for k in keys)
    assert jnp.allclose(r.grad["x"], 2.0)


def _tasks(graph):
    """The low-level Dask graph behind the delayed structure ``graph``."""
    return dict(dask.delayed(graph).__dask_graph__())


def _keys(graph):
    return _tasks(graph).keys()


def _deps(graph):
    g = _tasks(graph)
    return {str(k): {str(d) for d in get_dependencies(g, k)} for k in g}


def test_outputs_share_one_set_of_forward_keys(seed, x5):
    dag, _, _ = seed
    _, _, both = build_graph(dag, x5, ["D", "E"])
    _, _, only_d = build_graph(dag, x5, ["D"])
    _, _, only_e = build_graph(dag, x5, ["E"])
    fwd = lambda g: {k for k in map(str, _keys(g)) if k.startswith("fwd-")}

    # One forward task per node, and the same keys as when each output is asked for alone.
    assert sorted(k.split("-")[1] for k in fwd(both)) == ["A", "B", "C", "D", "E"]
    assert fwd(both) == fwd(only_d) | fwd(only_e)
    assert fwd(only_d) & fwd(only_e) == {k for k in fwd(both) if k.split("-")[1] in "AB"}

    # Both outputs' backward passes through B read the single pullback of B.
    deps = _deps(both)
    (pb_b,) = [k for k in deps if k.startswith("pb-B-")]
    bwd_b = [k for k in deps if k.startswith(("bwd-D-B-", "bwd-E-B-"))]
    assert len(bwd_b) == 2 and all(pb_b in deps[k] for k in bwd_b)
    # E's backward at B takes its cotangent from E alone; D's from C.
    (bwd_e_b,) = [k for k in bwd_b if k.startswith("bwd-E-")]
    assert any(d.startswith("bwd-E-E-") for d in deps[bwd_e_b])


def test_graph_layers_follow_placement_not_node_count():
    """A 300-node chain is one graph layer (one ``delayed`` call per task made building
    quadratic); a GPU node in the middle adds layers annotated with its resources, holding
    exactly its own forward and backward tasks."""
    def f(h):
        return jnp.sin(h)

    names = [f"n{i}" for i in range(300)]
    dag = {n: (f, [prev]) for n, prev in zip(names, ["x"] + names)}
    _, _, graph = build_graph(dag, jnp.float32(0.5), names[-1])
    value, grads = graph[names[-1]]
    assert len(value.dask.layers) == 1 and value.dask is grads["x"].dask
    assert sum(str(k).startswith("fwd-") for k in _keys(graph)) == 300

    dag["n150"] = daskdag.Node(f, ["n149"], device="gpu")
    _, _, graph = build_graph(dag, jnp.float32(0.5), names[-1])
    layers = graph[names[-1]][0].dask.layers.values()
    placed = [str(k) for layer in layers if layer.annotations for k in layer]
    # forward before n150, n150, after it; backward down to n150, n150, below it
    assert [bool(layer.annotations) for layer in layers] == [False, True, False, True, False]
    assert all(layer.annotations == {"resources": {"GPU": 1}} for layer in layers if layer.annotations)
    assert {k.split("-")[0] for k in placed} == {"fwd", "val", "pb", "bwd"}
    assert all("-n150-" in k for k in placed) and len(placed) == 4
