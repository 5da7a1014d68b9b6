"""What travels to a cluster: the user's own module, fresh values after in-place changes,
custom pytrees, jax.custom_vjp; on a cluster started with the ``dask`` command that cannot
import the user's code."""

import copyreg
import importlib
import pickle
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag.transport import packing as shipping
from .support.clusters import compute_split, live_workers
from .support.numbers import assert_tree_close

USER_MODULE = '''
import jax
import jax.numpy as jnp
import numpy as np
import equinox as eqx

SCALE = np.ones(3, dtype=np.float32)  # a module global the test changes in place


def encode(x):
    return jnp.tanh(x) * SCALE


def energy(h):
    if jnp.sum(h) > 0:  # Python control flow on a value
        return jnp.sum(h ** 2)
    return jnp.sum(jnp.cos(h))


_MISSING = object()


@jax.tree_util.register_pytree_node_class
class Params:
    """A pytree whose unflatten checks a sentinel by identity, as equinox's does."""

    def __init__(self, w, b):
        self.w, self.b = w, b

    def tree_flatten(self):
        return (self.w, self.b), _MISSING

    @classmethod
    def tree_unflatten(cls, aux, children):
        if aux is not _MISSING:
            raise TypeError("a foreign sentinel: this treedef was unpickled")
        return cls(*children)


def affine(p, x):
    return Params(jnp.tanh(p.w * x), p.b * 2.0)


def readout(q):
    return jnp.sum(q.w ** 2) + jnp.sum(q.b ** 3)


class Scaled(eqx.Module):
    w: jax.Array
    activation: object = jnp.tanh

    def __call__(self, x):
        return self.activation(self.w * x)
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the user's, importable here only."""
    name = f"usermod_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    yield module
    sys.modules.pop(name, None)


def _cannot_import(client, name):
    return all(client.run(lambda: importlib.util.find_spec(name) is None).values())


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_user_module_on_a_cluster_that_cannot_import_it(cli_client, user_module):
    m = user_module
    assert _cannot_import(cli_client, m.__name__)
    dag = {"H": (m.encode, ["x"]), "E": (m.energy, ["H"])}
    x = jnp.linspace(-1.0, 1.0, 3)
    res = daskdag.compute_grads(dag, x, "E", client=cli_client)
    value, grad = jax.value_and_grad(lambda x: m.energy(m.encode(x)))(x)
    assert_tree_close(res.value, value)
    assert_tree_close(res.grad, grad)

    xs = jnp.linspace(-1.0, 1.0, 24).reshape(8, 3)
    swept = daskdag.sweep_grads(dag, xs, "E", chunk_size=3, client=cli_client)
    values, grads = zip(*(jax.value_and_grad(lambda x: m.energy(m.encode(x)))(x) for x in xs))
    assert_tree_close(swept.value, jnp.stack(values))
    assert_tree_close(swept.grad, jnp.stack(grads))

    m.SCALE[:] = 3.0  # the module's global, changed in place: the next call must see it
    again = daskdag.compute_grads(dag, x, "E", client=cli_client)
    value3, grad3 = jax.value_and_grad(lambda x: m.energy(m.encode(x)))(x)
    assert not np.allclose(value3, value)
    assert_tree_close(again.value, value3)
    assert_tree_close(again.grad, grad3)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_sentinel_pytree_through_a_pullback_moved_to_another_worker(cli_client, user_module):
    m = user_module
    p = m.Params(jnp.array([0.5, -1.0, 2.0]), jnp.array([1.0, 2.0, -0.5]))
    x = jnp.array([1.0, 0.3, -0.2])
    dag = {"Q": (m.affine, ["p", "x"]), "L": (m.readout, ["Q"])}
    a, b = sorted(live_workers(cli_client))
    res, _ = compute_split(cli_client, dag, {"p": p, "x": x}, ["L"], a, b)
    value, grads = res["L"]
    ref_value, (gp, gx) = jax.value_and_grad(lambda p, x: m.readout(m.affine(p, x)), (0, 1))(p, x)
    assert_tree_close(value, ref_value)
    assert isinstance(grads["p"], m.Params)  # the gradient has the input's own class
    assert_tree_close(jax.tree.leaves(grads["p"]), jax.tree.leaves(gp))
    assert_tree_close(grads["x"], gx)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_equinox_module_of_the_users_own_as_input(cli_client, user_module):
    """equinox's own classes (eqx.nn.MLP...) are installed code; a Module subclass of the
    user's cannot be rebuilt by value, so its module must reach the cluster: the error says
    how, and after ``client.upload_file`` it works."""
    import equinox as eqx

    m = user_module
    model, x = m.Scaled(jnp.array([0.5, -1.0, 2.0])), jnp.array([1.0, 0.3, -0.2])
    dag = {"Y": (lambda model, x: model(x), ["model", "x"]), "L": (jnp.sum, ["Y"])}
    with pytest.raises(Exception, match=f"{m.__name__}.Scaled is an equinox Module of your own"
                                        f".*client.upload_file"):
        daskdag.compute_grads(dag, {"model": model, "x": x}, "L", client=cli_client)
    cli_client.upload_file(m.__file__)
    res = daskdag.compute_grads(dag, {"model": model, "x": x}, "L", client=cli_client)

    ref = eqx.filter_grad(lambda model: jnp.sum(model(x)))(model)
    assert res.grad["model"].activation is None  # a function leaf: held constant
    assert_tree_close(res.grad["model"].w, ref.w)


def _mutation_cases():
    W = np.ones(3, dtype=np.float32)
    coeffs = [1.0]

    class Config:
        scale = 1.0

    cfg = Config()
    dag = {"y": (lambda x: jnp.sum(W * x) * coeffs[0] * cfg.scale, ["x"])}
    jitted = {"y": daskdag.Node(lambda x: jnp.sum(W * x), ["x"], jit=True)}

    def change_array():
        W[:] = 2.0

    def change_list():
        coeffs[0] = 2.0

    def change_object():
        cfg.scale = 2.0

    return [(dag, change_array, W), (dag, change_list, W), (dag, change_object, W),
            (jitted, change_array, W)]


@pytest.mark.cluster
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", range(4), ids=["numpy-array", "list", "object", "jit-numpy-array"])
def test_in_place_change_to_a_closure_is_seen_by_the_next_call(cli_client, case):
    dag, change, _ = _mutation_cases()[case]
    x = jnp.ones(3)
    first = daskdag.compute_grads(dag, x, "y", client=cli_client)
    assert float(first.value) == 3.0
    np.testing.assert_allclose(first.grad, np.ones(3))
    change()
    for scheduler in (cli_client, None):  # a cluster, and Dask's threads
        second = daskdag.compute_grads(dag, x, "y", client=scheduler)
        assert float(second.value) == 6.0
        np.testing.assert_allclose(second.grad, np.full(3, 2.0))


@pytest.mark.parametrize("kind", ["jit", "fused-jit", "vmap-sweep", "eager-sweep"])
def test_in_place_change_to_a_closure_is_seen_by_the_next_local_call(kind):
    """On Dask's threads, the compiled programs of jitted nodes, fused stages and vmap sweep
    nodes are kept per function: after an in-place change to the weights a function closes
    over, the next call computes with the new weights (it once silently reused the program
    compiled with the old ones), and with the old content back, the old program serves again."""
    W = np.ones(3, dtype=np.float32)
    vmap = kind.endswith("sweep")
    jit = kind in ("jit", "fused-jit")
    h = daskdag.Node(lambda x: jnp.tanh(W * x), ["x"], jit=jit, vmap=kind == "vmap-sweep")
    dag = {"h": h, "y": daskdag.Node(jnp.sum, ["h"], jit=kind == "fused-jit",
                                     vmap=kind == "vmap-sweep")}
    x = jnp.linspace(0.1, 0.5, 3)

    def run():
        if vmap or kind == "eager-sweep":
            res = daskdag.sweep_grads(dag, jnp.stack([x, 2 * x]), "y")
            return res.value[0], res.grad[0]
        res = daskdag.compute_grads(dag, x, "y")
        return res.value, res.grad

    for scale in (1.0, 2.0, 1.0):
        W[:] = scale
        value, grad = run()
        want = jax.value_and_grad(lambda x: jnp.sum(jnp.tanh(scale * x)))(x)
        assert_tree_close((value, grad), want, rtol=1e-6)


def test_a_local_call_pickles_only_what_its_compiled_programs_need(monkeypatch):
    """On Dask's threads nothing travels, so nothing is pickled, but the functions of jit=True
    nodes, whose compiled programs are kept per content (a pickle per node function per call
    was most of a small DAG's cost); and an in-place change to what an eager node closes over
    is seen by the next call all the same."""
    packed = []
    pack = shipping.pack
    monkeypatch.setattr(shipping, "pack",
                        lambda obj, *a, **kw: packed.append(obj) or pack(obj, *a, **kw))
    W = np.ones(3, dtype=np.float32)
    scale = lambda x: jnp.tanh(W * x)  # noqa: E731
    x = jnp.linspace(0.1, 0.5, 3)
    for w in (1.0, 2.0):
        W[:] = w
        res = daskdag.compute_grads({"h": (scale, ["x"]), "y": (jnp.sum, ["h"])}, x, "y")
        assert_tree_close((res.value, res.grad),
                          jax.value_and_grad(lambda x: jnp.sum(jnp.tanh(w * x)))(x), rtol=1e-6)
    assert packed == []
    dag = {"h": daskdag.Node(scale, ["x"], jit=True), "y": (jnp.sum, ["h"])}
    daskdag.compute_grads(dag, x, "y")
    assert packed == [scale]  # the jit node's function alone (its content keys its programs)


def test_tokens_follow_content_not_identity():
    W = np.ones((256, 256), dtype=np.float32)
    J = jnp.ones((256, 256))
    f, g = (lambda x: W @ x), (lambda x: J @ x)
    first = shipping.pack(f, as_function=True)
    assert shipping.pack(f, as_function=True).token == first.token  # same content, same token
    assert len(first.skeleton) < 4096 < W.nbytes  # arrays travel out of band, not in the bytes
    W[0, 0] = 5.0
    assert shipping.pack(f, as_function=True).token != first.token
    assert shipping.pack(g, as_function=True).token == shipping.pack(g, as_function=True).token


def test_a_packed_function_travels_and_is_reused_by_token():
    W = np.arange(3.0)
    f = shipping.pack(lambda x: W * x, as_function=True)
    a = pickle.loads(pickle.dumps(f))
    np.testing.assert_allclose(a(2.0), W * 2.0)
    b = pickle.loads(pickle.dumps(f))
    assert b is a  # the process keeps the function it received for that token (jit caches)
    W[:] = 7.0
    c = pickle.loads(pickle.dumps(shipping.pack(f.load(), as_function=True)))
    assert c is not a
    np.testing.assert_allclose(c(1.0), np.full(3, 7.0))


def test_custom_vjp_travels_without_a_process_wide_copyreg_entry():
    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, ct: (jnp.clip(ct, -1.0, 1.0),))
    assert jax.custom_vjp not in copyreg.dispatch_table
    with pytest.raises(Exception):
        pickle.dumps(clip_grad)  # JAX alone cannot pickle it
    moved = pickle.loads(pickle.dumps(shipping.pack(clip_grad, as_function=True))).load()
    assert isinstance(moved, jax.custom_vjp) and moved is not clip_grad
    np.testing.assert_allclose(jax.grad(lambda x: 5.0 * moved(x))(1.0), 1.0)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_unpicklable_node_function_is_named_on_a_cluster(cli_client):
    lock = threading.Lock()

    def guarded(x):
        with lock:
            return jnp.sum(x ** 2)

    dag = {"A": (jnp.sin, ["x"]), "B": (guarded, ["A"])}
    with pytest.raises(daskdag.DAGError, match="node 'B': its function cannot be sent to the "
                                               "cluster: pickling it failed .*lock"):
        daskdag.compute_grads(dag, jnp.ones(3), "B", client=cli_client)
    # Locally nothing travels, so it runs.
    r = daskdag.compute_grads(dag, jnp.ones(3), "B")
    assert_tree_close(r.grad, jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(jnp.ones(3)))


def test_a_user_module_replaced_under_its_name_still_travels_by_value(tmp_path):
    """A module of the user's made anew under the same name (``sys.modules`` keeps its size
    and order): its functions are pickled by value, not by a reference the workers cannot
    import."""
    import types

    def make():
        m = types.ModuleType("replaced_user_module")
        m.__file__ = str(tmp_path / "replaced_user_module.py")
        exec("def f(x):\n    return x + 1\n", m.__dict__)
        sys.modules[m.__name__] = m
        return m

    try:
        shipping.pack(make().f)
        packed = shipping.pack(make().f)
    finally:
        sys.modules.pop("replaced_user_module", None)
    assert pickle.loads(pickle.dumps(packed)).load()(1) == 2  # (no import of the module)


# -- daskdag's pickling by value is its own: no other pickling in the process sees it ------------

INSTALLED_ELSEWHERE = '''
import sys


def by_reference():
    """True where it runs as its module's own function (it was pickled by reference and its
    module imported), False where it is a copy pickled by value."""
    module = sys.modules.get(__name__)
    return module is not None and globals() is vars(module)


def work(x):
    return x + 1
'''


@pytest.fixture
def importable_module(tmp_path, monkeypatch):
    """A module of the user's that every process here can import (on ``sys.path``, which a
    spawned worker inherits): the user's own pickling must send it by reference."""
    name = f"everywhere_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(INSTALLED_ELSEWHERE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    module = importlib.import_module(name)
    yield module
    sys.modules.pop(name, None)


class _Packing:
    """daskdag packing ``functions`` in a loop on a thread of its own, until the block ends;
    ``packed``: the last pack of each."""

    def __init__(self, functions):
        self.functions, self.stop, self.packs = functions, threading.Event(), 0
        self.packed: list = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            self.packed = [shipping.pack(f, as_function=True) for f in self.functions]
            self.packs += 1

    def __enter__(self):
        self.thread.start()
        while not self.packs:  # (packing is under way)
            self.stop.wait(0.01)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=60)


def _loads_without(module, packed):
    """What ``packed`` loads as while ``module`` cannot be imported: it travelled by value."""
    name = module.__name__
    saved, refuse = sys.modules.pop(name), _Refuse(name)
    sys.meta_path.insert(0, refuse)
    try:
        return shipping.Packed(None, packed.skeleton, packed.arrays).load()
    finally:
        sys.meta_path.remove(refuse)
        sys.modules[name] = saved


class _Refuse:
    """An import finder that refuses one module name (as a cluster without it would)."""

    def __init__(self, name):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def test_other_pickling_meanwhile_keeps_the_users_module_by_reference(importable_module,
                                                                     user_module):
    """While daskdag packs functions of the user's modules on one thread, cloudpickle and
    distributed's pickling on another still pickle a function of the user's importable module
    by reference (cloudpickle's rule), not by value; daskdag's packs are still by value."""
    import cloudpickle
    from distributed.protocol import pickle as distributed_pickle

    m = importable_module
    by_reference = cloudpickle.dumps(m.work)
    assert len(by_reference) < 200  # (a reference: module and name)
    with _Packing([m.work, m.by_reference, user_module.encode, user_module.energy]) as packing:
        seen = set()
        while packing.packs < 200:
            seen.add(cloudpickle.dumps(m.work))
            seen.add(distributed_pickle.dumps(m.work))
    assert seen == {by_reference}
    work = _loads_without(m, packing.packed[0])  # daskdag's own: by value
    assert work(1) == 2 and work is not m.work


@pytest.mark.cluster
@pytest.mark.spawn  # (the worker imports the module from the PYTHONPATH it starts with)
@pytest.mark.timeout(240)
def test_client_submit_meanwhile_pickles_the_users_module_by_reference(importable_module):
    """``client.submit`` of a task that calls a function of an importable module of the user's
    (a lambda: distributed pickles it with cloudpickle), from one thread while daskdag packs
    that module's functions on another: the worker runs the module's own function (the module
    pickled by reference and imported there), not a copy pickled by value."""
    from .support.clusters import local_client

    m = importable_module
    task = lambda: m.by_reference()  # noqa: E731
    with local_client(1, threads_per_worker=1) as client:
        assert client.submit(task, pure=False).result()  # (before)
        with _Packing([m.work, m.by_reference]):
            futures = [client.submit(task, pure=False) for _ in range(40)]
            results = client.gather(futures)
        assert results == [True] * 40


def test_cloudpickles_private_names_the_pickler_uses_are_there():
    """daskdag's pickler decides by value itself with cloudpickle's own reducers
    (:data:`daskdag.transport.pickler.PRIVATE`): a cloudpickle release that renames one fails
    here, not in the middle of a user's call."""
    import cloudpickle.cloudpickle as cp

    from daskdag.transport.pickler import PRIVATE

    assert [name for name in PRIVATE if not callable(getattr(cp, name, None))] == []


def test_what_a_function_reads_of_a_users_module_changes_its_packed_token(tmp_path):
    """An attribute of a user's module that a function reads, rebound or changed in place:
    pickling sends it (no salt from the fingerprint), so the packed token changes; one it does
    not read keeps the token. ``__main__`` held as a module travels with what the code reads
    of it."""
    import __main__
    import types

    helpers = types.ModuleType("shipping_helpers")
    helpers.__file__ = str(tmp_path / "shipping_helpers.py")
    helpers.scale, helpers.W, helpers.unread = 1.0, np.ones(3), 0
    sys.modules[helpers.__name__] = helpers
    namespace = {"helpers": helpers, "main": __main__, "__name__": "shipping_script"}
    exec("def h(x):\n    return x * helpers.scale + helpers.W + main.SHIPPING_OFFSET\n", namespace)
    h = namespace["h"]
    __main__.SHIPPING_OFFSET = 1.0
    try:
        tokens = [shipping.pack_function("h", h, strict=False).token]
        for change in (lambda: setattr(helpers, "scale", 2.0),
                       lambda: helpers.W.__setitem__(0, 5.0),
                       lambda: setattr(__main__, "SHIPPING_OFFSET", 3.0),
                       lambda: setattr(helpers, "unread", 1)):
            change()
            tokens.append(shipping.pack_function("h", h, strict=False).token)
        assert len(set(tokens[:4])) == 4 and tokens[4] == tokens[3]
        packed = shipping.pack_function("h", h, strict=False)
        moved = shipping.Function(None, packed.skeleton, packed.arrays).load()
        del __main__.SHIPPING_OFFSET  # (what travelled holds it)
        np.testing.assert_allclose(moved(1.0), [10.0, 6.0, 6.0])
    finally:
        sys.modules.pop(helpers.__name__, None)
        vars(__main__).pop("SHIPPING_OFFSET", None)
