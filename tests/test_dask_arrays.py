"""Sweeps over dask arrays (daskdag.arrays): lazy dask arrays of values and gradients, on the
input's item chunks, streamed from and to storage."""

import functools
import os
import threading
import time

import dask
import dask.array as da
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed import Client

import daskdag
from daskdag import DAGError, NodeError
from .support.clusters import local_client
from .support.numbers import assert_tree_close

CHUNKS = (5, 5, 1, 5)  # uneven, N = 16


class Calls:
    """Counts the items a node function computes, with a ``jax.debug.callback``: it runs when
    the function runs on data, once per item under ``vmap``, and not when ``jax.eval_shape``
    traces the function to find the result shapes (no computation)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def hit(self):
        self.calls += 1

    def __call__(self, *args):
        jax.debug.callback(self.hit)
        return self.fn(*args)


def encode(x, w):
    return jnp.tanh(x * w[:, 0]) @ w


def energy(h, x):
    return jnp.sum(h ** 2) + jnp.sum(jnp.sin(x))


def spread(h):
    return jnp.sum(jnp.cos(h))


@functools.cache
def _dag_of(vmap: bool):
    fns = {"H": Calls(encode), "E": Calls(energy), "S": Calls(spread)}
    dag = {"H": daskdag.Node(fns["H"], ["x", "w"], vmap=vmap),
           "E": daskdag.Node(fns["E"], ["H", "x"], vmap=vmap),
           "S": (fns["S"], ["H"])}  # item by item, either way
    return dag, fns


def dag_of(vmap: bool):
    """The DAG, its counters at zero. The same functions in every test: JAX compiles for each
    function, so tests share the compiled programs."""
    dag, fns = _dag_of(vmap)
    for f in fns.values():
        f.calls = 0
    return dag, fns


def data(n=16, d=5):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, d)).astype(np.float32),
            rng.normal(size=(d, 3)).astype(np.float32))


def expected(xs, w):
    """jax.vmap(jax.value_and_grad) of the composed functions, over x, with w shared."""
    out = {}
    for name, f in [("E", lambda x, w: energy(encode(x, w), x)), ("S", lambda x, w: spread(encode(x, w)))]:
        out[name] = jax.vmap(jax.value_and_grad(f, (0, 1)), (0, None))(xs, w)
    return out


@pytest.mark.parametrize("vmap", [False, True])
def test_lazy_and_equal_to_jax_and_the_numpy_sweep(vmap):
    dag, fns = dag_of(vmap)
    xs, w = data()
    x = da.from_array(xs, chunks=(CHUNKS, 5))
    res = daskdag.sweep_grads(dag, {"x": x, "w": w}, ["E", "S"], batched=["x"], wrt=["x", "w"])
    assert all(f.calls == 0 for f in fns.values())  # nothing computed yet
    for r in res.values():
        assert r.failed == {}
        assert isinstance(r.value, da.Array) and r.value.chunks == (CHUNKS,)
        assert r.value.dtype == np.float32
        assert r.grad["x"].chunks == (CHUNKS, (5,))
        assert r.grad["w"].chunks == (CHUNKS, (5,), (3,))  # the shared w: one gradient per item
    (got,) = dask.compute(res, scheduler="threads")
    jax.effects_barrier()
    assert fns["H"].calls == (len(CHUNKS) if vmap else 16)  # each item once: per block, vmapped
    numpy_sweep = daskdag.sweep_grads(dag, {"x": xs, "w": w}, ["E", "S"], batched=["x"],
                                      wrt=["x", "w"])
    for o, (value, (gx, gw)) in expected(xs, w).items():
        assert isinstance(got[o].value, np.ndarray)
        assert_tree_close(got[o].value, value, rtol=1e-5)
        assert_tree_close(got[o].grad, {"x": gx, "w": gw}, rtol=1e-5)
        assert_tree_close(got[o].value, numpy_sweep[o].value, rtol=1e-6)
        assert_tree_close(got[o].grad, numpy_sweep[o].grad, rtol=1e-6)


def test_composes_with_other_dask_expressions():
    dag, fns = dag_of(False)
    xs, w = data()
    x = da.from_array(xs, chunks=(CHUNKS, 5))
    res = daskdag.sweep_grads(dag, {"x": x, "w": w}, "E", batched=["x"])
    total, other, grad = dask.compute(res.value.sum(), (x ** 2).sum(axis=1), res.grad["x"][3:9])
    value, (gx, _) = jax.vmap(jax.value_and_grad(lambda x, w: energy(encode(x, w), x), (0, 1)),
                              (0, None))(xs, w)
    np.testing.assert_allclose(total, np.sum(value), rtol=1e-5)
    np.testing.assert_allclose(other, (xs ** 2).sum(axis=1), rtol=1e-6)
    np.testing.assert_allclose(grad, gx[3:9], rtol=1e-5)
    jax.effects_barrier()
    assert fns["H"].calls == 16  # each item once, for all three


def test_pytree_inputs_are_aligned_on_the_first_arrays_item_chunks():
    """A dict input of a dask array, another chunked differently and along a second axis, and a
    NumPy array: rechunked to the first's item chunks; chunk_size rechunks them all."""
    xs, w = data()
    b = np.linspace(0, 1, 16 * 2, dtype=np.float32).reshape(16, 2)
    c = np.arange(16, dtype=np.float32)
    def f(p):
        return energy(encode(p["a"], w), p["a"]) * jnp.sum(p["b"]) + p["c"]

    dag = {"E": daskdag.Node(f, ["p"], vmap=True)}
    # (leaves in order a, b, c: a's item chunks are the ones)
    p = {"a": da.from_array(xs, chunks=(CHUNKS, 5)), "b": da.from_array(b, chunks=(8, 1)), "c": c}
    value, grad = jax.vmap(jax.value_and_grad(f))({"a": xs, "b": b, "c": c})
    res = daskdag.sweep_grads(dag, p, "E")
    assert res.value.chunks == (CHUNKS,) and res.grad["b"].chunks == (CHUNKS, (2,))
    assert_tree_close(dask.compute(res.value, res.grad), (value, grad), rtol=1e-5)
    res = daskdag.sweep_grads(dag, p, "E", chunk_size=6)
    assert res.value.chunks == ((6, 6, 4),) and res.grad["c"].chunks == ((6, 6, 4),)
    assert_tree_close(dask.compute(res.value, res.grad), (value, grad), rtol=1e-5)


def test_a_failing_item_raises_its_node_error_at_compute_time():
    def fragile(x, k):  # k, an integer, is held constant: concrete, but in jax.eval_shape
        if not isinstance(k, jax.core.Tracer) and k == 9:
            raise ValueError("item 9 fails")
        return jnp.sum(x ** 2)

    xs, _ = data()
    chunks = (CHUNKS,)
    res = daskdag.sweep_grads({"E": (fragile, ["x", "k"])},
                              {"x": da.from_array(xs, chunks=(chunks[0], 5)),
                               "k": da.arange(16, chunks=chunks)}, "E")
    with pytest.raises(NodeError, match="item 9 fails") as e:
        res.grad["x"].compute()
    assert e.value.item == 9 and e.value.node == "E"
    # The blocks without item 9 compute.
    np.testing.assert_allclose(res.value[:5].compute(), np.sum(xs[:5] ** 2, axis=1), rtol=1e-6)


def test_a_block_with_a_failing_item_runs_each_of_its_items_once():
    """The failing item's block keeps going past it rather than running its items again one by
    one to find it: each item's node runs once, and the error names item 9."""
    ran = []

    def fragile(x, k):
        if not isinstance(k, jax.core.Tracer):  # (jax.eval_shape traces it once: not counted)
            ran.append(int(k))
            if k == 9:
                raise ValueError("item 9 fails")
        return jnp.sum(x ** 2)

    xs, _ = data()
    res = daskdag.sweep_grads({"E": (fragile, ["x", "k"])},
                              {"x": da.from_array(xs, chunks=(CHUNKS, 5)),
                               "k": da.arange(16, chunks=(CHUNKS,))}, "E")
    with pytest.raises(NodeError, match="item 9 fails") as e:
        res.value.compute(scheduler="sync")
    assert e.value.item == 9
    block = next(range(a, a + n) for a, n in zip(np.cumsum((0,) + CHUNKS), CHUNKS)
                 if a <= 9 < a + n)
    assert sorted(i for i in ran if i in block) == list(block)  # each once, 9 too


def test_bad_inputs():
    dag, _ = dag_of(False)
    xs, w = data()
    x = da.from_array(xs, chunks=(CHUNKS, 5))
    with pytest.raises(DAGError, match=r"disagree on the number of items: 'x' has 16, 'b' has 10"):
        daskdag.sweep_grads({"E": (lambda x, b: jnp.sum(x) + jnp.sum(b), ["x", "b"])},
                            {"x": x, "b": da.zeros((10, 2), chunks=5)}, "E")
    with pytest.raises(DAGError, match="errors='collect' is not supported"):
        daskdag.sweep_grads(dag, {"x": x, "w": w}, "E", batched=["x"], errors="collect")
    with pytest.raises(DAGError, match="progress=True is not supported"):
        daskdag.sweep_grads(dag, {"x": x, "w": w}, "E", batched=["x"], progress=True)
    with pytest.raises(DAGError, match="chunk sizes are unknown"):
        daskdag.sweep_grads(dag, {"x": x[x[:, 0] > 0], "w": w}, "E", batched=["x"])

    def branchy(x):
        return jnp.sum(x) if float(x[0]) > 0 else -jnp.sum(x)  # no shape without data

    with pytest.raises(DAGError, match="output 'E' cannot be found by tracing"):
        daskdag.sweep_grads({"E": (branchy, ["x"])}, x, "E")


# -- streaming through Zarr on a process cluster --------------------------------------------------

ITEMS, ITEM, BLOCK = 2048, 2 ** 18, 32  # 2048 items of 1 MiB (float32), 32 per block (32 MiB)
BUDGET = 500 * 2 ** 20  # peak growth of any process's RSS while 2 GiB of items pass through


class Peaks(threading.Thread):
    """Polls the resident memory of processes every 50 ms and keeps each one's peak."""

    def __init__(self, pids):
        import psutil

        super().__init__(daemon=True)
        self.procs = {pid: psutil.Process(pid) for pid in pids}
        self.peak = {pid: p.memory_info().rss for pid, p in self.procs.items()}
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(0.05):
            for pid, p in self.procs.items():
                self.peak[pid] = max(self.peak[pid], p.memory_info().rss)

    def stop(self):
        self.done.set()
        self.join()
        return self.peak


def rss(pids) -> dict:
    import psutil

    return {pid: psutil.Process(pid).memory_info().rss for pid in pids}


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_zarr_to_zarr_streams_with_bounded_memory(tmp_path):
    pytest.importorskip("zarr")
    import zarr

    def generate(block_info=None):  # deterministic, from the block's place alone
        (lo, hi), _ = block_info[None]["array-location"]
        rng = np.random.default_rng(lo)
        return rng.random((hi - lo, ITEM), dtype=np.float32) * 4 - 2

    def items(n):
        return da.map_blocks(generate, chunks=((BLOCK,) * (n // BLOCK), (ITEM,)), dtype=np.float32,
                             meta=np.empty((0, 0), np.float32))

    w = np.linspace(-1, 1, ITEM, dtype=np.float32)
    dag = {"A": daskdag.Node(lambda x, w: jnp.tanh(x) * w, ["x", "w"], vmap=True),
           "S": daskdag.Node(lambda a: jnp.sum(a), ["A"], vmap=True)}
    path = str(tmp_path / "sweep.zarr")
    with local_client(client_options={"set_as_default": True}):  # the default client
        workers = client_pids = None
        res = daskdag.sweep_grads(dag, {"x": items(2 * BLOCK), "w": w}, "S", batched=["x"])
        res.grad["x"].sum().compute()  # warm up: JAX imported and traced in each worker
        workers = list(Client.current().run(os.getpid).values())
        client_pids = [os.getpid()]
        base = rss(workers + client_pids)
        peaks = Peaks(workers + client_pids)
        peaks.start()
        start = time.perf_counter()
        res = daskdag.sweep_grads(dag, {"x": items(ITEMS), "w": w}, "S", batched=["x"])
        assert res.grad["x"].chunks[0] == (BLOCK,) * (ITEMS // BLOCK)
        stores = [da.to_zarr(res.value, path, component="value", compute=False),
                  da.to_zarr(res.grad["x"], path, component="grad", compressors=None, compute=False)]
        dask.compute(*stores)  # value and gradient together: each block runs once
        took = time.perf_counter() - start
        peak = peaks.stop()
    growth = {pid: peak[pid] - base[pid] for pid in peak}
    print(f"\n2 GiB through in {took:.1f} s; peak RSS growth (MB): client "
          f"{growth[client_pids[0]] / 2 ** 20:.0f}, workers "
          f"{[round(growth[p] / 2 ** 20) for p in workers]}")
    assert all(g < BUDGET for g in growth.values()), growth

    stored = zarr.open_group(path, mode="r")
    assert stored["value"].shape == (ITEMS,) and stored["grad"].shape == (ITEMS, ITEM)
    f = jax.vmap(jax.value_and_grad(lambda x: jnp.sum(jnp.tanh(x) * w)))
    for b in (0, 37, ITEMS // BLOCK - 1):
        lo, hi = b * BLOCK, (b + 1) * BLOCK
        x = generate({None: {"array-location": [(lo, hi), (0, ITEM)]}})
        value, grad = f(x)
        np.testing.assert_allclose(stored["value"][lo:hi], value, rtol=1e-4)
        np.testing.assert_allclose(stored["grad"][lo:hi], grad, rtol=1e-5, atol=1e-6)
