"""Internal: daskdag's task keys (``kind:label[outputs]-token``: ``fwd:A+B-...``, a stage's
forward task; ``bwd:A+B[D+E]-...``, its backward task for outputs D and E) and the graph layout
they spell: stages, shared forward tasks, backward tasks per stage, annotated layers, the debug
log and the picture of a call.

What this layout is for (each node run once, calls computed together sharing their work, nodes
run where their resources are) is tested without key spellings in the public tests: test_once,
test_lazy, test_schedulers, test_jvps, test_logging; these tests come from there."""

import logging
import shutil

import dask
import jax
import jax.numpy as jnp
import pytest
from dask.core import get_dependencies

import daskdag

from .support.keys import key_kind, key_label, key_outputs
from .support.numbers import seed_functions

V5 = jnp.array([0.3, -1.0, 0.5, 2.0, 0.1], dtype=jnp.float32)


def _tasks(call):
    """The low-level Dask graph of a lazy call (``daskdag.grads``, ``jvps``)."""
    return dict(call.__dask_graph__())


def _keys(call) -> list[str]:
    return [str(k) for k in _tasks(call)]


def _deps(call):
    g = _tasks(call)
    return {str(k): {str(d) for d in get_dependencies(g, k)} for k in g}


def _fwd(call) -> set[str]:
    return {k for k in _keys(call) if key_kind(k) == "fwd"}


def has(keys, kind, label):
    return any(key_kind(k) == kind and key_label(k) == label for k in keys)


# -- gradients (from test_once.py) ----------------------------------------------------------------

def test_a_node_without_differentiated_input_gets_no_pullback():
    """S depends on the constant c alone: node by node, its value is its forward task's result
    (no value task picks it out of a pullback), and it has no backward task."""
    dag = {"S": (lambda c: c * 2.0, ["c"]), "y": (lambda s, x: jnp.sum(s * x), ["S", "x"])}
    inputs = {"c": jnp.ones(3), "x": jnp.arange(3.0)}
    with dask.config.set({"daskdag.fuse-chains": False}):  # S a stage of its own
        graph = daskdag.grads(dag, inputs, "y", wrt=["x"])
    parts = {(key_kind(k), key_label(k), key_outputs(k)) for k in _keys(graph)}
    assert ("fwd", "S", "") in parts  # its value is its forward task's result
    assert ("val", "S", "") not in parts and ("bwd", "S", "y") not in parts
    assert ("bwd", "y", "y") in parts


def test_outputs_share_one_set_of_forward_keys(seed, x5):
    dag, _, _ = seed
    both = daskdag.grads(dag, x5, ["D", "E"])

    # One forward task per stage (chains of nodes), each node in one of them.
    assert sorted(map(key_label, _fwd(both))) == ["A+B", "C+D", "E"]

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
    assert sorted(map(key_label, _fwd(both))) == ["A", "B", "C", "D", "E"]
    assert _fwd(both) == _fwd(only_d) | _fwd(only_e)
    assert _fwd(only_d) & _fwd(only_e) == {k for k in _fwd(both) if key_label(k) in "AB"}


def test_chains_fuse_but_fan_out_keeps_its_tasks():
    """x -> A -> B -> {C, D}; C -> E: A+B and C+E fuse, D stays alone."""
    dag = {"A": (jnp.sin, ["x"]), "B": (jnp.cos, ["A"]), "C": (jnp.tanh, ["B"]),
           "D": (jnp.sum, ["B"]), "E": (jnp.sum, ["C"])}
    graph = daskdag.grads(dag, jnp.linspace(0.0, 1.0, 4), ["D", "E"])
    assert sorted(map(key_label, _fwd(graph))) == ["A+B", "C+E", "D"]


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
    assert [key_label(k) for k in _keys(graph) if key_kind(k) == "fwd"] == ["n0+298more+n299"]
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


# -- where a call runs (from test_schedulers.py) -----------------------------------------------------

def test_stages_and_backward_tasks_of_a_trunk_with_two_heads():
    """test_schedulers' DAG, x -> A -> B -> {D, E}: each node once (A and B as one stage); per
    stage, the outputs it pulls back: A+B's for both at once. (Built here: the same graph, keys
    included, as the one its cluster test runs.)"""
    dag = {"A": (lambda x: jnp.tanh(x) * 2, ["x"]), "B": (lambda a: a ** 2 + 1, ["A"]),
           "D": (lambda b: jnp.sum(jnp.log(b)), ["B"]), "E": (lambda b: jnp.sum(b ** 0.5), ["B"])}
    keys = _keys(daskdag.grads(dag, jnp.linspace(-1.0, 1.0, 6), ["D", "E"]))
    assert sorted(key_label(k) for k in keys if key_kind(k) == "fwd") == ["A+B", "D", "E"]
    assert {key_outputs(k) for k in keys if key_kind(k) == "bwd"} == {"D", "E", "D+E"}


# -- forward mode (from test_jvps.py) -------------------------------------------------------------

def _jvp_keys(dag, x, tangents, outputs, batched=False):
    """The task keys of a call's graph (built locally)."""
    return _keys(daskdag.jvps(dag, x, tangents, outputs, batched=batched))


def test_keys_mirror_the_forward_graph(seed, x5):
    dag, _, _ = seed
    keys = _jvp_keys(dag, x5, V5, ["D", "E"])
    assert has(keys, "jvp", "A+B"), keys  # a chain: one task
    # (a value and its tangent travel together, a pair: no task of a tangent)
    assert not any(key_kind(k) in ("tan", "tangent") for k in keys)
    assert not any(key_kind(k) == "input" and key_label(k) == "x" for k in keys)  # inline
    assert keys == _jvp_keys(dag, x5, V5, ["D", "E"])  # deterministic


def test_a_node_no_tangent_reaches_has_the_gradient_graphs_forward_key():
    """C, which no tangent reaches, runs as in the gradient graph, under the same key."""
    dag = {"A": (lambda x, w: jnp.tanh(w @ x), ["x", "w"]),
           "B": (lambda a, s: jnp.sum(a) * s, ["A", "s"]),
           "C": (lambda w: jnp.sum(w ** 2), ["w"])}
    k = jax.random.split(jax.random.key(0), 2)
    inputs = {"x": jax.random.normal(k[0], (4,)), "w": jax.random.normal(k[1], (3, 4)),
              "s": jnp.float32(1.5)}
    fwd = [k for k in _jvp_keys(dag, inputs, {"x": jnp.ones(4)}, ["B", "C"]) if key_kind(k) == "fwd"]
    graph = daskdag.grads(dag, inputs, ["B", "C"], wrt=["x"], cotangents={"B": 1.0, "C": 1.0})
    assert fwd and [k for k in fwd if key_label(k) == "C"] == [
        k for k in _keys(graph) if key_kind(k) == "fwd" and key_label(k) == "C"]


def test_tasks_of_nodes_with_resources_are_annotated():
    dag = {"A": daskdag.Node(jnp.sin, ["x"], resources={"FOO": 1}), "B": (jnp.cos, ["A"])}
    hlg = daskdag.jvps(dag, jnp.ones(2), jnp.ones(2), "B").__dask_graph__()
    placed = {str(key) for layer in hlg.layers.values()
              if (layer.annotations or {}).get("resources") == {"FOO": 1} for key in layer}
    assert has(placed, "jvp", "A"), placed
    assert not has(placed, "jvp", "B") and not any(key_kind(k) == "grad" for k in placed)


# -- lazy calls, the log (from test_lazy.py, test_logging.py) ---------------------------------------

def _seed_dag():
    f = seed_functions()
    return {"A": (f["x_to_A"], ["x"]), "B": (f["A_to_B"], ["A"]), "C": (f["B_to_C"], ["B"]),
            "D": (f["C_to_D"], ["C"]), "E": (f["B_to_E"], ["B"])}


def test_two_calls_share_the_trunks_forward_task(x5):
    dag = _seed_dag()
    g, j = daskdag.grads(dag, x5, ["D", "E"]), daskdag.jacobians(dag, x5, ["D", "E"])
    shared = set(_keys(g)) & set(_keys(j))
    assert any(key_kind(k) == "fwd" and key_label(k) == "A+B" for k in shared)  # the trunk's


def test_debug_log_names_the_closed_stage_and_the_gradient_task(caplog):
    """One chain stage, closed (its forward task pulls back too), and the gradient's task."""
    dag = {"A": (jnp.sin, ["x"]), "B": (jnp.cumsum, ["A"]), "L": (jnp.sum, ["B"])}
    with caplog.at_level(logging.DEBUG, logger="daskdag"):
        daskdag.compute_grads(dag, jnp.arange(3.0), "L")
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and r.name == "daskdag"]
    assert any(m.startswith("  task fwd:A+B+L-") and m.endswith(": forward_backward") for m in debug)
    assert any(m.startswith("  task grad:L[x]-") for m in debug)


@pytest.mark.skipif(shutil.which("dot") is None,
                    reason="graphviz's `dot` program is not installed (apt-get install graphviz)")
@pytest.mark.subprocess
def test_visualize_labels_tasks_by_kind_and_stage(tmp_path, x5):
    call = daskdag.grads(_seed_dag(), x5, ["D", "E"])
    out = tmp_path / "seed.svg"
    call.visualize(filename=str(out))
    svg = out.read_text().replace("&#45;", "-")
    for label in ("fwd:A+B", "val:B", "fwd:C+D", "bwd:A+B[D+E]", "grad:D[x]", "grad:E[x]"):
        assert f">{label}<" in svg
