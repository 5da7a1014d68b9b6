"""jacobian's modes and sparse Jacobians, against jax.jacrev and jax.jacfwd of the composed
function: forward and reverse give the same layout, "auto" picks by size (as the graph it
builds shows), a sparsity pattern (given or detected) takes one pass per colour, on threads and
on a process cluster with the pullbacks moved between workers; and bad patterns are named."""

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.sparse as sp

import daskdag
from daskdag import Node
from .support.clusters import compute_split, local_client
from .support.keys import key_kind
from .support.numbers import Counted, assert_tree_close
from .test_jacobian import X, chain, composed


def kinds(call) -> set[str]:
    """The kinds of task a lazy call's graph holds (``fwd``, ``jvp``, ``bwd``...)."""
    return {key_kind(k) for k in dict(call.__dask_graph__())}


@pytest.mark.parametrize("mode", ["rev", "fwd", "auto"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_every_mode_gives_jacrev_s_layout_and_values(mode, jit):
    res = daskdag.jacobian(chain(jit), X, ["A", "C", "D"], mode=mode)
    for o in ("A", "C", "D"):
        want = jax.jacrev(lambda x: composed(x)[o])(X)
        assert_tree_close(res[o].grad, want, rtol=1e-5)
        assert_tree_close(res[o].grad, jax.jacfwd(lambda x: composed(x)[o])(X), rtol=1e-5)
        assert_tree_close(res[o].value, composed(X)[o], rtol=1e-5)


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_forward_mode_each_node_runs_once_and_chunks_give_the_same(mode):
    counted = {k: Counted(v) for k, v in {"A": jnp.sin, "B": lambda a: jnp.outer(a, a)}.items()}
    dag = {"A": (counted["A"], ["x"]), "B": (counted["B"], ["A"])}
    x = jnp.array([0.3, -0.7, 1.1])
    res = daskdag.jacobian(dag, x, "B", mode=mode)
    want = jax.jacfwd(lambda x: jnp.outer(jnp.sin(x), jnp.sin(x)))(x)
    assert_tree_close(res.grad, want)
    assert all(f.calls == 1 for f in counted.values())
    assert_tree_close(daskdag.jacobian(dag, x, "B", mode=mode, chunk_size=2).grad, want)


def test_several_pytree_inputs_with_held_leaves_in_both_modes():
    def p(x, t):
        return {"s": jnp.sum(x["w"] * t[1:]) * x["n"], "v": x["w"] * 2.0 + t[:2], "k": x["n"]}

    dag = {"P": (p, ["x", "t"]), "Q": (lambda q: jnp.tanh(q["v"]) * q["s"], ["P"])}
    inputs = {"x": {"w": jnp.array([1.0, 2.0]), "n": 3}, "t": jnp.array([3.0, 4.0, 5.0])}
    for mode in ("rev", "fwd"):
        res = daskdag.jacobian(dag, inputs, ["P", "Q"], mode=mode)
        def floats(w, t):  # (jax.jacrev takes no integer output or input)
            out = p({"w": w, "n": 3}, t)
            return {"s": out["s"], "v": out["v"]}

        want = jax.jacrev(floats, argnums=(0, 1))(inputs["x"]["w"], inputs["t"])
        assert jax.tree.structure(res["P"].grad) == jax.tree.structure(
            {"k": None, "s": {"t": 0, "x": {"n": None, "w": 0}},
             "v": {"t": 0, "x": {"n": None, "w": 0}}})
        for leaf in ("s", "v"):
            assert_tree_close(res["P"].grad[leaf]["x"]["w"], want[leaf][0])
            assert_tree_close(res["P"].grad[leaf]["t"], want[leaf][1])
        wq = jax.jacrev(lambda w, t: dag["Q"][0](floats(w, t)), argnums=(0, 1))(
            inputs["x"]["w"], inputs["t"])
        assert_tree_close(res["Q"].grad["x"]["w"], wq[0])
        assert_tree_close(res["Q"].grad["t"], wq[1])


def test_auto_takes_the_mode_with_fewer_passes():
    wide = {"B": (lambda x: jnp.sin(jnp.outer(x, jnp.arange(30.0))), ["x"])}  # 2 in, 60 out
    narrow = {"B": (lambda x: jnp.sum(jnp.sin(x)) * x[:2], ["x"])}  # 50 in, 2 out
    assert "jvp" in kinds(daskdag.jacobians(wide, jnp.ones(2), "B"))
    assert "jvp" not in kinds(daskdag.jacobians(narrow, jnp.ones(50), "B"))
    assert "jvp" not in kinds(daskdag.jacobians(wide, jnp.ones(2), "B", mode="rev"))
    assert "jvp" in kinds(daskdag.jacobians(narrow, jnp.ones(50), "B", mode="fwd"))


def test_a_mode_that_cannot_serve_the_call_is_named_and_auto_avoids_it():
    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.outer(a, a), ["A"])}
    with pytest.raises(daskdag.DAGError, match=r"mode='fwd'.*node\(s\) \['A'\].*free inputs"):
        daskdag.jacobian(dag, jnp.ones(2), "B", wrt=["A"], mode="fwd")
    res = daskdag.jacobian(dag, jnp.ones(2), "B", wrt=["A"])  # auto: reverse
    assert_tree_close(res.grad["A"], jax.jacrev(lambda a: jnp.outer(a, a))(jnp.sin(jnp.ones(2))))
    own = {"A": Node(lambda x: np.sin(x), ["x"], vjp=lambda ct, out, x: (ct * np.cos(x),)),
           "B": (lambda a: jnp.outer(a, a), ["A"])}
    with pytest.raises(daskdag.DAGError, match="mode='fwd'.*node 'A'.*no jvp= rule"):
        daskdag.jacobian(own, jnp.ones(2), "B", mode="fwd")
    assert "jvp" not in kinds(daskdag.jacobians(own, jnp.ones(2), "B"))
    with pytest.raises(daskdag.DAGError, match="mode must be one of"):
        daskdag.jacobian(dag, jnp.ones(2), "B", mode="forward")


# -- sparse Jacobians ------------------------------------------------------------------------------

N = 200


def stencil(a):
    return jnp.pad(a[2:] - 2 * a[1:-1] + a[:-2], 1)


def banded_dag():
    return {"A": (jnp.tanh, ["x"]), "B": (stencil, ["A"]),
            "C": (lambda b, a: b * a + jnp.sin(a), ["B", "A"]),
            "D": (lambda c: jnp.exp(-c ** 2), ["C"]),
            "E": (lambda d, x: d + 0.5 * x ** 2, ["D", "x"])}


def banded(x):
    a = jnp.tanh(x)
    return jnp.exp(-(stencil(a) * a + jnp.sin(a)) ** 2) + 0.5 * x ** 2


XB = jnp.linspace(-1.0, 1.0, N)


def test_a_detected_pattern_is_the_jacobian_s_nonzeros():
    pattern = daskdag.jacobian_sparsity(banded_dag(), XB, "E")
    assert isinstance(pattern, sp.csr_array) and pattern.shape == (N, N)
    want = np.asarray(jax.jacrev(banded)(XB)) != 0
    np.testing.assert_array_equal(pattern.toarray(), want)  # a tridiagonal band, exactly


@pytest.mark.parametrize("mode", ["rev", "fwd", "auto"])
def test_sparse_jacobians_match_jacrev_in_every_mode(mode):
    want = jax.jacrev(banded)(XB)
    pattern = daskdag.jacobian_sparsity(banded_dag(), XB, "E")
    res = daskdag.jacobian(banded_dag(), XB, "E", mode=mode, sparsity=pattern, sparse=True)
    assert isinstance(res.grad, sp.csr_array) and res.grad.nnz == pattern.nnz
    np.testing.assert_allclose(res.grad.toarray(), want, rtol=1e-5, atol=1e-6)
    dense = daskdag.jacobian(banded_dag(), XB, "E", mode=mode, sparsity="detect")
    assert_tree_close(dense.grad, want, rtol=1e-5)


def test_one_pass_per_colour():
    """A node with its own NumPy VJP is pulled back row by row: once per colour of a band of
    width 3, not once per output element."""
    rows = []

    def own_vjp(ct, out, b):
        rows.append(ct)
        return (ct * 3 * np.asarray(b) ** 2,)

    dag = {"B": (stencil, ["x"]), "C": Node(lambda b: np.asarray(b) ** 3, ["B"], vjp=own_vjp)}
    want = jax.jacrev(lambda x: stencil(x) ** 3)(XB)
    res = daskdag.jacobian(dag, XB, "C", mode="rev", sparsity="detect")  # C is probed
    assert_tree_close(res.grad, want, rtol=1e-4, atol=1e-5)
    rows.clear()
    pattern = daskdag.jacobian_sparsity(dag, XB, "C")
    probes = len(rows)
    assert probes == 3 * N  # probed at the point and two points near it, row by row
    rows.clear()
    res = daskdag.jacobian(dag, XB, "C", mode="rev", sparsity=pattern)
    assert len(rows) == 3  # a tridiagonal band: 3 colours (rows r, r + 3, ... share no column)
    assert_tree_close(res.grad, want, rtol=1e-4, atol=1e-5)


def test_an_untraceable_node_is_probed():
    def branchy(a):
        return jnp.tanh(a) if jnp.sum(a) > 0 else jnp.sin(a)  # (a value: eager only)

    dag = {"A": (branchy, ["x"]), "B": (stencil, ["A"])}
    pattern = daskdag.jacobian_sparsity(dag, XB + 2.0, "B")
    want = jax.jacrev(lambda x: stencil(jnp.tanh(x)))(XB + 2.0)
    np.testing.assert_array_equal(pattern.toarray(), np.asarray(want) != 0)


def test_several_inputs_and_outputs_and_the_pattern_s_layout():
    dag = {"P": (lambda u, v: u * v[::-1], ["u", "v"]), "S": (lambda p: jnp.cumsum(p)[-3:], ["P"])}
    x = {"u": jnp.arange(1.0, 7.0), "v": jnp.linspace(0.5, 2.0, 6)}
    patterns = daskdag.jacobian_sparsity(dag, x, ["P", "S"])
    assert set(patterns) == {"P", "S"} and set(patterns["P"]) == {"u", "v"}
    np.testing.assert_array_equal(patterns["P"]["u"].toarray(), np.eye(6, dtype=bool))
    np.testing.assert_array_equal(patterns["P"]["v"].toarray(), np.eye(6, dtype=bool)[::-1])
    np.testing.assert_array_equal(patterns["S"]["u"].toarray(),  # cumsum's last 3 elements
                                  np.tril(np.ones((6, 6), bool))[-3:])
    for mode in ("rev", "fwd"):
        res = daskdag.jacobian(dag, x, ["P", "S"], mode=mode, sparsity=patterns)
        for o in ("P", "S"):
            f = (lambda d: dag["P"][0](d["u"], d["v"])) if o == "P" else \
                (lambda d: dag["S"][0](dag["P"][0](d["u"], d["v"])))
            assert_tree_close(res[o].grad, jax.jacrev(f)(x))
        scipy_res = daskdag.jacobian(dag, x, ["P", "S"], mode=mode, sparsity=patterns, sparse=True)
        assert isinstance(scipy_res["P"].grad["v"], sp.csr_array)
        np.testing.assert_allclose(scipy_res["P"].grad["v"].toarray(),
                                   jax.jacrev(lambda v: x["u"] * v[::-1])(x["v"]))


def test_one_output_s_pattern_may_come_in_a_dict_of_outputs():
    pattern = daskdag.jacobian_sparsity(banded_dag(), XB, ["E"])  # {"E": pattern}
    res = daskdag.jacobian(banded_dag(), XB, "E", sparsity=pattern)
    assert_tree_close(res.grad, jax.jacrev(banded)(XB), rtol=1e-5)


def test_bad_patterns_are_named():
    dag = banded_dag()
    with pytest.raises(daskdag.DAGError, match=r"output 'E' and input 'x' has 5 columns.*200"):
        daskdag.jacobian(dag, XB, "E", sparsity=np.ones((N, 5), bool))
    with pytest.raises(daskdag.DAGError, match="no pattern for output 'D'"):
        daskdag.jacobian(dag, XB, ["D", "E"], sparsity={"E": np.eye(N, dtype=bool)})
    two = {"P": (lambda u, v: u * v, ["u", "v"])}
    with pytest.raises(daskdag.DAGError, match="output 'P' gives no pattern for 'v'"):
        daskdag.jacobian(two, {"u": jnp.ones(3), "v": jnp.ones(3)}, "P",
                         sparsity={"u": np.eye(3, dtype=bool)})


@pytest.mark.parametrize("mode", ["rev", "fwd", "auto"])
def test_a_pattern_with_the_wrong_rows_is_named_before_anything_runs(mode):
    """The output's elements come from its shape traced abstractly: no node runs on values."""
    ran = []

    def node(x):
        if not isinstance(x, jax.core.Tracer):
            ran.append(1)
        return jnp.cumsum(jnp.sin(x))

    with pytest.raises(daskdag.DAGError, match="pattern of output 'E' has 7 rows.*200 elements"
                       ) as e:
        daskdag.jacobian({"E": (node, ["x"])}, XB, "E", mode=mode,
                         sparsity=np.ones((7, N), bool))
    assert e.value.argument == "sparsity" and not ran


@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_a_pattern_with_the_wrong_rows_for_numpy_code_is_a_dag_error(mode):
    """A node of NumPy code with its own rules is never traced: its output's size is known once
    it ran, and the error is the same."""
    node = Node(np.sin, ["x"], vjp=lambda ct, y, x: (ct * np.cos(x),),
                jvp=lambda args, tangents: (np.sin(args[0]), np.cos(args[0]) * tangents[0]))
    with pytest.raises(daskdag.DAGError, match="pattern of output 'E' has 7 rows.*200 elements"):
        daskdag.jacobian({"E": node}, np.asarray(XB), "E", mode=mode,
                         sparsity=np.ones((7, N), bool))


def test_patterns_are_boolean_and_their_keys_known():
    dag = {"E": (jnp.sin, ["x"])}
    x = jnp.ones(3)
    with pytest.raises(daskdag.DAGError, match="must be boolean.*float64"):
        daskdag.jacobian(dag, x, "E", sparsity=np.eye(3) * 0.5)
    ones = daskdag.jacobian(dag, x, "E", sparsity=np.eye(3))  # (0 and 1: a pattern)
    assert_tree_close(ones.grad, jax.jacrev(jnp.sin)(x))
    with pytest.raises(daskdag.DAGError, match=r"names \['nope'\].*\['x'\]"):
        daskdag.jacobian(dag, x, "E", sparsity={"nope": np.eye(3, dtype=bool)})


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_sparse_and_forward_on_a_process_cluster_with_pullbacks_moved_between_workers():
    want = jax.jacrev(banded)(XB)
    pattern = daskdag.jacobian_sparsity(banded_dag(), XB, "E")
    with local_client() as client:
        for mode in ("fwd", "rev"):
            res = daskdag.jacobian(banded_dag(), XB, "E", mode=mode, sparsity=pattern,
                                   client=client)
            assert_tree_close(res.grad, want, rtol=1e-5)
        res = daskdag.jacobian(chain(False), X, "D", mode="fwd", client=client)
        assert_tree_close(res.grad, jax.jacrev(lambda x: composed(x)["D"])(X), rtol=1e-5)
        a, b = sorted(client.scheduler_info()["workers"])
        moved, _ = compute_split(client, banded_dag(), XB, "E", a, b, lazy=daskdag.jacobians,
                                 mode="rev", sparsity=pattern)
        assert_tree_close(moved["E"][1]["x"], want, rtol=1e-5)
        with dask.config.set({"daskdag.close-stages": False}):
            assert "jvp" in kinds(daskdag.jacobians(chain(False), X, "D", mode="fwd"))


# -- modes the nodes can take ----------------------------------------------------------------------

def _host_cos_times(x, g):
    return (np.cos(np.asarray(x)) * np.asarray(g)).astype(np.asarray(x).dtype)


@jax.custom_vjp
def reverse_only(x):
    """sin, whose backward pass calls NumPy: JAX has no forward mode for it."""
    return jnp.sin(x)


def _reverse_only_fwd(x):
    return jnp.sin(x), x


def _reverse_only_bwd(x, g):
    return (jax.pure_callback(_host_cos_times, jax.ShapeDtypeStruct(x.shape, x.dtype), x, g,
                              vmap_method="sequential"),)


reverse_only.defvjp(_reverse_only_fwd, _reverse_only_bwd)


@jax.custom_jvp
def forward_only(x):
    """sin, whose tangent calls NumPy: JAX cannot transpose it, so it has no reverse mode."""
    return jnp.sin(x)


@forward_only.defjvp
def _forward_only_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.sin(x), jax.pure_callback(_host_cos_times, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                         x, t, vmap_method="sequential")


def _own_vjp_only(a):
    return Node(lambda x: np.sin(np.asarray(x)), a,
                vjp=lambda ct, out, x: (np.cos(np.asarray(x)) * ct,))


def _own_jvp_only(a):
    return Node(lambda x: np.sin(np.asarray(x)), a,
                jvp=lambda args, tangents: (np.sin(np.asarray(args[0])),
                                            np.cos(np.asarray(args[0])) * tangents[0]))


SQUARE = jnp.arange(3.0)  # 3 inputs, 3 outputs: a tie, which auto takes forward when it can


@pytest.mark.parametrize("node", ["custom_vjp", "custom_vjp-jit", "vjp="])
def test_auto_takes_reverse_through_a_node_with_only_a_reverse_rule(node):
    dag = {"y": {"custom_vjp": (reverse_only, ["x"]),
                 "custom_vjp-jit": Node(reverse_only, ["x"], jit=True),
                 "vjp=": _own_vjp_only(["x"])}[node]}
    want = jax.jacrev(reverse_only)(SQUARE)
    res = daskdag.jacobian(dag, SQUARE, "y")
    assert_tree_close(res.grad, want)
    assert res.info.mode == "rev"
    assert "the only mode" in res.info.mode_why and "forward mode cannot: node 'y'" in \
        res.info.mode_why, res.info.mode_why
    again = daskdag.jacobian(dag, SQUARE, "y")  # the mode and its reason, prepared once
    assert again.info.prepared and again.info.mode_why == res.info.mode_why
    f = daskdag.value_and_jacobian(dag, "y")
    value, jac = f(SQUARE)
    assert_tree_close(jac, want)
    assert f.info.mode == "rev" and "node 'y'" in f.info.mode_why
    if node != "vjp=":  # a node of JAX code: the reason is JAX's
        assert "jax.custom_vjp" in res.info.mode_why


@pytest.mark.parametrize("node", ["custom_vjp", "custom_vjp-jit", "vjp="])
def test_forward_mode_through_a_node_with_only_a_reverse_rule_is_refused_before_anything_runs(node):
    first = Counted(jnp.tanh)
    dag = {"a": (first, ["x"]),
           "y": {"custom_vjp": (reverse_only, ["a"]),
                 "custom_vjp-jit": Node(reverse_only, ["a"], jit=True),
                 "vjp=": _own_vjp_only(["a"])}[node]}
    with pytest.raises(daskdag.DAGError, match=r"mode='fwd' cannot serve this call: node 'y' "):
        daskdag.jacobian(dag, SQUARE, "y", mode="fwd")
    with pytest.raises(daskdag.DAGError, match=r"mode='fwd' cannot serve this call: node 'y' "):
        daskdag.value_and_jacobian(dag, "y", mode="fwd")(SQUARE)
    assert first.calls == 0
    res = daskdag.jacobian(dag, SQUARE, "y", mode="rev")
    assert_tree_close(res.grad, jax.jacrev(lambda x: reverse_only(jnp.tanh(x)))(SQUARE))
    assert res.info.mode_why == "mode='rev' was asked for"


@pytest.mark.parametrize("node", ["custom_jvp", "jvp="])
def test_a_node_with_only_a_forward_rule_takes_forward_mode_and_refuses_reverse(node):
    """Forward even where reverse takes fewer passes (6 inputs, 2 outputs); mode="rev" is a
    DAGError naming the node, before any node runs."""
    first = Counted(lambda x: jnp.tanh(x)[:2])
    dag = {"a": (first, ["x"]),
           "y": {"custom_jvp": (forward_only, ["a"]), "jvp=": _own_jvp_only(["a"])}[node]}
    x = jnp.linspace(-1.0, 1.0, 6)
    want = jax.jacfwd(lambda x: forward_only(jnp.tanh(x)[:2]))(x)
    res = daskdag.jacobian(dag, x, "y")
    assert_tree_close(res.grad, want)
    assert res.info.mode == "fwd"
    assert "reverse mode cannot: node 'y'" in res.info.mode_why, res.info.mode_why
    assert daskdag.value_and_jacobian(dag, "y")(x)[1].shape == (2, 6)
    first.calls = 0
    with pytest.raises(daskdag.DAGError, match=r"mode='rev' cannot serve this call: node 'y' "):
        daskdag.jacobian(dag, x, "y", mode="rev")
    with pytest.raises(daskdag.DAGError, match=r"mode='rev' cannot serve this call: node 'y' "):
        daskdag.value_and_jacobian(dag, "y", mode="rev")(x)
    assert first.calls == 0


def test_a_dag_no_mode_can_serve_names_each_node_and_what_it_lacks():
    first = Counted(jnp.tanh)
    dag = {"a": (first, ["x"]), "r": (reverse_only, ["a"]), "f": (forward_only, ["a"]),
           "v": _own_vjp_only(["a"]), "j": _own_jvp_only(["a"]),
           "y": (lambda r, f, v, j: r + f + v + j, ["r", "f", "v", "j"])}
    for call in (lambda: daskdag.jacobian(dag, SQUARE, "y"),
                 lambda: daskdag.value_and_jacobian(dag, "y")(SQUARE)):
        with pytest.raises(daskdag.DAGError) as e:
            call()
        message = str(e.value)
        assert message.startswith("no mode can serve this call: forward mode (mode='fwd'): ")
        fwd, rev = message.split("reverse mode (mode='rev'): ")
        assert "node 'r' calls a jax.custom_vjp function" in fwd and "node 'v'" in fwd
        assert "node 'f' has no reverse-mode rule" in rev and "node 'j'" in rev
        assert "node 'f'" not in fwd and "node 'r'" not in rev
    assert first.calls == 0


def test_auto_finds_a_custom_vjp_function_inside_a_node_s_code():
    """Under auto every node is traced on shapes, so a custom_vjp called inside a node's own
    code is found too."""
    dag = {"y": (lambda x: reverse_only(x) * 2.0, ["x"])}
    res = daskdag.jacobian(dag, SQUARE, "y")
    assert res.info.mode == "rev" and "jax.custom_vjp" in res.info.mode_why
    assert_tree_close(res.grad, jax.jacrev(lambda x: reverse_only(x) * 2.0)(SQUARE))


def test_auto_says_why_it_took_its_mode():
    tie = daskdag.jacobian({"y": (jnp.sin, ["x"])}, SQUARE, "y")
    assert tie.info.mode == "fwd"
    assert tie.info.mode_why == ("forward on a tie: 3 passes forward (input elements) against "
                                 "3 reverse (output elements)")
    narrow = daskdag.jacobian({"y": (lambda x: jnp.sum(x) * x[:1], ["x"])}, SQUARE, "y")
    assert narrow.info.mode == "rev"
    assert narrow.info.mode_why == ("fewer passes: 3 passes forward (input elements) against "
                                    "1 reverse (output elements)")
    banded = daskdag.jacobian(banded_dag(), XB, "E", sparsity="detect")
    assert banded.info.mode_why.endswith("(colours of columns) against 3 reverse (colours of rows)")


def test_auto_takes_forward_through_a_while_loop_though_reverse_takes_fewer_passes():
    """JAX has no reverse mode for a lax.while_loop: auto finds it in the node's own code."""
    def grow(x):
        return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.sin(c[0]) * 1.1, c[1] + 1),
                                  (x, 0))[0][:2]

    x = jnp.linspace(-1.0, 1.0, 6)
    res = daskdag.jacobian({"y": (grow, ["x"])}, x, "y")
    assert res.info.mode == "fwd"
    assert "reverse mode cannot: node 'y' has no reverse-mode rule" in res.info.mode_why
    assert "while_loop" in res.info.mode_why
    assert_tree_close(res.grad, jax.jacfwd(grow)(x))
