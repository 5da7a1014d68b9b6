"""Sweeps of vmap=True nodes on this process's devices (daskdag.sweep-devices): chunks as large
as the devices' memory allows, each chunk's item axis sharded over the devices, results left on
them as jax.Arrays (daskdag.sweep-results) or copied to NumPy. Here on 4 CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4, set before JAX starts); every kind's
results against jax.vmap of JAX's own derivative of the composed function."""

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag
from daskdag import Node
from daskdag.sweeps import devices

from .support.numbers import TraceLog, assert_tree_close

four = pytest.mark.skipif(
    len(jax.devices()) < 4,
    reason="needs 4 devices of JAX's default platform: run with "
           "XLA_FLAGS=--xla_force_host_platform_device_count=4 (set before JAX starts)")

N = 1001  # items: not a multiple of the 4 devices


def sharded(results: str = "device", count="all"):
    return dask.config.set({"daskdag.sweep-devices": count, "daskdag.sweep-results": results})


def encode(x, w):
    return jnp.tanh(x * w) + 0.1 * x ** 2


def energy(a, b):
    return jnp.sum(a ** 2 * b) + jnp.sum(jnp.sin(a))


def composed(x, w, b):
    return energy(encode(x, w), b)


def dag(log=None):
    def a(x, w):
        if log is not None:
            log.append("A")  # (each trace: Python runs once per program, never per item)
        return encode(x, w)

    return {"A": Node(a, ["x", "w"], vmap=True),
            "B": Node(jnp.cos, ["w"], vmap=True),  # of the shared input alone
            "S": Node(energy, ["A", "B"], vmap=True)}


def data(n=N, d=8):
    k = jax.random.split(jax.random.key(0), 3)
    return {"x": np.asarray(jax.random.normal(k[0], (n, d))),
            "w": np.asarray(jax.random.normal(k[1], (d,))),
            "v": np.asarray(jax.random.normal(k[2], (n, d)))}


def whole(x, w):  # the composed function, as JAX differentiates it
    return composed(x, w, jnp.cos(w))


def on_devices(*arrays, count=4):
    for a in arrays:
        assert isinstance(a, jax.Array), type(a)
        assert len(a.sharding.device_set) == count, a.sharding


@four
def test_sweep_grads_sharded_matches_vmap():
    xs = data()
    with sharded():
        res = daskdag.sweep_grads(dag(), {"x": xs["x"], "w": xs["w"]}, "S", batched=["x"],
                                  wrt=["x", "w"])
    value, (gx, gw) = jax.vmap(jax.value_and_grad(whole, (0, 1)), (0, None))(xs["x"], xs["w"])
    on_devices(res.value, res.grad["x"], res.grad["w"])
    assert res.grad["x"].shape == (N, 8) and res.grad["w"].shape == (N, 8)
    assert_tree_close(res.value, value, rtol=1e-5)
    assert_tree_close(res.grad["x"], gx, rtol=1e-5)
    assert_tree_close(res.grad["w"], gw, rtol=1e-5)
    assert res.info.chunks == 1  # all of them fit: one chunk, one program over it
    assert "4 cpu devices" in res.info.where


@four
def test_items_a_multiple_of_the_devices_stay_sharded():
    xs = data(n=1000)
    with sharded():
        res = daskdag.sweep_grads(dag(), {"x": xs["x"], "w": xs["w"]}, "S", batched=["x"])
    assert res.grad["x"].sharding.spec == jax.sharding.PartitionSpec(devices.AXIS)
    assert_tree_close(res.grad["x"], jax.vmap(jax.grad(whole), (0, None))(xs["x"], xs["w"]),
                      rtol=1e-5)


@four
def test_host_results_are_numpy_and_the_same():
    xs = data()
    with sharded("device"):
        there = daskdag.sweep_grads(dag(), {"x": xs["x"], "w": xs["w"]}, "S", batched=["x"])
    with sharded("host"):
        here = daskdag.sweep_grads(dag(), {"x": xs["x"], "w": xs["w"]}, "S", batched=["x"])
    assert type(here.value) is np.ndarray and type(here.grad["x"]) is np.ndarray
    assert here.info.chunks == 1 and "4 cpu devices" in here.info.where
    np.testing.assert_array_equal(here.grad["x"], np.asarray(there.grad["x"]))
    np.testing.assert_array_equal(here.value, np.asarray(there.value))


@four
def test_prepared_value_and_grad_sweep_sharded():
    xs = data()
    f = daskdag.value_and_grad(dag(), "S", wrt=["x", "w"])
    with sharded():
        value, grads = f.sweep({"x": xs["x"], "w": xs["w"]}, batched=["x"])
    expected = jax.vmap(jax.value_and_grad(whole, (0, 1)), (0, None))(xs["x"], xs["w"])
    on_devices(value, grads["x"], grads["w"])
    assert_tree_close((value, (grads["x"], grads["w"])), expected, rtol=1e-5)


@four
@pytest.mark.parametrize("mode", ["rev", "fwd"])
def test_sweep_jacobians_sharded(mode):
    xs = data()
    with sharded():
        res = daskdag.sweep_jacobians(dag(), {"x": xs["x"], "w": xs["w"]}, "A", batched=["x"],
                                      mode=mode)
    on_devices(res.value, res.grad["x"])
    assert res.info.chunks == 1
    jac = jax.vmap(jax.jacrev(encode), (0, None))(xs["x"], xs["w"])
    assert_tree_close(res.grad["x"], jac, rtol=1e-5)
    assert_tree_close(res.value, jax.vmap(encode, (0, None))(xs["x"], xs["w"]), rtol=1e-6)


@four
def test_sweep_jvps_sharded():
    xs = data()
    with sharded():
        res = daskdag.sweep_jvps(dag(), {"x": xs["x"], "w": xs["w"]}, {"x": xs["v"]}, "S",
                                 batched=["x"])
    on_devices(res.value, res.tangent)
    value, tangent = jax.vmap(lambda x, v: jax.jvp(lambda x: whole(x, xs["w"]), (x,), (v,)))(
        xs["x"], xs["v"])
    assert_tree_close(res.value, value, rtol=1e-5)
    assert_tree_close(res.tangent, tangent, rtol=1e-5)


@four
def test_sweep_hvps_sharded():
    xs = data()
    with sharded():
        res = daskdag.sweep_hvps(dag(), {"x": xs["x"], "w": xs["w"]}, {"x": xs["v"]}, "S",
                                 batched=["x"])
    on_devices(res.value, res.grad["x"], res.hvp["x"])
    def one(x):
        return whole(x, xs["w"])

    def hvp(x, v):
        return jax.jvp(jax.grad(one), (x,), (v,))[1]

    assert_tree_close(res.grad["x"], jax.vmap(jax.grad(one))(xs["x"]), rtol=1e-5)
    assert_tree_close(res.hvp["x"], jax.vmap(hvp)(xs["x"], xs["v"]), rtol=1e-4, atol=1e-5)


@four
def test_one_program_per_chunk_and_nothing_compiled_again():
    """Each chunk is dispatched as compiled programs, the node's Python traced once, not run
    per item; a second sweep of the same shapes compiles nothing and traces nothing."""
    log = TraceLog()
    graph = dag(log)
    xs = data()
    compiles = []

    def heard(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(heard)
    try:
        with sharded():
            first = daskdag.sweep_grads(graph, {"x": xs["x"], "w": xs["w"]}, "S",
                                        batched=["x"])
            traced, compiled = len(log), len(compiles)
            again = daskdag.sweep_grads(graph, {"x": xs["x"], "w": xs["w"]}, "S",
                                        batched=["x"])
    finally:
        jax.monitoring.unregister_event_duration_listener(heard)
    assert 0 < traced <= 3  # (a trace for shapes, one for the fused program), never N
    assert compiled > 0
    assert len(log) == traced and len(compiles) == compiled, (log, compiles)
    np.testing.assert_array_equal(np.asarray(first.grad["x"]), np.asarray(again.grad["x"]))


@four
def test_chunks_as_large_as_memory_allows(monkeypatch):
    """Memory for about a third of the items: three chunks of equal size, each a multiple of
    the devices' count (the last padded), every item right."""
    xs = data()
    seen = []
    real = devices.item_bytes
    monkeypatch.setattr(devices, "item_bytes", lambda sweep: seen.append(real(sweep)) or seen[-1])
    with sharded():
        one = daskdag.sweep_grads(dag(), {"x": xs["x"], "w": xs["w"]}, "S", batched=["x"],
                                  wrt=["x", "w"])
        working, results = seen[-1]
        assert working > 8 * 4 * 2 and results >= 8 * 4 * 2  # (x and its gradient, and w's)
        budget = N * results + working * devices.DEPTH * (N // 3 + 8)
        monkeypatch.setattr(devices, "free_bytes", lambda on: budget / devices.FRACTION)
        res = daskdag.sweep_grads(dag(), {"x": xs["x"], "w": xs["w"]}, "S", batched=["x"],
                                  wrt=["x", "w"])
    assert one.info.chunks == 1
    assert res.info.chunks == 3
    value, (gx, gw) = jax.vmap(jax.value_and_grad(whole, (0, 1)), (0, None))(xs["x"], xs["w"])
    on_devices(res.grad["x"])
    assert_tree_close(res.value, value, rtol=1e-5)
    assert_tree_close(res.grad["x"], gx, rtol=1e-5)
    assert_tree_close(res.grad["w"], gw, rtol=1e-5)


@four
def test_given_chunk_size_and_two_devices():
    xs = data()
    with sharded(count=2):
        res = daskdag.sweep_grads(dag(), {"x": xs["x"], "w": xs["w"]}, "S", batched=["x"],
                                  chunk_size=300)
    assert res.info.chunks == 4 and "2 cpu devices" in res.info.where
    on_devices(res.grad["x"], count=2)
    assert_tree_close(res.grad["x"], jax.vmap(jax.grad(whole), (0, None))(xs["x"], xs["w"]),
                      rtol=1e-5)


@four
@pytest.mark.timeout(120)
@pytest.mark.parametrize("results", ["device", "host"])
def test_durable_sweep_sharded_equals_the_plain_one(tmp_path, results):
    xs = data()
    args = (dag(), {"x": xs["x"], "w": xs["w"]}, "S")
    plain = daskdag.sweep_grads(*args, batched=["x"], wrt=["x", "w"],
                                store=str(tmp_path / "plain"))
    with sharded(results):
        stored = daskdag.sweep_grads(*args, batched=["x"], wrt=["x", "w"],
                                     store=str(tmp_path / "sharded"))
        read = daskdag.sweep_grads(*args, batched=["x"], wrt=["x", "w"],
                                   store=str(tmp_path / "sharded"))
    assert "4 cpu devices" in stored.info.where and stored.info.chunks == 1
    assert read.info.chunks == 0  # (all of it read from the store)
    assert isinstance(stored.grad["x"], jax.Array if results == "device" else np.ndarray)
    for res in (stored, read):
        assert_tree_close(jax.tree.map(np.asarray, (res.value, res.grad)),
                          (plain.value, plain.grad), rtol=1e-6)
    import zarr
    group = zarr.open_group(str(tmp_path / "sharded"), mode="r")
    np.testing.assert_array_equal(group["grads/S/x/0"][:], np.asarray(stored.grad["x"]))


@four
def test_failed_chunk_items_named_and_their_rows_nan():
    def fails(a):
        raise ValueError("no")

    bad = {**dag(), "S": Node(fails, ["A"], vmap=True)}
    xs = data(n=6)
    with sharded():
        res = daskdag.sweep_grads(bad, {"x": xs["x"], "w": xs["w"]}, "S", batched=["x"],
                                  errors="collect")
    assert sorted(res.failed) == list(range(6))
    assert isinstance(res.grad["x"], jax.Array) and res.grad["x"].shape == (6, 8)
    assert np.isnan(np.asarray(res.grad["x"])).all()


@four
def test_settings_refused_naming_what_there_is():
    xs = data(n=8)
    with dask.config.set({"daskdag.sweep-devices": 5}), \
            pytest.raises(daskdag.DAGError, match=r"sweep-devices is 5, but this process has 4 "
                                                  r"cpu devices: \[CpuDevice"):
        daskdag.sweep_grads(dag(), {"x": xs["x"], "w": xs["w"]}, "S", batched=["x"])
    with dask.config.set({"daskdag.sweep-results": "gpu"}), \
            pytest.raises(daskdag.DAGError, match="sweep-results is 'auto', 'device' or 'host', "
                                                  "not 'gpu'"):
        daskdag.sweep_grads(dag(), {"x": xs["x"], "w": xs["w"]}, "S", batched=["x"])


def test_default_on_cpu_is_unchanged():
    """On CPU, ``auto``: chunks sized for threads, NumPy results, as before."""
    assert jax.default_backend() == "cpu"
    xs = data()
    res = daskdag.sweep_grads(dag(), {"x": xs["x"], "w": xs["w"]}, "S", batched=["x"])
    assert type(res.grad["x"]) is np.ndarray and type(res.value) is np.ndarray
    assert res.info.where == "this process (threads)"
    assert res.info.chunks >= 1
    assert_tree_close(res.grad["x"], jax.vmap(jax.grad(whole), (0, None))(xs["x"], xs["w"]),
                      rtol=1e-5)


def test_item_by_item_sweeps_stay_on_threads():
    """A sweep with a node that carries items and is not vmap=True is not sharded, whatever
    the setting; ``device`` results still come as jax.Arrays."""
    xs = data(n=12)
    by_item = {**dag(), "A": Node(encode, ["x", "w"])}
    with sharded("device"):
        res = daskdag.sweep_grads(by_item, {"x": xs["x"], "w": xs["w"]}, "S", batched=["x"])
    assert res.info.where == "this process (threads)"
    assert isinstance(res.grad["x"], jax.Array)
    assert_tree_close(res.grad["x"], jax.vmap(jax.grad(whole), (0, None))(xs["x"], xs["w"]),
                      rtol=1e-5)

