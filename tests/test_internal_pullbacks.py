"""Residuals that travel between worker processes (a node's, a custom node's as zero-copy frames, a
sweep chunk's, item by item or vectorized), compile caching, placement, version safety."""

import pickle

import dask
import distributed
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed import Client, Nanny, Scheduler, SpecCluster
from dask.sizeof import sizeof
from distributed.protocol import deserialize, serialize

import daskdag
from daskdag import ClusterError, Node
from daskdag.model.spec import parse
from daskdag.rules.vjp import linearize, linearizer, received
from daskdag.sweeps.chunked import Chunked
from daskdag.transport import programs

from .support.clusters import compute_split, live_workers
from .support.keys import key_kind, key_label
from .support.numbers import TraceLog, assert_tree_close
from .test_custom import N, W as SOLVE_W, make_A, make_b, solve_bwd, solve_fwd
from .test_internal_stages import _composed, _jit_dag
from .test_sweep import encode as item_encode, mixed_inputs
from .test_vmap_sweeps import encode as vmap_encode, inputs as vmap_inputs

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster():
    """Two worker processes: 'plain', and 'gpu' advertising GPU=1 (no real GPU needed)."""
    worker = {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1"}}
    gpu = {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1", "resources": {"GPU": 1}}}
    with SpecCluster(scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0",
                                                              "host": "127.0.0.1"}},
                     workers={"plain": worker, "gpu": gpu}, asynchronous=False) as cluster:
        with Client(cluster, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=60)
            yield cluster


@pytest.fixture
def client(cluster):
    with Client(cluster, set_as_default=False) as client:
        yield client


def _worker(client, name):
    return next(addr for addr, w in live_workers(client).items()
                if w["name"] == name)


# Node functions of several kinds; each test checks against jax.vjp of the same function.
def plain(x):
    return jnp.sin(x) * jnp.exp(x / 3)


def branchy(x):
    if jnp.sum(x) > 0:
        return jnp.tanh(x) ** 2
    return jnp.cos(x)


def pytrees(p):
    return {"h": jnp.tanh(p["w"] @ p["v"]), "aux": (p["v"] * 2, jnp.sum(p["w"] ** 2))}


def matvec(x, w):  # residuals include the large input w
    return jnp.tanh(w @ x)


X = jnp.linspace(-1.0, 2.0, 5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fn, x", [
    (plain, X),
    (branchy, X),
    (branchy, -X - 3),
    (pytrees, {"w": jnp.arange(6.0).reshape(2, 3) / 10, "v": jnp.array([1.0, -1.0, 0.5])}),
], ids=["plain", "control-flow-true", "control-flow-false", "pytrees"])
def test_residuals_travel(client, fn, x):
    ct = jax.tree.map(lambda y: jnp.full_like(y, 0.5), fn(x))
    dag = {"N": (fn, ["x"])}
    a, b = _worker(client, "plain"), _worker(client, "gpu")
    res, _ = compute_split(client, dag, x, ["N"], a, b, cotangents={"N": ct})
    value, grads = res["N"]
    ref_value, vjp = jax.vjp(fn, x)
    assert_tree_close(value, ref_value)
    assert_tree_close(grads["x"], vjp(ct)[0])


@pytest.mark.timeout(120)
def test_large_input_residual_travels_once(client):
    w = jax.random.normal(jax.random.key(0), (512, 512)) / 20
    x = jnp.linspace(-1.0, 1.0, 512)
    dag = {"h": (matvec, ["x", "w"]), "L": (lambda h: jnp.sum(h ** 2), ["h"])}
    a, b = _worker(client, "plain"), _worker(client, "gpu")
    res, _ = compute_split(client, dag, {"x": x, "w": w}, ["L"], a, b)
    value, grads = res["L"]
    ref_value, ref_grads = jax.value_and_grad(lambda x, w: jnp.sum(matvec(x, w) ** 2), (0, 1))(x, w)
    assert_tree_close(value, ref_value, rtol=1e-4)
    assert_tree_close(grads["x"], ref_grads[0], rtol=1e-4)
    assert_tree_close(grads["w"], ref_grads[1], rtol=1e-4)


def test_bytes_shipped_are_the_residuals():
    w = jax.random.normal(jax.random.key(1), (1024, 1024))  # 4 MiB, an input of the node
    x = jnp.ones((1024, 256))
    node = Node(lambda x, w: jnp.sum(jnp.tanh(w @ x)), ("x", "w"))
    _, pb = linearize(node, (x, w), (True, False))
    header, frames = serialize(pb)
    shipped = sum(memoryview(f).nbytes for f in frames)
    not_inputs = pb.residual_nbytes()  # tanh's derivative (1 MiB or two), and scalars; w is an input
    assert not_inputs >= 1024 * 256 * 4
    # Only the residuals that are not the node's inputs, and a program of a few KB, travel.
    assert not_inputs <= shipped <= not_inputs + 32 * 1024, (shipped, not_inputs)
    assert sizeof(pb) == not_inputs  # what the scheduler weighs when it considers moving it


@pytest.mark.timeout(180)
def test_one_compilation_per_worker_and_program(client):
    dag = {"h": (matvec, ["x", "w"]), "L": (lambda h: jnp.sum(h ** 2), ["h"])}
    w = jnp.eye(16) * 0.5
    a, b = _worker(client, "plain"), _worker(client, "gpu")
    before = client.run(programs.stats, workers=[b])[b]
    items = 8
    for i in range(items):
        x = jnp.linspace(0.0, 1.0, 16) + i
        res, _ = compute_split(client, dag, {"x": x, "w": w}, ["L"], a, b, wrt=["x"])
        ref = jax.grad(lambda x: jnp.sum(matvec(x, w) ** 2))(x)
        assert_tree_close(res["L"][1]["x"], ref, rtol=1e-4)
    after = client.run(programs.stats, workers=[b])[b]
    # The chain h -> L, linearized as one, moved its pullback per item: one program, compiled
    # once in this worker.
    assert after["compiled"] - before["compiled"] == 1
    assert after["cache_hits"] - before["cache_hits"] == items - 1


@pytest.mark.timeout(120)
def test_jit_node_traces_once_per_worker_across_calls(client, tmp_path):
    """Each call ships the node function anew; a worker reuses the node it first received, so
    ``jax.jit`` keeps its compilation instead of tracing (and compiling) on every call."""
    log = tmp_path / "traces"
    w = jnp.eye(16) * 0.5

    def traced(x):  # jit=True: the Python body runs only when JAX traces it
        with open(log, "a") as f:
            f.write("t")
        return jnp.tanh(w @ x)

    dag = {"h": daskdag.Node(traced, ["x"], jit=True), "L": (lambda h: jnp.sum(h ** 2), ["h"])}
    calls = 4
    for i in range(calls):
        x = jnp.linspace(0.0, 1.0, 16) + i
        r = daskdag.compute_grads(dag, x, "L", client=client)
        assert_tree_close(r.grad, jax.grad(lambda x: jnp.sum(jnp.tanh(w @ x) ** 2))(x), rtol=1e-4)
    # At most one trace per worker process (the first call in each), not one per call.
    assert 1 <= len(log.read_text()) <= 2 < calls


@pytest.mark.timeout(120)
def test_host_callback_node_recomputes_where_backward_runs(client):
    def numpy_sin(x):
        @jax.custom_vjp
        def f(x):
            return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

        def f_bwd(x, ct):
            return (ct * jax.pure_callback(np.cos, jax.ShapeDtypeStruct(x.shape, x.dtype), x),)

        f.defvjp(lambda x: (f(x), x), f_bwd)
        return f(x)

    dag = {"S": (numpy_sin, ["x"]), "L": (lambda s: jnp.sum(s ** 2), ["S"])}
    a, b = _worker(client, "plain"), _worker(client, "gpu")
    res, _ = compute_split(client, dag, X, ["L"], a, b)
    assert_tree_close(res["L"][1]["x"], jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(X))


@pytest.mark.timeout(120)
def test_gpu_nodes_run_only_on_the_gpu_worker(client):
    dag = {"A": (lambda x: jnp.tanh(x) * 2, ["x"]),
           "B": Node(lambda a: jnp.sin(a) @ jnp.ones((5, 5)), ["A"], resources={"GPU": 1}),
           "C": Node(lambda b: b ** 2, ["B"], resources={"GPU": 1}),
           "D": (lambda c, a: jnp.sum(c * a), ["C", "A"]),
           "E": (lambda b: jnp.sum(b), ["B"])}
    gpu = _worker(client, "gpu")
    with distributed.get_task_stream(client) as ts:
        res = daskdag.compute_grads(dag, X, ["D", "E"], client=client)
    placed = [t for t in ts.data if key_kind(t["key"]) in ("fwd", "val", "bwd")
              and key_label(t["key"]) in ("B", "C")]
    assert len(placed) >= 2 * 2 + 2  # fwd/val of B and C, and their backward tasks
    assert {t["worker"] for t in placed} == {gpu}

    def D(x):
        a = jnp.tanh(x) * 2
        return jnp.sum((jnp.sin(a) @ jnp.ones((5, 5))) ** 2 * a)

    assert_tree_close(res["D"].grad, jax.grad(D)(X), rtol=1e-4)


@pytest.mark.timeout(120)
def test_backward_beside_its_forward_serializes_nothing(client):
    gpu = {"GPU": 1}  # (the resource alone: the worker that offers it has no GPU device)
    dag = {"A": Node(plain, ["x"], resources=gpu), "B": Node(branchy, ["A"], resources=gpu),
           "L": Node(jnp.sum, ["B"], resources=gpu), "M": Node(jnp.max, ["B"], resources=gpu)}
    gpu = _worker(client, "gpu")
    before = client.run(programs.stats)
    res = daskdag.compute_grads(dag, X, ["L", "M"], client=client)
    assert client.run(programs.stats) == before  # no pullback exported or loaded anywhere
    assert_tree_close(res["M"].grad, jax.grad(lambda x: jnp.max(branchy(plain(x))))(X))
    assert gpu in before


@pytest.mark.timeout(60)
def test_missing_resource_is_an_error_not_a_hang(client):
    dag = {"A": Node(jnp.sin, ["x"], resources={"TPU": 1}), "B": (jnp.sum, ["A"])}
    with dask.config.set({"daskdag.worker-wait": "0.5s"}), \
            pytest.raises(ClusterError, match="node 'A' needs resources \\{'TPU': 1\\}, but no worker"):
        daskdag.compute_grads(dag, X, "B", client=client)


@pytest.mark.timeout(60)
def test_version_mismatch_names_the_workers(cluster):
    with Client(cluster, set_as_default=False) as client:
        b = _worker(client, "gpu")

        def pretend(version):
            daskdag.__version__ = version

        client.run(pretend, "0.0.0-other", workers=[b])
        # Only a test changes a running worker's version: forget which workers passed the check.
        daskdag.running.cluster._same_versions.clear()
        try:
            with pytest.raises(ClusterError, match=f"workers differ.*{b}.*0.0.0-other"):
                daskdag.compute_grads({"A": (jnp.sin, ["x"]), "B": (jnp.sum, ["A"])}, X, "B",
                                      client=client)
        finally:
            client.run(pretend, daskdag.__version__, workers=[b])


def test_program_from_other_versions_is_refused():
    node = Node(plain, ("x",))
    _, pb = linearize(node, (X,), (True,))
    form = pb.portable()
    form["versions"] = {**form["versions"], "jaxlib": "0.0.1"}
    with pytest.raises(ClusterError, match="exported under .*0.0.1"):
        received(form)


def _gram_solve(a, b):  # linear algebra: custom calls of their own on each platform
    return jnp.tanh(jnp.linalg.solve(a @ a.T + 4 * jnp.eye(a.shape[0]), b))


def test_backward_program_runs_on_every_platform():
    """A pullback's program is exported for CPU, CUDA, ROCm and TPU: JAX lowers its call for
    each here (no accelerator needed to lower), and it runs here against ``jax.vjp``."""
    a, b = jnp.arange(16.0).reshape(4, 4) / 10, jnp.linspace(-1, 1, 4)
    _, pb = linearize(Node(_gram_solve, ("a", "b")), (a, b), (True, True))
    form = pb.portable()
    exported = jax.export.deserialize(bytearray(form["program"]))
    assert set(exported.platforms) >= {"cpu", "cuda", "rocm", "tpu"}
    for platform in exported.platforms:
        text = jax.jit(exported.call).trace(*exported.in_avals).lower(
            lowering_platforms=(platform,)).as_text()
        assert "custom_call" in text, platform
    ct = (jnp.linspace(0.5, 1.5, 4),)
    got = received(form)(ct, (a, b))
    want = jax.vjp(_gram_solve, a, b)[1](ct[0])
    for g, w in zip(got, want):
        assert_tree_close(g[0], w, rtol=1e-5)


def test_program_for_other_platforms_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(programs, "platforms", lambda: ("tpu",))
    _, pb = linearize(Node(_gram_solve, ("a", "b")), (jnp.eye(3), jnp.ones(3)), (True, True))
    with pytest.raises(ClusterError, match=r"runs JAX on 'cpu'.*exported for \('tpu',\) only"):
        received(pb.portable())


def _primitive_lowered_for(platform):
    """An identity primitive with a lowering for ``platform`` only."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir
    prim = Primitive(f"identity_on_{platform}")
    prim.def_impl(lambda x: x)
    prim.def_abstract_eval(lambda x: x)
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x, multiple_results=False),
                           platform=platform)
    return prim


def test_program_is_exported_for_the_platforms_that_lower_it():
    """An operation without a lowering for some platforms: exported for the others, this
    process's among them; not for this process's: the error, so the pullback travels as its node."""
    on_cpu, on_tpu = _primitive_lowered_for("cpu"), _primitive_lowered_for("tpu")
    ct = jax.ShapeDtypeStruct((3,), jnp.float32)
    closed = jax.make_jaxpr(lambda c: on_cpu.bind(c) * 2)(ct)
    key, data = programs.export(closed, [ct])
    assert jax.export.deserialize(bytearray(data)).platforms == ("cpu",)
    np.testing.assert_allclose(programs.load(key, data)(jnp.arange(3.0))[0], 2 * np.arange(3.0))
    with pytest.raises(Exception, match="identity_on_tpu"):
        programs.export(jax.make_jaxpr(lambda c: on_tpu.bind(c))(ct), [ct])


@pytest.mark.timeout(180)
def test_cluster_started_with_the_dask_cli(cli_cluster):
    """The node functions are this test module's, which the workers cannot import: they travel
    by value (daskdag.shipping)."""
    assert cli_cluster.startswith("tcp://127.0.0.1:")
    with Client(cli_cluster, set_as_default=False, timeout=60) as client:  # reached by address
        client.wait_for_workers(2, timeout=60)
        assert all(client.run(lambda: __import__("importlib").util.find_spec("tests") is None).values())
        workers = sorted(live_workers(client))
        dag = {"h": (matvec, ["x", "w"]), "L": (lambda h: jnp.sum(h ** 2), ["h"]),
               "M": (lambda h: jnp.max(h), ["h"])}
        inputs = {"x": jnp.linspace(0, 1, 8), "w": jnp.eye(8) / 2}
        res = daskdag.compute_grads(dag, inputs, ["L", "M"], client=client)
        for o, f in {"L": lambda x, w: jnp.sum(matvec(x, w) ** 2),
                     "M": lambda x, w: jnp.max(matvec(x, w))}.items():
            ref = jax.grad(f, (0, 1))(inputs["x"], inputs["w"])
            assert_tree_close(res[o].grad["x"], ref[0], rtol=1e-4)
        split, _ = compute_split(client, dag, inputs, ["L"], workers[0], workers[1])
        assert_tree_close(split["L"][1]["w"],
                          jax.grad(lambda w: jnp.sum(matvec(inputs["x"], w) ** 2))(inputs["w"]),
                          rtol=1e-4)


def test_received_pullback_can_travel_on():
    w = jnp.eye(4) * 2
    _, pb = linearize(Node(matvec, ("x", "w")), (X[:4], w), (True, False))
    ct = (jnp.arange(4.0),)  # a cotangent: one array per differentiable leaf of the output
    once = deserialize(*serialize(pb))
    twice = deserialize(*serialize(once))  # a worker passing on a replica it fetched
    for p in (once, twice):
        assert_tree_close(p(ct, (X[:4], w))[0], pb(ct, (X[:4], w))[0])
    assert twice.residual_nbytes() == once.residual_nbytes() == pb.residual_nbytes() == 2 * 4 * 4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_jax_arrays_travel_as_numpy_frames(dtype):
    a = jnp.arange(12, dtype=dtype).reshape(3, 4)
    header, frames = serialize(a)
    assert header["serializer"] == "dask" and sum(memoryview(f).nbytes for f in frames) == a.nbytes
    b = deserialize(header, frames)
    assert isinstance(b, jax.Array) and b.dtype == a.dtype
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


@pytest.mark.timeout(120)
def test_fused_and_chain_pullbacks_move_between_workers(client):
    a, b = sorted(client.scheduler_info()["workers"])
    x = jnp.linspace(-1.0, 1.0, 5)
    dag = _jit_dag(TraceLog())  # (from test_internal_stages)
    dag.update({"P": (jnp.cos, ["E"]), "Q": (lambda p: p * 3.0, ["P"])})  # + an eager chain
    res, ran = compute_split(client, dag, x, ["Q"], a, b)
    assert {key_label(k) for k in ran if key_kind(k) == "fwd"} == {"A+3more+E", "P+Q"}
    want = jax.value_and_grad(lambda x: jnp.cos(_composed(x)[1]) * 3.0)(x)
    assert_tree_close(res["Q"][0], want[0], rtol=1e-5)
    assert_tree_close(res["Q"][1]["x"], want[1], rtol=1e-5)


# -- a custom node's residuals; a sweep chunk's pullbacks ---------------------------------------------

def test_pullback_residuals_travel_as_zero_copy_frames():
    node = parse({"x": Node(fwd=solve_fwd, bwd=solve_bwd, deps=["A", "b"])}).nodes["x"]
    A, b = np.asarray(make_A(SOLVE_W)), np.asarray(make_b(SOLVE_W))
    _, pb = linearizer(node)((A, b), (True, True))
    header, frames = serialize(pb)
    lu = pb.residuals.lu[0]
    assert any(memoryview(f).nbytes == lu.nbytes and bytes(f) == lu.tobytes(order="A") for f in frames)
    moved = deserialize(header, frames)
    ct = np.ones(N, np.float32)
    for got, want in zip(moved((ct,), (A, b)), pb((ct,), (A, b))):
        assert_tree_close(got, want)


def test_item_pullbacks_travel_between_processes():
    node = Node(item_encode, ("x", "w"))
    inputs = mixed_inputs(n=3)
    args = (inputs["x"], inputs["w"])
    primal, pbs = Chunked(node, (0, None)).linearize(args, (True, False))
    # The primal is Items (unstacked); its cotangent, each item's leaves in turn.
    ct = tuple(jnp.ones_like(one) for one in primal)
    ref = pbs(ct, args)
    for moved in (pickle.loads(pickle.dumps(pbs)), deserialize(*serialize(pbs))):
        got = moved(ct, args)
        assert got[1] is None
        assert_tree_close(got[0], ref[0])
    expected = jax.vmap(lambda x: jax.vjp(lambda x: item_encode(x, inputs["w"]), x)[1](jnp.ones(4))[0])(inputs["x"])
    assert_tree_close(ref[0], (expected,))


def test_vmap_chunk_pullbacks_travel_between_processes():
    chunk = Chunked(Node(vmap_encode, ("p", "w"), vmap=True), (0, None))
    xs = vmap_inputs(n=3)
    args = (xs["p"], xs["w"])
    primal, pb = chunk.linearize(args, (True, True))
    ct = (jnp.ones_like(primal["h"]),)  # one array per differentiable leaf: h (k is an int)
    ref = pb(ct, args)
    # Residuals that are the node's inputs (w, x) stay behind when it moves: the backward task
    # has them.
    assert 0 < pb.residual_nbytes() and pb.portable()["slots"]
    assert sum(c.nbytes for c in pb.portable()["consts"] if c is not None) == pb.residual_nbytes()
    for moved in (pickle.loads(pickle.dumps(pb)), deserialize(*serialize(pb))):
        got = moved(ct, args)
        assert_tree_close(got, ref)
    gx, gw = jax.vmap(lambda x, k: jax.vjp(lambda x, w: vmap_encode({"x": x, "k": k}, w)["h"], x,
                                           xs["w"])[1](jnp.ones(4)))(xs["p"]["x"], xs["p"]["k"])
    assert_tree_close(ref[0], (gx,), rtol=1e-5)  # p's one differentiable leaf
    assert_tree_close(ref[1], (np.sum(gw, 0),), rtol=1e-5)  # w is shared: summed over items
