"""Repeated calls: a call reuses what an earlier one prepared (its checks, plan, packed
functions, mode, patterns), never when anything it relied on has changed, on threads and on a
cluster; results say how they were computed; prepared functions in JAX's idiom."""

import gc
import graphlib
import importlib
import sys
import textwrap
import threading
import weakref

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import Node
from .support.numbers import Counted, TraceLog, assert_tree_close

X = jnp.linspace(0.2, 1.0, 3)


def composed(dag: dict, output: str):
    """The DAG as one plain JAX function of its one free input, its node functions as they are
    now: the reference every call is checked against."""
    entries = {name: (e.fn, e.deps) if isinstance(e, Node) else e for name, e in dag.items()}
    order = graphlib.TopologicalSorter({n: [d for d in deps if d in entries]
                                        for n, (_, deps) in entries.items()}).static_order()

    def f(x):
        values = {"x": x}
        for name in order:
            fn, deps = entries[name]
            values[name] = fn(*(values[d] for d in deps))
        return values[output]
    return f


def check(res, dag, x, output="L"):
    value, grad = jax.value_and_grad(composed(dag, output))(x)
    # (half precision: jit of a node and of the composed function may round an ulp apart)
    rtol = max(1e-5, 2 * float(jnp.finfo(jnp.result_type(x)).eps))
    assert_tree_close(res.value, value, rtol=rtol)
    assert_tree_close(res.grad, grad, rtol=rtol)


# -- each way a preparation could go stale --------------------------------------------------------

def _namespace(**values) -> dict:
    """Globals of functions made here (a module the cluster cannot import: they travel by
    value)."""
    return {"__name__": "daskdag_test_namespace", "jnp": jnp, **values}


def _define(source: str, namespace: dict):
    exec(textwrap.dedent(source), namespace)
    return namespace["h"]


def case_numpy_array_in_place(jit):
    W = np.ones(3, np.float32)
    dag = {"H": Node(lambda x: jnp.tanh(W * x), ["x"], jit=jit), "L": (jnp.sum, ["H"])}
    return dag, lambda: W.__setitem__(slice(None), 2.0), "node 'H': its function changed"


def case_global_rebound(jit):
    ns = _namespace(scale=1.0)
    h = _define("def h(x):\n    return jnp.tanh(scale * x)", ns)
    dag = {"H": Node(h, ["x"], jit=jit), "L": (jnp.sum, ["H"])}
    return dag, lambda: ns.__setitem__("scale", 2.0), "node 'H': its function changed"


def case_helper_function_rebound(jit):
    ns = _namespace(helper=jnp.tanh)
    h = _define("def h(x):\n    return helper(x) * 2.0", ns)
    dag = {"H": Node(h, ["x"], jit=jit), "L": (jnp.sum, ["H"])}
    return dag, lambda: ns.__setitem__("helper", jnp.sin), "node 'H': its function changed"


def case_closure_cell_set(jit):
    w = jnp.ones(3)

    def h(x):
        return jnp.tanh(w * x)

    def change():
        nonlocal w
        w = jnp.full(3, 2.0)

    return {"H": Node(h, ["x"], jit=jit), "L": (jnp.sum, ["H"])}, change, "node 'H'"


def case_list_in_place(jit):
    coeffs = [1.0]
    dag = {"H": Node(lambda x: jnp.sin(x) * coeffs[0], ["x"], jit=jit), "L": (jnp.sum, ["H"])}
    return dag, lambda: coeffs.__setitem__(0, 3.0), "node 'H'"


def case_dict_entry_replaced(jit):
    params = {"w": jnp.ones(3)}
    dag = {"H": Node(lambda x: jnp.tanh(params["w"] * x), ["x"], jit=jit), "L": (jnp.sum, ["H"])}
    return dag, lambda: params.__setitem__("w", jnp.full(3, 0.5)), "node 'H'"


def case_attribute_set(jit):
    class Config:
        scale = 1.0

    cfg = Config()
    dag = {"H": Node(lambda x: jnp.tanh(cfg.scale * x), ["x"], jit=jit), "L": (jnp.sum, ["H"])}
    return dag, lambda: setattr(cfg, "scale", 2.5), "node 'H'"


def case_default_changed(jit):
    def h(x, s=1.0):
        return jnp.tanh(s * x)

    dag = {"H": Node(h, ["x"], jit=jit), "L": (jnp.sum, ["H"])}
    return dag, lambda: setattr(h, "__defaults__", (3.0,)), "node 'H'"


def case_entry_replaced(jit):
    dag = {"H": Node(jnp.tanh, ["x"], jit=jit), "L": (jnp.sum, ["H"])}
    return dag, lambda: dag.__setitem__("H", Node(jnp.sin, ["x"], jit=jit)), \
        "the DAG changed: node 'H' was replaced"


def case_deps_changed_in_place(jit):
    dag = {"H": Node(jnp.tanh, ["x"], jit=jit), "G": Node(jnp.sin, ["x"], jit=jit),
           "L": (lambda a, b: jnp.sum(a * b), ["H", "H"])}
    return dag, lambda: dag["L"][1].__setitem__(1, "G"), "the DAG changed: node 'L'"


def case_node_added(jit):
    dag = {"H": Node(jnp.tanh, ["x"], jit=jit), "L": (jnp.sum, ["H"])}

    def change():
        dag["G"] = Node(jnp.cos, ["H"], jit=jit)
        dag["L"] = (lambda g: jnp.sum(g), ["G"])
    return dag, change, "the DAG changed"


CASES = {f.__name__[5:]: f for f in (
    case_numpy_array_in_place, case_global_rebound, case_helper_function_rebound,
    case_closure_cell_set, case_list_in_place, case_dict_entry_replaced, case_attribute_set,
    case_default_changed, case_entry_replaced, case_deps_changed_in_place, case_node_added)}


def _stays_right(dag, change, why, client=None, anew=True):
    """Right before and after ``change()``; the call after it prepared anew (``why`` says so)
    where ``anew``, that is, where the preparation relied on what changed: the DAG itself, or a
    function's content where it packed or traced it (``jit=True``, or any node on a cluster).
    An eager node on threads is called as it is: nothing prepared depends on its content."""
    first = daskdag.compute_grads(dag, X, "L", client=client)
    check(first, dag, X)
    again = daskdag.compute_grads(dag, X, "L", client=client)
    assert again.info.prepared, again.info
    check(again, dag, X)
    change()
    changed = daskdag.compute_grads(dag, X, "L", client=client)
    if anew:
        assert not changed.info.prepared and why in changed.info.why, changed.info
    else:
        assert changed.info.prepared, changed.info
    check(changed, dag, X)
    assert float(changed.value) != pytest.approx(float(first.value))  # (the change shows)
    repeat = daskdag.compute_grads(dag, X, "L", client=client)
    assert repeat.info.prepared
    check(repeat, dag, X)


STRUCTURAL = {"entry_replaced", "deps_changed_in_place", "node_added"}


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_change_prepares_the_call_anew_on_threads(case, jit):
    _stays_right(*CASES[case](jit), anew=jit or case in STRUCTURAL)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_change_prepares_the_call_anew_on_a_cluster(cli_client):
    """The same changes, the calls on a cluster that cannot import this module: what each
    change touches travels again, under new keys, and the workers compute with it; and new
    shapes, a setting changed, and a detected pattern after a constant changed in place."""
    for case in CASES.values():
        for jit in (True, False):
            _stays_right(*case(jit), client=cli_client)
    dag = {"H": Node(jnp.tanh, ["x"], jit=True), "L": (jnp.sum, ["H"])}
    daskdag.compute_grads(dag, X, "L", client=cli_client)
    wider = daskdag.compute_grads(dag, jnp.linspace(0.0, 1.0, 7), "L", client=cli_client)
    assert not wider.info.prepared and "shapes" in wider.info.why
    check(wider, dag, jnp.linspace(0.0, 1.0, 7))
    assert daskdag.compute_grads(dag, X, "L", client=cli_client).info.prepared  # (kept)
    with dask.config.set({"daskdag.fuse-chains": False}):
        res = daskdag.compute_grads(dag, X, "L", client=cli_client)
    assert not res.info.prepared and "a setting changed" in res.info.why
    check(res, dag, X)
    M = np.eye(4, dtype=np.float32)
    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.asarray(M) @ a, ["A"])}
    x = jnp.linspace(0.1, 0.4, 4)
    daskdag.jacobian(dag, x, "B", sparsity="detect", client=cli_client)
    M[0, 3] = 1.0
    res = daskdag.jacobian(dag, x, "B", sparsity="detect", client=cli_client)
    assert not res.info.prepared and res.info.colours == 2
    assert_tree_close(res.grad, jax.jacrev(lambda x: jnp.asarray(M) @ jnp.sin(x))(x))


USER_MODULE = '''
import jax.numpy as jnp

scale = 1.0


def h(x):
    return jnp.tanh(scale * x)
'''


def test_an_attribute_of_a_module_of_the_user_s_rebound_is_seen(tmp_path, monkeypatch):
    """``helpers.scale`` read through the module: the fingerprint and the content token follow
    one walk (:mod:`daskdag.transport.walk`), so a jitted node is compiled anew."""
    name = f"daskdag_helpers_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    helpers = importlib.import_module(name)
    try:
        namespace = _namespace(helpers=helpers)
        h = _define("def h(x):\n    return helpers.h(x) + helpers.scale", namespace)
        for jit in (True, False):
            helpers.scale = 1.0
            dag = {"H": Node(h, ["x"], jit=jit), "L": (jnp.sum, ["H"])}
            _stays_right(dag, lambda: setattr(helpers, "scale", 2.0), "node 'H'", anew=jit)
    finally:
        sys.modules.pop(name, None)


def test_new_shapes_dtypes_and_inputs_prepare_anew():
    W = np.ones(3, np.float32)
    dag = {"H": Node(lambda x: jnp.tanh(x) * jnp.sum(W), ["x"], jit=True), "L": (jnp.sum, ["H"])}
    daskdag.compute_grads(dag, X, "L")
    for x, why in [(jnp.linspace(0.0, 1.0, 5), "shapes"),
                   (np.linspace(0.0, 1.0, 5, dtype=np.float32), None),  # (as JAX's: the same)
                   (np.linspace(0.0, 1.0, 5), None),  # float64, float32 to JAX (x64 off): the same
                   (np.linspace(0.0, 1.0, 5, dtype=np.float16), "dtypes")]:
        res = daskdag.compute_grads(dag, x, "L")
        assert res.info.prepared if why is None else (not res.info.prepared and why in res.info.why)
        check(res, dag, jnp.asarray(x))


def test_a_setting_changed_prepares_anew():
    dag = {"A": (jnp.sin, ["x"]), "B": (jnp.tanh, ["A"]), "L": (jnp.sum, ["B"])}
    daskdag.compute_grads(dag, X, "L")
    for setting in ({"daskdag.fuse-chains": False}, {"daskdag.remat": True},
                    {"daskdag.close-stages": False}):
        with dask.config.set(setting):
            res = daskdag.compute_grads(dag, X, "L")
            assert not res.info.prepared and "a setting changed" in res.info.why
            check(res, dag, X)
            assert daskdag.compute_grads(dag, X, "L").info.prepared
    assert daskdag.compute_grads(dag, X, "L").info.prepared  # (the first one, still kept)


def test_remat_from_the_setting_is_honoured_after_a_change():
    """``Node(remat=None)`` takes ``daskdag.remat`` when the DAG is parsed: a preparation made
    without it must not serve a call made with it (the node then runs twice)."""
    f = Counted(jnp.sin)
    dag = {"A": (f, ["x"]), "L": (jnp.sum, ["A"])}
    daskdag.compute_grads(dag, X, "L")
    before = f.calls
    with dask.config.set({"daskdag.remat": True}):
        daskdag.compute_grads(dag, X, "L")
    assert f.calls - before == 2  # forward, then again in its backward task


# -- what is reused, and what a repeated call no longer does ----------------------------------------

def test_a_repeated_call_packs_and_traces_nothing(monkeypatch):
    """The second call of a jit=True DAG pickles no function and traces no node (the first one
    did both: packed them, and traced their shapes for mode="auto", then compiled them)."""
    from daskdag.transport import pickler

    pickled = []
    dumps = pickler.Pickler.dump
    monkeypatch.setattr(pickler.Pickler, "dump",
                        lambda self, obj: pickled.append(obj) or dumps(self, obj))
    traces = TraceLog()

    def h(x):
        traces.append("H")
        return jnp.tanh(x) * 2.0

    def loss(h):
        traces.append("L")
        return jnp.sum(h ** 2)

    dag = {"H": Node(h, ["x"], jit=True), "L": Node(loss, ["H"], jit=True)}
    daskdag.jacobian(dag, X, "L")
    assert pickled and traces
    pickled.clear()
    traced = len(traces)
    for _ in range(3):
        res = daskdag.jacobian(dag, X, "L")
        assert res.info.prepared
        assert_tree_close(res.grad, jax.grad(lambda x: jnp.sum((jnp.tanh(x) * 2.0) ** 2))(X))
    assert pickled == [] and len(traces) == traced


def test_detected_patterns_are_reused_and_follow_a_constant_changed_in_place():
    """A pattern read off a jaxpr holds at every point: detected once. A NumPy constant's zeros
    shape that pattern (dot_general), so a change in place to it detects anew, and the
    Jacobian stays right."""
    M = np.eye(4, dtype=np.float32)
    dag = {"A": (lambda x: jnp.sin(x), ["x"]), "B": (lambda a: jnp.asarray(M) @ a, ["A"])}
    x = jnp.linspace(0.1, 0.4, 4)
    first = daskdag.jacobian(dag, x, "B", sparsity="detect", sparse=True)
    assert first.info.sparsity == "detected" and first.info.colours == 1
    again = daskdag.jacobian(dag, x, "B", sparsity="detect", sparse=True)
    assert again.info.prepared and again.info.colours == 1
    M[0, 3] = 1.0  # a new nonzero: the old pattern would drop it
    changed = daskdag.jacobian(dag, x, "B", sparsity="detect", sparse=True)
    assert not changed.info.prepared and changed.info.colours == 2
    want = jax.jacrev(lambda x: jnp.asarray(M) @ jnp.sin(x))(x)
    assert_tree_close(changed.grad.toarray(), want)


def test_a_probed_pattern_says_so_and_is_detected_at_every_call():
    """A node that cannot be traced (Python control flow on a value) is probed at the point:
    that pattern holds there only, so every call detects it again, and says why."""
    g = Counted(lambda a: a * 2.0 if jnp.sum(a) > 0 else a)
    dag = {"A": (jnp.sin, ["x"]), "B": (g, ["A"])}
    first = daskdag.jacobian(dag, X, "B", sparsity="detect")
    assert first.info.sparsity == "probed"
    again = daskdag.jacobian(dag, X, "B", sparsity="detect")
    assert not again.info.prepared and "probed at this point" in again.info.why
    assert_tree_close(again.grad, jax.jacrev(lambda x: jnp.sin(x) * 2.0)(X))


def test_a_given_pattern_changed_in_place_is_seen():
    P = np.eye(3, dtype=bool)
    dag = {"A": (lambda x: x * jnp.arange(1.0, 4.0), ["x"])}
    res = daskdag.jacobian(dag, X, "A", sparsity=P)
    assert res.info.sparsity == "given" and res.info.colours == 1
    P[0, 1] = True  # a pattern changed in place: a new key (its content), two colours now
    res = daskdag.jacobian(dag, X, "A", sparsity=P)
    assert not res.info.prepared and res.info.colours == 2
    assert_tree_close(res.grad, jnp.diag(jnp.arange(1.0, 4.0)))


def test_an_unwatchable_function_is_prepared_at_every_call_and_says_why():
    lock = threading.Lock()

    def h(x):
        with lock:
            return jnp.tanh(x)

    dag = {"H": Node(h, ["x"], jit=True), "L": (jnp.sum, ["H"])}
    daskdag.compute_grads(dag, X, "L")
    res = daskdag.compute_grads(dag, X, "L")
    assert not res.info.prepared and "a fingerprint cannot read" in res.info.why
    check(res, dag, X)


def test_preparations_keep_no_function_alive():
    def make():
        big = jnp.ones(3)
        return lambda x: jnp.tanh(x * big)

    fn = make()
    dag = {"H": Node(fn, ["x"], jit=True), "L": (jnp.sum, ["H"])}
    f = daskdag.value_and_grad(dag, "L")
    f(X)
    daskdag.jacobian(dag, X, "L", sparsity="detect")
    daskdag.compute_hvps(dag, X, jnp.ones(3), "L")
    ref = weakref.ref(fn)
    del fn, dag, f
    gc.collect()
    assert ref() is None


def test_prepared_calls_off_prepares_every_call():
    dag = {"A": (jnp.sin, ["x"]), "L": (jnp.sum, ["A"])}
    with dask.config.set({"daskdag.prepared-calls": 0}):
        daskdag.compute_grads(dag, X, "L")
        res = daskdag.compute_grads(dag, X, "L")
    assert not res.info.prepared and "prepared calls are off" in res.info.why
    daskdag.clear_caches()
    assert not daskdag.compute_grads(dag, X, "L").info.prepared


@pytest.mark.parametrize("make", [
    lambda dag: (daskdag.value_and_grad(dag, "L"), (X,)),
    lambda dag: (daskdag.value_and_jacobian(dag, "L"), (X,)),
    lambda dag: (daskdag.value_and_jvp(dag, "L"), (X, jnp.ones(3))),
    lambda dag: (daskdag.value_grad_and_hvp(dag, "L"), (X, jnp.ones(3)))])
def test_prepared_functions_obey_clear_caches_and_prepared_calls_off(make):
    """A prepared function's own preparation goes with clear_caches(), and 0 turns it off too."""
    dag = {"A": Node(jnp.sin, ["x"], jit=True), "L": (jnp.sum, ["A"])}
    f, args = make(dag)
    f(*args)
    f(*args)
    assert f.info.prepared
    daskdag.clear_caches()
    f(*args)
    assert not f.info.prepared and f.info.why == "first call"
    with dask.config.set({"daskdag.prepared-calls": 0}):
        for _ in range(2):
            f(*args)
            assert not f.info.prepared and "prepared calls are off" in f.info.why
    f(*args)
    f(*args)
    assert f.info.prepared  # (on again: kept again)


# -- results say how they were computed -------------------------------------------------------------

def test_results_say_mode_passes_colours_and_preparation():
    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: a[:2] * a[1:], ["A"]),
           "L": (jnp.sum, ["B"])}
    grads = daskdag.compute_grads(dag, X, ["B", "L"], cotangents={"B": jnp.ones(2)})
    info = grads["L"].info
    assert (info.call, info.mode, info.passes, info.colours) == ("compute_grads", "rev", 2, None)
    assert info is grads["B"].info and "this process" in info.where
    jac = daskdag.jacobian(dag, X, "B", mode="rev")
    assert (jac.info.mode, jac.info.passes) == ("rev", 2)  # one row per element of B
    jac = daskdag.jacobian(dag, X, "B", mode="fwd")
    assert (jac.info.mode, jac.info.passes) == ("fwd", 3)  # one column per element of x
    sparse = daskdag.jacobian(dag, X, "B", sparsity="detect", mode="fwd")
    assert (sparse.info.sparsity, sparse.info.colours, sparse.info.passes) == ("detected", 2, 2)
    assert "CallInfo(jacobian, fwd, 2 passes, 2 colours, pattern detected" in repr(sparse)
    jvp = daskdag.compute_jvps(dag, X, jnp.ones((4, 3)), "B", batched=True)
    assert (jvp.info.mode, jvp.info.passes) == ("fwd", 4)
    hvp = daskdag.compute_hvps(dag, X, jnp.ones(3), "L")
    assert hvp.info.mode == "rev-over-fwd"
    sweep = daskdag.sweep_grads(dag, jnp.stack([X, 2 * X]), "L")
    assert sweep.info.call == "sweep_grads"
    assert "failed=" not in repr(grads["L"])  # (only sweeps' failed items show)


def test_auto_takes_forward_on_a_tie_as_openmdao_does():
    dag = {"A": (lambda x: jnp.cumsum(jnp.sin(x)), ["x"])}
    res = daskdag.jacobian(dag, X, "A")  # 3 outputs, 3 inputs
    assert res.info.mode == "fwd"
    assert_tree_close(res.grad, jax.jacrev(lambda x: jnp.cumsum(jnp.sin(x)))(X))
    wide = daskdag.jacobian({"A": (lambda x: jnp.sin(x[:2]), ["x"])}, X, "A")
    assert wide.info.mode == "rev"  # 2 outputs against 3 inputs


# -- prepared functions ---------------------------------------------------------------------------

def _loss_dag():
    W = jnp.array([[0.5, -0.2, 0.1], [0.3, 0.8, -0.4]])
    return {"H": Node(lambda p: jnp.tanh(W @ p["w"] + p["b"]), ["p"], jit=True),
            "L": Node(lambda h: jnp.sum((h - 0.3) ** 2), ["H"], jit=True)}, W


def test_value_and_grad_drops_into_an_optax_loop():
    import optax

    dag, W = _loss_dag()
    params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    f = daskdag.value_and_grad(dag, "L")
    opt = optax.adam(0.05)
    state = opt.init(params)
    plain = jax.value_and_grad(lambda p: jnp.sum((jnp.tanh(W @ p["w"] + p["b"]) - 0.3) ** 2))
    for step in range(30):
        loss, grads = f(params)
        want = plain(params)
        assert_tree_close((loss, grads), want, rtol=1e-5)
        assert f.info.prepared == (step > 0)
        updates, state = opt.update(grads, state)
        params = optax.apply_updates(params, updates)
    assert float(loss) < float(plain({"w": jnp.ones(3), "b": jnp.zeros(2)})[0]) / 4


def test_value_and_grad_drops_into_scipy_minimize(x64):
    from scipy.optimize import minimize

    dag = {"R": (lambda x: jnp.stack([10.0 * (x[1] - x[0] ** 2), 1.0 - x[0]]), ["x"]),
           "L": (lambda r: jnp.sum(r ** 2), ["R"])}  # Rosenbrock, as residuals
    f = daskdag.value_and_grad(dag, "L")
    out = minimize(f, np.array([-1.2, 1.0]), jac=True, method="BFGS")
    assert out.success and np.allclose(out.x, [1.0, 1.0], atol=1e-4)
    assert f.info.prepared


def test_jacobian_jvp_and_hvp_functions_agree_with_jax():
    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: a[:2] * a[1:], ["A"]),
           "L": (lambda b: jnp.sum(b ** 2), ["B"])}
    fn = lambda x: jnp.sin(x)[:2] * jnp.sin(x)[1:]  # noqa: E731
    loss = lambda x: jnp.sum(fn(x) ** 2)  # noqa: E731
    jac = daskdag.value_and_jacobian(dag, ["B", "L"])
    jvp = daskdag.value_and_jvp(dag, "B")
    hvp = daskdag.value_grad_and_hvp(dag, "L")
    v = jnp.array([1.0, -0.5, 0.25])
    for x in (X, X + 1.0):
        values, jacs = jac(x)
        assert_tree_close(values["B"], fn(x))
        assert_tree_close(jacs["B"], jax.jacrev(fn)(x))
        assert_tree_close(jacs["L"], jax.grad(loss)(x))
        value, tangent = jvp(x, v)
        assert_tree_close(tangent, jax.jvp(fn, (x,), (v,))[1])
        value, grad, h = hvp(x, v)
        assert_tree_close(grad, jax.grad(loss)(x))
        assert_tree_close(h, jax.jvp(jax.grad(loss), (x,), (v,))[1], rtol=1e-4)
    assert jac.info.prepared and jvp.info.prepared and hvp.info.prepared


def test_a_prepared_function_keeps_its_preparation_whatever_else_runs():
    dag, _ = _loss_dag()
    f = daskdag.value_and_grad(dag, "L")
    params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    f(params)
    with dask.config.set({"daskdag.prepared-calls": 1}):
        for k in range(3):  # other calls fill the process's one place
            daskdag.compute_grads({"A": (jnp.sin, ["x"]), "L": (jnp.sum, ["A"])},
                                  jnp.ones(k + 1), "L")
        f(params)
    assert f.info.prepared


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_prepared_functions_on_a_cluster_and_another_cluster(cli_client):
    """On a cluster, then on another one (a fresh local cluster): the same prepared function
    serves both, each cluster gets what it lacks, and the answers stay right."""
    from .support.clusters import local_client

    dag, W = _loss_dag()
    params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    plain = jax.value_and_grad(lambda p: jnp.sum((jnp.tanh(W @ p["w"] + p["b"]) - 0.3) ** 2))
    on_cli = daskdag.value_and_grad(dag, "L", client=cli_client)
    for step in range(3):
        assert_tree_close(on_cli(params), plain(params), rtol=1e-5)
        params = {"w": params["w"] * 0.9, "b": params["b"] + 0.1}
    assert on_cli.info.prepared and "cluster" in on_cli.info.where
    with local_client(2) as other:
        res = daskdag.compute_grads(dag, params, "L", client=other)
        assert res.info.prepared  # (packed functions do not depend on the cluster)
        assert_tree_close((res.value, res.grad), plain(params), rtol=1e-5)
