"""Stages: chains of eager nodes run as one task, connected jittable nodes as one XLA program;
results as jax.grad / jax.vjp (and, in forward mode, jax.jvp / jax.jacfwd) of the composed
function, each node's function called once."""

import dask
import jax
import jax.numpy as jnp
import pytest

import daskdag
from daskdag import Node
from daskdag.graph.stages import make_stages
from daskdag.model.plan import make_plan
from daskdag.model.spec import parse

from .support.keys import key_kind, key_label
from .support.numbers import TraceLog, assert_tree_close


def _keys(dag, x, outputs, **kw) -> list[str]:
    """The task keys of a call's graph as daskdag builds it for a lazy call (here, no client is
    in effect): the graph of :func:`daskdag.grads`, not computed."""
    return list(map(str, daskdag.grads(dag, x, outputs, **kw).__dask_graph__()))


def _fwd_stages(keys):
    return sorted(key_label(k) for k in keys if key_kind(k) == "fwd")


def _jit_dag(traces: TraceLog):
    """x -> A -> B -> {C, D}, C -> E; every node jit=True; E and C requested. Each node appends
    its name to ``traces`` when traced."""
    def node(name, f):
        def fn(*a):
            traces.append(name)  # runs when traced
            return f(*a)
        return fn

    return {"A": Node(node("A", jnp.sin), ["x"], jit=True),
            "B": Node(node("B", lambda a, x: a * x), ["A", "x"], jit=True),
            "C": Node(node("C", jnp.tanh), ["B"], jit=True),
            "D": Node(node("D", lambda b: jnp.sum(b ** 2)), ["B"], jit=True),
            "E": Node(node("E", lambda c, d: jnp.sum(c) * d), ["C", "D"], jit=True)}


def _composed(x):
    b = jnp.sin(x) * x
    c = jnp.tanh(b)
    return c, jnp.sum(c) * jnp.sum(b ** 2)


def test_jittable_nodes_fuse_into_one_program_with_several_exposed_values():
    traces = TraceLog()
    dag = _jit_dag(traces)
    x = jnp.linspace(-1.0, 1.0, 5)
    keys = _keys(dag, x, ["E", "C"], cotangents={"C": jnp.ones(5)})
    assert _fwd_stages(keys) == ["A+3more+E"]  # C is requested: exposed from inside the stage
    for _ in range(2):  # the second call compiles nothing: one trace of each node in all
        res = daskdag.compute_grads(dag, x, ["E", "C"], cotangents={"C": jnp.ones(5)})
        assert_tree_close(res["E"].value, _composed(x)[1])
        assert_tree_close(res["E"].grad, jax.grad(lambda x: _composed(x)[1])(x))
        assert_tree_close(res["C"].value, _composed(x)[0])
        assert_tree_close(res["C"].grad, jax.grad(lambda x: jnp.sum(_composed(x)[0]))(x))
    assert sorted(traces) == ["A", "B", "C", "D", "E"]


def test_an_eager_node_splits_a_jittable_group():
    dag = _jit_dag(TraceLog())
    dag["C"] = Node(jnp.tanh, ["B"])  # eager: runs op by op, in a stage of its own
    x = jnp.linspace(-1.0, 1.0, 5)
    keys = _keys(dag, x, ["E"])
    assert _fwd_stages(keys) == ["A+B+D", "C", "E"]
    res = daskdag.compute_grads(dag, x, "E")
    assert_tree_close(res.grad, jax.grad(lambda x: _composed(x)[1])(x))


def test_fusion_off_runs_node_by_node():
    with dask.config.set({"daskdag.fuse-chains": False}):
        keys = _keys(_jit_dag(TraceLog()), jnp.ones(3), ["E"])
    assert _fwd_stages(keys) == ["A", "B", "C", "D", "E"]


def test_a_failing_node_in_a_fused_stage_is_named():
    dag = _jit_dag(TraceLog())
    dag["D"] = Node(lambda b: float(jnp.sum(b)), ["B"], jit=True)  # concrete value under jit
    with pytest.raises(daskdag.NodeError, match="node 'D' failed in its forward pass"):
        daskdag.compute_grads(dag, jnp.ones(3), "E")


def test_fused_vmap_nodes_in_a_sweep_match_vmapped_value_and_grad():
    w = jnp.eye(3) * 0.5
    dag = {"H": Node(lambda x, w: jnp.tanh(x @ w), ["x", "w"], vmap=True),
           "G": Node(lambda h: h * 2.0, ["H"], vmap=True),
           "L": Node(lambda h, g: jnp.sum(h * g), ["H", "G"], vmap=True),
           "M": Node(lambda g: jnp.mean(g), ["G"], vmap=True)}
    xs = jnp.linspace(-1.0, 1.0, 24).reshape(8, 3)
    res = daskdag.sweep_grads(dag, {"x": xs, "w": w}, ["L", "M"], batched=["x"], chunk_size=3)

    def composed(x):
        h = jnp.tanh(x @ w)
        return jnp.sum(h * h * 2.0), jnp.mean(h * 2.0)

    for k, o in enumerate(["L", "M"]):
        value, grad = jax.vmap(jax.value_and_grad(lambda x: composed(x)[k]))(xs)
        assert_tree_close(res[o].value, value, rtol=1e-5)
        assert_tree_close(res[o].grad["x"], grad, rtol=1e-5)


def test_jit_nodes_fused_and_eager_control_flow():
    calls = []

    def branchy(a):  # Python control flow on values: eager, under jax.jvp
        calls.append(1)
        if jnp.sum(a) > 0:
            return jnp.tanh(a) * 2.0
        return a ** 3

    dag = {"A": Node(lambda x: jnp.sin(x) + 2.0, ["x"], jit=True),
           "B": Node(lambda a: a * jnp.cos(a), ["A"], jit=True),
           "C": Node(lambda a, b: jnp.sum(a * b), ["A", "B"], jit=True),
           "D": (branchy, ["B"]),
           "E": (lambda d, c: d * c, ["D", "C"])}

    def composed(x):
        a = jnp.sin(x) + 2.0
        b = a * jnp.cos(a)
        c = jnp.sum(a * b)
        d = jnp.tanh(b) * 2.0 if jnp.sum(b) > 0 else b ** 3
        return {"B": b, "C": c, "E": d * c}

    x = jnp.linspace(-1.0, 1.0, 6)
    v = jnp.cos(jnp.arange(6.0))
    spec = parse(dag)
    assert any(s.fused for s in make_stages(make_plan(spec, ("B", "C", "E"), ("x",))))
    res = daskdag.compute_jvps(dag, x, v, ["B", "C", "E"])
    values, tangents = jax.jvp(composed, (x,), (v,))
    for o in "BCE":
        assert_tree_close(res[o].value, values[o])
        assert_tree_close(res[o].tangent, tangents[o], rtol=1e-5, atol=1e-5)
    assert len(calls) == 1
    # batched, through the fused program and the eager branch, vs jax.jacfwd
    res = daskdag.compute_jvps(dag, x, jnp.eye(6), ["C", "E"], batched=True)
    jac = jax.jacfwd(composed)(x)
    assert_tree_close(res["C"].tangent, jac["C"], atol=1e-5)
    assert_tree_close(res["E"].tangent, jnp.moveaxis(jac["E"], -1, 0), atol=1e-5)
    assert len(calls) == 2  # vmapped over the directions: still once per call


def test_a_group_never_joins_one_that_comes_after_it():
    """B's group takes A's value only after P has taken B's: N (after P) must not join A's."""
    dag = {"A": Node(jnp.sin, ["x"], jit=True),
           "B": Node(jnp.cos, ["x"], jit=True),
           "P": (lambda b: b * 2.0, ["B"]),  # eager
           "C": Node(lambda b, a: b * a, ["B", "A"], jit=True),
           "N": Node(lambda a, p: a + p, ["A", "P"], jit=True),
           "L": Node(lambda c, n: jnp.sum(c * n), ["C", "N"], jit=True)}
    x = jnp.linspace(-1.0, 1.0, 4)
    keys = _keys(dag, x, "L")
    assert _fwd_stages(keys) == ["A", "B+C", "N+L", "P"]

    def composed(x):
        a, b = jnp.sin(x), jnp.cos(x)
        return jnp.sum(b * a * (a + b * 2.0))

    res = daskdag.compute_grads(dag, x, "L")
    assert_tree_close(res.grad, jax.grad(composed)(x))


def test_tasks_grow_like_trunk_plus_heads_and_outputs_pull_back_together():
    """K heads over an L-node trunk (node by node): L + K backward tasks, not L x K; the trunk's
    pullbacks run once for all K outputs, under jax.vmap."""
    L, K = 6, 5
    dag = {f"t{i}": (jnp.sin, [f"t{i - 1}" if i else "x"]) for i in range(L)}
    dag.update({f"h{k}": (lambda t, k=k: jnp.sum(t ** (k + 1)), [f"t{L - 1}"]) for k in range(K)})
    heads = [f"h{k}" for k in range(K)]
    x = jnp.linspace(-1.0, 1.0, 4)
    with dask.config.set({"daskdag.fuse-chains": False}):
        keys = _keys(dag, x, heads)
        assert sum(key_kind(k) == "bwd" for k in keys) == L + K
        res = daskdag.compute_grads(dag, x, heads)

    def trunk(x):
        for _ in range(L):
            x = jnp.sin(x)
        return x

    for k, h in enumerate(heads):
        assert_tree_close(res[h].grad, jax.grad(lambda x: jnp.sum(trunk(x) ** (k + 1)))(x))


def test_outputs_pulled_back_together_equal_one_at_a_time():
    """tasks.backward with several outputs (``batch-cotangents: always``) against each output
    alone, for a chain stage (vmapped) and a fused one (its program that pulls each apart), some outputs giving no
    cotangent to one exposed node."""
    from daskdag.graph import tasks
    x = jnp.linspace(-1.0, 1.0, 4)
    for dag, way in (({"A": (jnp.sin, ["x"]), "B": (jnp.cos, ["A"]), "P": (jnp.sum, ["B"]),
                       "Q": (lambda b, a: jnp.sum(b * a), ["B", "A"])}, "_batched"),
                     ({"A": Node(jnp.sin, ["x"], jit=True), "B": Node(jnp.cos, ["A"], jit=True),
                       "P": (jnp.sum, ["B"]), "Q": (lambda b, a: jnp.sum(b * a), ["B", "A"])},
                      "_each")):
        calls = []
        real = getattr(tasks, way)
        # (it ran, and did not fall back)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tasks, way, lambda *a: calls.append(1) or real(*a))
            with dask.config.set({"daskdag.batch-cotangents": "always"}):
                together = daskdag.compute_grads(dag, x, ["P", "Q"])
        assert calls, way
        for o in ("P", "Q"):
            alone = daskdag.compute_grads(dag, x, o)
            assert_tree_close(together[o].grad, alone.grad)
        composed = {"P": lambda x: jnp.sum(jnp.cos(jnp.sin(x))),
                    "Q": lambda x: jnp.sum(jnp.cos(jnp.sin(x)) * jnp.sin(x))}
        for o, f in composed.items():  # and both JAX's
            value, grad = jax.value_and_grad(f)(x)
            assert_tree_close(together[o].value, value, rtol=1e-6)
            assert_tree_close(together[o].grad, grad, rtol=1e-6)


@pytest.mark.parametrize("close", [True, False])
def test_a_closed_fused_stage_runs_forward_and_backward_as_one_program(close, monkeypatch):
    """Every cotangent of the fused stage starts at its own outputs (E and D, scalars): its
    forward task pulls them back too, in one program (tasks.gradients) that traces each node
    once; with daskdag.close-stages off, forward and backward are apart. Same results."""
    from daskdag.graph import tasks, whole
    ran = []
    real = tasks.gradients
    monkeypatch.setattr(tasks, "gradients", lambda *a: ran.append(a[0].name) or real(*a))
    called = whole.WholeGradients.__call__  # (the call, being all of the stage, runs it alone)
    monkeypatch.setattr(whole.WholeGradients, "__call__",
                        lambda self, *a: ran.append(self.stage.name) or called(self, *a))
    traces = TraceLog()
    dag = _jit_dag(traces)
    x = jnp.linspace(-1.0, 1.0, 5)
    d = lambda x: jnp.sum((jnp.sin(x) * x) ** 2)
    with dask.config.set({"daskdag.close-stages": close}):
        for _ in range(2):
            res = daskdag.compute_grads(dag, x, ["E", "D"])
            assert_tree_close(res["E"].value, _composed(x)[1])
            assert_tree_close(res["E"].grad, jax.grad(lambda x: _composed(x)[1])(x))
            assert_tree_close(res["D"].value, d(x))
            assert_tree_close(res["D"].grad, jax.grad(d)(x))
        assert sorted(traces) == ["A", "B", "C", "D", "E"]  # once, in one program
        with pytest.raises(ValueError, match="output 'C' is not a real scalar"):
            daskdag.compute_grads(dag, x, ["E", "C"])
    assert ran == (["A+3more+E"] * 3 if close else [])


def test_jittable_siblings_after_an_eager_node_run_as_one_program():
    """K jitted heads that read one eager gate (and inputs of their own) are one fused stage: one
    forward task and program for all of them; a jitted node that also reads another stage, or
    an eager sibling, stays apart."""
    def gate(t):  # eager: Python control flow on a value
        return t * (0.5 if jnp.mean(jnp.abs(t)) > 1.0 else 1.0)

    dag = {"t": Node(lambda x, w: jnp.tanh(x @ w), ["x", "w"], jit=True), "g": (gate, ["t"]),
           "u": (jnp.cos, ["t"])}
    dag.update({f"L{k}": Node(lambda g, v, k=k: jnp.sum((g @ v - k) ** 2), ["g", f"v{k}"],
                              jit=True) for k in range(3)})
    dag["M"] = Node(lambda g, u: jnp.sum(g * u), ["g", "u"], jit=True)  # reads u's stage too
    dag["E"] = (lambda g: jnp.sum(g ** 3), ["g"])  # an eager sibling
    outputs = ["L0", "L1", "L2", "M", "E"]
    values = {"x": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "w": jnp.eye(3) * 2.0,
              **{f"v{k}": jnp.full((3, 2), 0.1 * (k + 1)) for k in range(3)}}
    assert _fwd_stages(_keys(dag, values, outputs)) == ["E", "L0+L1+L2", "M", "g", "t", "u"]
    res = daskdag.compute_grads(dag, values, outputs)

    def composed(values):
        t = jnp.tanh(values["x"] @ values["w"])
        g, u = gate(t), jnp.cos(t)
        return {**{f"L{k}": jnp.sum((g @ values[f"v{k}"] - k) ** 2) for k in range(3)},
                "M": jnp.sum(g * u), "E": jnp.sum(g ** 3)}

    for o in outputs:
        value, grad = jax.value_and_grad(lambda v: composed(v)[o])(values)
        assert_tree_close(res[o].value, value)
        assert_tree_close(res[o].grad, grad)
