"""Durable sweeps (``sweep_grads(store=...)``, :mod:`daskdag.sweeps.store`): results on disk as
chunks finish, a resume that computes only what is missing and returns what an uninterrupted
sweep returns bit for bit, a store that refuses another sweep, and clients killed mid-sweep.

Items are counted at the node: the node appends a line to a file for each item it computes
(a file, not a Python counter, so that workers' counts show, and so that the node's function,
whose content a store records, stays the same between calls).
"""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import dask.array as da
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag

from .support.clusters import local_client
from .support.disks import small_tmpfs

N, CHUNK = 60, 8
XS = np.random.default_rng(0).uniform(0.1, 1.5, (N, 4)).astype(np.float32)
W = jnp.linspace(0.5, 1.5, 4)

DAG_MODULE = '''
import os, time
import jax.numpy as jnp

COUNT = {count!r}
PAUSE = {pause!r}
FAIL = {fail!r}
FAILING_NOW = {failing_now!r}  # (a file of more items that fail, read at each call)


def h(x, w, i):
    time.sleep(PAUSE)
    with open(COUNT, "a") as f:
        f.write(str(int(i)) + "\\n")
    if int(i) in FAIL or (os.path.exists(FAILING_NOW)
                          and str(int(i)) in open(FAILING_NOW).read().split()):
        raise ValueError("a failing item")
    return jnp.tanh(x * w)


def loss(h):
    return jnp.sum(h ** 2)


DAG = {{"h": (h, ["x", "w", "i"]), "loss": (loss, ["h"])}}
'''


def dag_module(tmp_path: Path, pause: float = 0.0, fail: tuple = ()):
    """The sweep's DAG in a module of its own (as users write it), its node counting items into
    ``tmp_path/count`` (by index, ``i``) and failing on the items ``fail``."""
    name = f"sweepdag_{abs(hash((str(tmp_path), pause, fail)))}"
    (tmp_path / f"{name}.py").write_text(DAG_MODULE.format(
        count=str(tmp_path / "count"), pause=pause, fail=fail,
        failing_now=str(tmp_path / "failing_now")))
    sys.path.insert(0, str(tmp_path))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(tmp_path))


def counted(tmp_path: Path) -> list[int]:
    """Each item computed so far, by its index."""
    f = tmp_path / "count"
    return [int(v) for v in f.read_text().split()] if f.exists() else []


def inputs(xs=XS, w=W):
    return {"x": xs, "w": w, "i": np.arange(len(xs))}


def sweep(dag, store, xs=XS, **kw):
    return daskdag.sweep_grads(dag, inputs(xs), "loss", batched=["x", "i"], store=store,
                               **{"chunk_size": CHUNK, **kw})


def complete(store: Path) -> list[str]:
    """The store's complete pieces, ``"start-stop"`` (its ``done`` groups)."""
    done = store / "done"
    return sorted(p.name for p in done.iterdir() if (p / "zarr.json").exists()) \
        if done.exists() else []


def items_of(pieces) -> set[int]:
    return {i for name in pieces for i in range(*map(int, name.split("-")))}


def jax_loss(x, w):
    """The DAG's ``loss(h(x, w, i))`` for one item, composed in plain JAX."""
    return jnp.sum(jnp.tanh(x * w) ** 2)


def assert_jax(value, grad, xs=XS, w=W, failed=(), f=jax_loss):
    """``value`` and ``grad`` (in x), per item, are JAX's own numbers for ``f``:
    ``jax.vmap(jax.value_and_grad(f))`` over the items, ``w`` shared, to float32 rounding.
    The ``failed`` items' rows are NaN (what a sweep returns for them)."""
    ref_value, ref_grad = jax.vmap(jax.value_and_grad(f), in_axes=(0, None))(
        jnp.asarray(xs), jnp.asarray(w))
    value, grad = np.asarray(value), np.asarray(grad)
    assert value.shape == (len(xs),) and grad.shape == np.shape(xs)
    bad = sorted(failed)
    ok = np.setdiff1d(np.arange(len(xs)), bad)
    np.testing.assert_allclose(value[ok], np.asarray(ref_value)[ok], rtol=1e-6, atol=0)
    np.testing.assert_allclose(grad[ok], np.asarray(ref_grad)[ok], rtol=1e-6, atol=1e-7)
    assert np.isnan(value[bad]).all() and np.isnan(grad[bad]).all()


def assert_same(res, ref, xs=XS):
    """Bit for bit, and both JAX's numbers for the items ``xs``."""
    np.testing.assert_array_equal(np.asarray(res.value), np.asarray(ref.value))
    np.testing.assert_array_equal(np.asarray(res.grad["x"]), np.asarray(ref.grad["x"]))
    assert sorted(res.failed) == sorted(ref.failed)
    assert_jax(res.value, res.grad["x"], xs, failed=res.failed)


def test_a_stored_sweep_is_the_sweep_and_resumes_computing_nothing(tmp_path):
    m = dag_module(tmp_path)
    ref = sweep(m.DAG, None)
    before = len(counted(tmp_path))
    first = sweep(m.DAG, tmp_path / "store")
    assert len(counted(tmp_path)) - before == N
    assert_same(first, ref)
    assert len(complete(tmp_path / "store")) == -(-N // CHUNK)
    again = sweep(m.DAG, tmp_path / "store", chunk_size=None)  # (the store's chunk size)
    assert len(counted(tmp_path)) - before == N  # nothing computed again
    assert_same(again, ref)


def test_lost_or_damaged_chunks_are_computed_again_never_returned(tmp_path):
    m = dag_module(tmp_path)
    ref = sweep(m.DAG, None)
    store = tmp_path / "store"
    sweep(m.DAG, store)
    pieces = complete(store)
    import shutil
    shutil.rmtree(store / "done" / pieces[1])  # a crash before it was marked complete
    grads = store / "grads" / "loss" / "x" / "0" / "c"
    with open(grads / "3" / "0", "r+b") as f:  # truncated
        f.truncate(20)
    values = store / "values" / "loss" / "0" / "c"
    body = bytearray((values / "5").read_bytes())  # one byte flipped
    body[len(body) // 2] ^= 0xFF
    (values / "5").write_bytes(bytes(body))
    (values / "6").unlink()  # lost
    before = counted(tmp_path)
    assert_same(sweep(m.DAG, store), ref)
    again = counted(tmp_path)[len(before):]
    assert sorted(again) == [i for k in (1, 3, 5, 6) for i in range(k * CHUNK, (k + 1) * CHUNK)]


def files(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in store.rglob("*") if p.is_file()}


@pytest.mark.parametrize("change, what", [
    ("inputs", "the inputs of items 8 to 15"),
    ("shared", "the shared inputs ['w'] differ"),
    ("dag", "the DAG's nodes ['loss'] differ"),
    ("outputs", "outputs was"),
    ("chunk_size", "chunk_size was 8, is now 5"),
    ("x64", "JAX's jax_enable_x64 was False, is now True"),
    ("precision", "JAX's jax_default_matmul_precision was None, is now 'highest'"),
])
def test_a_store_refuses_another_sweep_naming_what_changed(tmp_path, change, what):
    m = dag_module(tmp_path)
    store = tmp_path / "store"
    sweep(m.DAG, store)
    listing = files(store)
    xs, dag, kw = XS.copy(), m.DAG, {}
    if change == "inputs":
        xs[9, 2] += 1.0
    elif change == "dag":
        dag = {**m.DAG, "loss": (lambda h: jnp.sum(h ** 3), ["h"])}
    elif change == "chunk_size":
        kw["chunk_size"] = 5
    if change == "shared":
        call = lambda: daskdag.sweep_grads(dag, inputs(xs, W * 2), "loss", batched=["x", "i"],
                                           store=store)
    elif change == "outputs":
        call = lambda: daskdag.sweep_grads(dag, inputs(xs), ["loss", "h"], batched=["x", "i"],
                                           cotangents={"h": jnp.ones(4)}, store=store)
    else:
        call = lambda: sweep(dag, store, xs, **kw)
    if change in ("x64", "precision"):
        import jax
        with jax.enable_x64(True) if change == "x64" else jax.default_matmul_precision("highest"):
            with pytest.raises(daskdag.StoreError, match=what.replace("[", r"\[").replace("]", r"\]")):
                call()
    else:
        with pytest.raises(daskdag.StoreError, match=what.replace("[", r"\[").replace("]", r"\]")):
            call()
    assert files(store) == listing  # nothing changed


@pytest.mark.parametrize("kind", ["folder", "zarr", "zarr object", "file"])
def test_a_location_that_holds_something_else_is_refused_and_left_as_it_was(tmp_path, kind):
    """As ``zarr.open_group(..., mode="w-")`` refuses a location that holds something: a
    folder of the user's files, a Zarr hierarchy that is not a sweep's store (in a folder, or a
    Zarr store object), a file. Nothing is computed, nothing written."""
    import zarr
    import zarr.storage

    m = dag_module(tmp_path)
    where = tmp_path / "data"
    if kind == "folder":
        (where / "runs").mkdir(parents=True)
        (where / "results.csv").write_text("1,2\n")
        what = r"is not empty, and is not a daskdag sweep's store: it holds results.csv, runs\."
    elif kind == "file":
        where.write_text("not a folder")
        what = "is a file, not a directory"
    else:
        held: dict = {}  # (a Zarr store object's keys)
        location = where if kind == "zarr" else zarr.storage.MemoryStore(store_dict=held)
        group = zarr.open_group(location, mode="w-")
        group.attrs["owner"] = "another project"
        group.create_array("temperature", shape=(3,), dtype="f4")[:] = 1.0
        what = (r"is a Zarr group that is not a daskdag sweep's store \(its zarr.json has no "
                r"'daskdag' attribute\): it holds temperature, zarr.json\.")
        if kind == "zarr object":
            where = location

    def content():
        if kind == "zarr object":
            return {k: v.to_bytes() for k, v in held.items()}
        return where.read_text() if kind == "file" else files(where)

    before = content()
    with pytest.raises(daskdag.StoreError, match=what + ".*Nothing was written there" if
                       kind != "file" else what):
        sweep(m.DAG, where)
    assert content() == before and counted(tmp_path) == []


@pytest.mark.subprocess
def test_a_store_in_use_refuses_a_second_sweep(tmp_path):
    m = dag_module(tmp_path)
    store = tmp_path / "store"
    store.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, time
        fd = os.open({str(store)!r}, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(daskdag.StoreError, match="in use by another sweep"):
            sweep(m.DAG, store)
        assert counted(tmp_path) == []
    finally:
        holder.kill()
        holder.wait()
    res = sweep(m.DAG, store)  # free again
    assert len(counted(tmp_path)) == N
    assert_jax(res.value, res.grad["x"])


def test_failed_items_are_kept_and_returned_on_resume(tmp_path):
    m = dag_module(tmp_path, fail=(3, 17))
    ref = sweep(m.DAG, None, errors="collect")
    assert sorted(ref.failed) == [3, 17]
    store = tmp_path / "store"
    first = sweep(m.DAG, store, errors="collect")
    before = len(counted(tmp_path))
    again = sweep(m.DAG, store, errors="collect")
    assert len(counted(tmp_path)) == before
    for res in (first, again):
        assert_same(res, ref)
        assert res.failed[17].node == "h" and "a failing item" in str(res.failed[17])
        assert np.isnan(np.asarray(res.value)[17])


def test_after_a_raise_the_store_keeps_what_succeeded_and_a_resume_computes_the_rest(tmp_path):
    """errors='raise', item 5 failing (in the chunk of items 0 to 7): the store keeps the items
    that succeeded, the failed one's chunk-mates too, in pieces around item 5; once item 5
    succeeds, the same call computes item 5 and what was never computed, nothing else. Pieces
    never overlap, and every item is computed once."""
    m = dag_module(tmp_path)
    ref = sweep(m.DAG, None)
    (tmp_path / "count").unlink()
    (tmp_path / "failing_now").write_text("5")
    store = tmp_path / "store"
    with pytest.raises(daskdag.NodeError, match="item 5: node 'h'"):
        sweep(m.DAG, store)
    kept = items_of(complete(store))
    assert set(range(8)) - {5} <= kept and 5 not in kept
    first = counted(tmp_path)
    (tmp_path / "failing_now").unlink()
    assert_same(sweep(m.DAG, store), ref)
    again = counted(tmp_path)[len(first):]
    assert sorted(again) == sorted(set(range(N)) - kept)
    assert sorted(first + again) == sorted([*range(N), 5])  # (item 5: once failing, once not)
    pieces = sorted(tuple(map(int, p.split("-"))) for p in complete(store))
    assert all(a[1] <= b[0] for a, b in zip(pieces, pieces[1:])), pieces  # no overlap
    assert items_of(complete(store)) == set(range(N))


def test_without_a_chunk_size_a_store_is_written_in_pieces_sized_by_time(tmp_path, monkeypatch):
    """No chunk_size: the first pieces hold one item, the next about PIECE_SECONDS of work (here
    0.1 s, items of 0.02 s), none crossing a store chunk; every item computed once, and the
    numbers bit for bit those of whole chunks."""
    from daskdag.sweeps import sweep as sweeps

    monkeypatch.setattr(sweeps, "PIECE_SECONDS", 0.1)
    m = dag_module(tmp_path, pause=0.02)
    ref = sweep(m.DAG, None)
    (tmp_path / "count").unlink()
    store = tmp_path / "store"
    assert_same(sweep(m.DAG, store, chunk_size=None), ref)
    assert sorted(counted(tmp_path)) == list(range(N))
    pieces = sorted(tuple(map(int, p.split("-"))) for p in complete(store))
    chunk = json.loads((store / "zarr.json").read_text())["attributes"]["daskdag"]["chunk_size"]
    assert pieces[0] == (0, 1) and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert pieces[-1][1] == N and all(a // chunk == (b - 1) // chunk for a, b in pieces)
    assert len(pieces) > -(-N // chunk)  # (smaller than chunks)
    assert_same(sweep(m.DAG, store, chunk_size=None), ref)  # resumed: nothing computed
    assert len(counted(tmp_path)) == N


def dask_inputs(xs=XS, chunks=CHUNK):
    return {"x": da.from_array(xs, chunks=(chunks, -1)), "w": W,
            "i": da.from_array(np.arange(len(xs)), chunks=chunks)}


def test_dask_array_items_go_through_the_store_and_come_back_lazily(tmp_path):
    m = dag_module(tmp_path)
    ref = sweep(m.DAG, None)
    store = tmp_path / "store"
    call = lambda where, **kw: daskdag.sweep_grads(m.DAG, dask_inputs(), "loss",
                                                   batched=["x", "i"], store=where, **kw)
    lazy = call(store)
    assert isinstance(lazy.value, da.Array) and isinstance(lazy.grad["x"], da.Array)
    assert_same(lazy, ref)
    assert len(complete(store)) == -(-N // CHUNK)  # (the dask arrays' chunks)
    before = len(counted(tmp_path))
    assert before == 2 * N  # (the reference, then the stored sweep)
    assert_same(call(store), ref)
    assert len(counted(tmp_path)) == before  # resumed: nothing computed again
    eager = call(daskdag.SweepStore(store, lazy=False))
    assert isinstance(eager.value, np.ndarray)
    assert_same(eager, ref)
    # NumPy items, results left in the store
    lazy_numpy = sweep(m.DAG, daskdag.SweepStore(tmp_path / "other", lazy=True))
    assert isinstance(lazy_numpy.grad["x"], da.Array)
    assert_same(lazy_numpy, ref)


def test_a_value_shared_by_every_item_and_failed_items_read_back_as_in_memory(tmp_path):
    """An output of the shared inputs alone (the same for every item), and items that failed:
    resumed, in memory and lazily, they are what a sweep without a store returns, even where
    the store held other numbers for those rows before (``changed_items="recompute"``)."""
    m = dag_module(tmp_path, fail=(9,))
    dag = {**m.DAG, "reg": (lambda w: jnp.sum(w ** 2), ["w"])}
    call = lambda where, xs=XS: daskdag.sweep_grads(
        dag, inputs(xs), ["loss", "reg"], batched=["x", "i"], wrt=["x"], store=where,
        chunk_size=CHUNK, errors="collect")
    ref = call(None)
    store = tmp_path / "store"
    call(store)
    for res in (call(store), call(daskdag.SweepStore(store, lazy=True))):
        for o in ("loss", "reg"):
            np.testing.assert_array_equal(np.asarray(res[o].value), np.asarray(ref[o].value))
            np.testing.assert_array_equal(np.asarray(res[o].grad["x"]), np.asarray(ref[o].grad["x"]))
        assert sorted(res["loss"].failed) == [9]
        assert_shared_jax(res, XS)
    # item 12 fails now, where the store held its numbers: they read as NaN, not as before
    (tmp_path / "failing_now").write_text("12")
    xs = XS.copy()
    xs[12] += 0.25
    ref = call(None, xs)
    lazy = call(daskdag.SweepStore(store, changed_items="recompute", lazy=True), xs)
    assert sorted(lazy["loss"].failed) == [9, 12] and np.isnan(np.asarray(lazy["loss"].value)[12])
    for res in (lazy, call(store, xs)):
        for o in ("loss", "reg"):
            np.testing.assert_array_equal(np.asarray(res[o].value), np.asarray(ref[o].value))
            np.testing.assert_array_equal(np.asarray(res[o].grad["x"]), np.asarray(ref[o].grad["x"]))
        assert_shared_jax(res, xs)


def assert_shared_jax(res, xs):
    """``loss`` and ``reg`` (of w alone: the same value for every item, no gradient in x) as
    JAX has them, the items that failed in h NaN in both."""
    for o, f in (("loss", jax_loss), ("reg", lambda x, w: jnp.sum(w ** 2))):
        assert_jax(res[o].value, res[o].grad["x"], xs, failed=res[o].failed, f=f)


@pytest.mark.parametrize("kind", ["MemoryStore", "FsspecStore"])
def test_a_zarr_store_holds_the_sweep_readable_by_zarr_one_sweep_at_a_time(tmp_path, kind):
    """Any Zarr store: Zarr's own in-memory store, and fsspec's (as over S3 or GCS, whose
    create-if-absent is not atomic) on its in-memory filesystem."""
    import uuid

    import zarr
    import zarr.storage

    from daskdag.durable.keys import Keys

    m = dag_module(tmp_path, fail=(5,))
    ref = sweep(m.DAG, None, errors="collect")
    where = zarr.storage.MemoryStore() if kind == "MemoryStore" else \
        zarr.storage.FsspecStore.from_url(f"memory://daskdag-test-{uuid.uuid4().hex}")
    assert_same(sweep(m.DAG, where, errors="collect"), ref)
    group = zarr.open_group(where, mode="r")
    np.testing.assert_array_equal(group["values/loss/0"][:], np.asarray(ref.value))
    np.testing.assert_array_equal(group["grads/loss/x/0"][:], np.asarray(ref.grad["x"]))
    assert group.attrs["daskdag"]["outputs"] == ["loss"]
    before = len(counted(tmp_path))
    again = sweep(m.DAG, where, errors="collect")
    assert_same(again, ref)
    assert len(counted(tmp_path)) == before and "a failing item" in str(again.failed[5])
    other = Keys(where, "the test's")
    other.hold()
    try:
        with pytest.raises(daskdag.StoreError, match="in use by another sweep"):
            sweep(m.DAG, where, errors="collect")
    finally:
        other.release()
    assert_same(sweep(m.DAG, where, errors="collect"), ref)
    # a lease its holder stopped renewing (a client killed) is taken over
    lapsed = Keys(where, "the test's")
    lapsed.LEASE = -1.0
    lapsed.hold()
    lapsed._stop.set()
    assert_same(sweep(m.DAG, where, errors="collect"), ref)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_on_a_cluster_the_store_resumes_what_is_missing(tmp_path):
    m = dag_module(tmp_path)
    ref = sweep(m.DAG, None)
    store = tmp_path / "store"
    with local_client(2) as client:
        first = sweep(m.DAG, store, client=client)
        assert_same(first, ref)
        import shutil
        for piece in complete(store)[2:4]:
            shutil.rmtree(store / "done" / piece)
        before = counted(tmp_path)
        again = sweep(m.DAG, store, client=client)
    assert_same(again, ref)
    recomputed = counted(tmp_path)[len(before):]
    assert sorted(recomputed) == list(range(2 * CHUNK, 4 * CHUNK))
    with local_client(2) as client:  # dask-array items, through the cluster into a store
        lazy = daskdag.sweep_grads(m.DAG, dask_inputs(), "loss", batched=["x", "i"],
                                   store=tmp_path / "lazy", client=client)
        assert isinstance(lazy.value, da.Array)
        assert_same(lazy, ref)
    # (a store made on a cluster resumes on threads, and the other way round)
    assert_same(sweep(m.DAG, store), ref)


RUNNER = '''
import sys
import numpy as np
import jax.numpy as jnp
import daskdag
sys.path.insert(0, {path!r})
import {module} as m
xs = np.load({xs!r})
res = daskdag.sweep_grads(m.DAG, {{"x": xs, "w": jnp.linspace(0.5, 1.5, 4),
                                  "i": np.arange(len(xs))}}, "loss",
                          batched=["x", "i"], chunk_size={chunk}, store={store!r})
np.savez({out!r}, value=np.asarray(res.value), grad=np.asarray(res.grad["x"]))
'''


@pytest.mark.timeout(300)
@pytest.mark.subprocess
def test_a_client_killed_mid_sweep_then_run_again(tmp_path):
    """SIGKILL at random moments into a sweep in another process; run again until it ends.
    The result is the uninterrupted sweep's, bit for bit, and no chunk complete when the client
    died is computed again."""
    m = dag_module(tmp_path, pause=0.02)
    items = 400
    xs = np.random.default_rng(1).uniform(0.1, 1.5, (items, 4)).astype(np.float32)
    np.save(tmp_path / "xs.npy", xs)
    store, out = tmp_path / "store", tmp_path / "out.npz"
    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(path=str(tmp_path), module=m.__name__, xs=str(tmp_path / "xs.npy"),
                                    chunk=CHUNK, store=str(store), out=str(out)))
    ref = daskdag.sweep_grads(m.DAG, inputs(xs), "loss", batched=["x", "i"], chunk_size=CHUNK)
    (tmp_path / "count").unlink()
    rng = random.Random(0)
    kills = 0
    for attempt in range(4):
        proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.DEVNULL)
        if attempt < 3:  # killed at a random moment of the sweep; the last run goes to the end
            target = len(counted(tmp_path)) + rng.randint(5, 120)
            deadline = time.monotonic() + 120
            while proc.poll() is None and len(counted(tmp_path)) < target \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            if proc.poll() is None:
                done_before = set(complete(store))
                seen = len(counted(tmp_path))
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills += 1
                # every chunk complete before the kill is still complete and is not computed again
                assert done_before <= set(complete(store))
                (tmp_path / f"complete-{attempt}").write_text("\n".join(sorted(done_before)))
                (tmp_path / f"seen-{attempt}").write_text(str(seen))
                continue
        assert proc.wait(timeout=240) == 0
        break
    assert kills >= 1, "no run was killed mid-sweep"
    assert any((tmp_path / f"complete-{a}").exists() and (tmp_path / f"complete-{a}").read_text()
               for a in range(3)), "no run was killed after a chunk was complete"
    got = np.load(out)
    np.testing.assert_array_equal(got["value"], np.asarray(ref.value))
    np.testing.assert_array_equal(got["grad"], np.asarray(ref.grad["x"]))
    assert_jax(got["value"], got["grad"], xs)
    # Every item computed; those of chunks complete at a kill not computed after it.
    computed = counted(tmp_path)
    assert set(computed) == set(range(items))
    for attempt in range(3):
        f = tmp_path / f"complete-{attempt}"
        if not f.exists():
            continue
        done_items = items_of(f.read_text().split())
        later = computed[int((tmp_path / f"seen-{attempt}").read_text()):]
        assert not done_items & set(later), "a chunk complete before the kill was computed again"


@pytest.mark.timeout(240)
@pytest.mark.subprocess
def test_the_command_line_resumes_from_its_store(tmp_path):
    m = dag_module(tmp_path)
    root = Path(__file__).resolve().parent.parent
    np.savez(tmp_path / "in.npz", x=XS, w=np.asarray(W), i=np.arange(N))
    target = f"{tmp_path / (m.__name__ + '.py')}:DAG"

    def cli(*more, inputs="in.npz", out="res.npz"):
        return subprocess.run(
            [sys.executable, "-m", "daskdag.cli", "sweep", target, "--inputs", inputs,
             "--batched", "x,i", "--outputs", "loss", "--chunk-size", str(CHUNK), "--quiet",
             "--store", str(tmp_path / "store"), "--out", out, *more],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"},
            capture_output=True, text=True, timeout=200)

    first = cli()
    assert first.returncode == 0, first.stderr
    assert len(counted(tmp_path)) == N
    second = cli(out="again.npz")
    assert second.returncode == 0, second.stderr
    assert len(counted(tmp_path)) == N  # resumed: nothing computed again
    a, b = np.load(tmp_path / "res.npz"), np.load(tmp_path / "again.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k])
    ref = sweep(m.DAG, None)
    np.testing.assert_array_equal(a["loss.value"], np.asarray(ref.value))
    np.testing.assert_array_equal(a["loss.grad.x"], np.asarray(ref.grad["x"]))
    assert_jax(a["loss.value"], a["loss.grad.x"])  # the CLI's numbers are JAX's
    changed = XS.copy()
    changed[2, 0] += 1.0
    np.savez(tmp_path / "changed.npz", x=changed, w=np.asarray(W), i=np.arange(N))
    refused = cli(inputs="changed.npz", out="no.npz")
    assert refused.returncode == 5 and "items 0 to 7" in refused.stderr, refused.stderr
    assert not (tmp_path / "no.npz").exists()


@pytest.mark.timeout(240)
@pytest.mark.subprocess
def test_the_command_line_interrupted_says_what_is_saved_and_resumes(tmp_path):
    """Ctrl-C (SIGINT) once the first piece is saved: exit 130, and the error line says how
    many items the store holds; the same command then computes the others alone."""
    m = dag_module(tmp_path, pause=0.1)
    root = Path(__file__).resolve().parent.parent
    np.savez(tmp_path / "in.npz", x=XS, w=np.asarray(W), i=np.arange(N))
    store = tmp_path / "store"
    # `python -m daskdag.cli`, with Ctrl-C's handler even where the test run ignores SIGINT
    command = [sys.executable, "-c", "import runpy, signal; signal.signal(signal.SIGINT, "
               "signal.default_int_handler); runpy.run_module('daskdag.cli', "
               "run_name='__main__', alter_sys=True)",
               "sweep", f"{tmp_path / (m.__name__ + '.py')}:DAG", "--inputs", "in.npz",
               "--batched", "x,i", "--outputs", "loss", "--quiet", "--store", str(store),
               "--out", "res.npz"]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_chunks(store, 1)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    saved = items_of(complete(store))
    assert proc.returncode == 130, err
    assert f"daskdag sweep: error: interrupted: {len(saved)} of {N} items saved in {store}; run " \
           f"the same call again to resume" in err, err
    assert 0 < len(saved) < N
    before = len(counted(tmp_path))
    again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=200)
    assert again.returncode == 0, again.stderr
    assert sorted(counted(tmp_path)[before:]) == sorted(set(range(N)) - saved)
    res = np.load(tmp_path / "res.npz")
    np.testing.assert_array_equal(res["loss.value"], np.asarray(sweep(m.DAG, None).value))
    assert_jax(res["loss.value"], res["loss.grad.x"])


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (where this machine lets the tests mount one)."""
    with small_tmpfs(tmp_path / "small_disk", "256k") as d:
        yield d


@pytest.mark.timeout(180)
@pytest.mark.subprocess
def test_a_full_disk_is_a_clear_error_and_what_was_written_stays_usable(tmp_path, small_disk):
    m = dag_module(tmp_path)
    big = np.random.default_rng(2).uniform(0.1, 1.5, (64, 2048)).astype(np.float32)
    w = jnp.linspace(0.5, 1.5, 2048)
    call = lambda store: daskdag.sweep_grads(
        m.DAG, {"x": big, "w": w, "i": np.arange(64)}, "loss", batched=["x", "i"], chunk_size=4,
        store=store)
    ref = call(None)
    store = small_disk / "store"
    with pytest.raises(daskdag.StoreError, match="is full .* complete and stay usable"):
        call(store)
    pieces = complete(store)
    assert 0 < len(pieces) < 16
    done_items = items_of(pieces)
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    before = len(counted(tmp_path))
    res = call(store)
    np.testing.assert_array_equal(np.asarray(res.value), np.asarray(ref.value))
    np.testing.assert_array_equal(np.asarray(res.grad["x"]), np.asarray(ref.grad["x"]))
    assert_jax(res.value, res.grad["x"], big, w)
    assert set(counted(tmp_path)[before:]) == set(range(64)) - done_items


def wait_for_chunks(store: Path, least: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(complete(store)) < least:
        assert time.monotonic() < deadline, f"fewer than {least} chunks complete in {timeout} s"
        time.sleep(0.02)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_the_scheduler_killed_mid_sweep_then_run_again_on_a_new_cluster(tmp_path):
    """The scheduler (``dask scheduler``, workers that cannot import the test's modules) SIGKILLed
    mid-sweep: the call says so (``ClusterError``) within ``daskdag.worker-wait`` (5 s here) and
    some slack, not distributed's 30 s connect timeout; the same call on a new cluster completes
    from the store, computing no chunk that was complete."""
    import dask
    from distributed import Client

    from .support.clusters import DaskCLI
    from .support.faults import bounded

    m = dag_module(tmp_path, pause=0.05)
    items = 160
    xs = np.random.default_rng(3).uniform(0.1, 1.5, (items, 4)).astype(np.float32)
    ref = sweep(m.DAG, None, xs)
    (tmp_path / "count").unlink()
    store = tmp_path / "store"
    first = DaskCLI(tmp_path)
    try:
        scheduler = first.scheduler()
        first.worker()
        first.worker()
        with dask.config.set({"daskdag.worker-wait": "5s"}), \
                Client(scheduler, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)

            killed: list[float] = []

            def killed_mid_sweep():
                wait_for_chunks(store, 3)
                first.procs[0].kill()  # the scheduler
                killed.append(time.monotonic())

            killer = threading.Thread(target=killed_mid_sweep, daemon=True)
            killer.start()
            with pytest.raises(daskdag.ClusterError, match="scheduler cannot be reached"):
                bounded(lambda: sweep(m.DAG, store, xs, client=client), 90, "the sweep whose "
                        "scheduler died")
            ended = time.monotonic()
            killer.join()
            # From the kill (the event the call answers), not from the sweep's start, which
            # includes the workers' first JAX imports: 5 s of worker-wait, and slack for a
            # loaded machine, stays below distributed's 30 s connect timeout.
            assert len(killed) == 1, "the scheduler was not killed mid-sweep"
            took = ended - killed[0]
            assert took < 30, f"the call took {took:.0f} s after the kill to say its " \
                              f"scheduler was gone"
    finally:
        first.stop()
    pieces = complete(store)
    assert 3 <= len(pieces) < items // CHUNK
    done_items = items_of(pieces)
    before = len(counted(tmp_path))
    (tmp_path / "again").mkdir()
    second = DaskCLI(tmp_path / "again")
    try:
        scheduler = second.scheduler()
        second.worker()
        second.worker()
        with Client(scheduler, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
            res = sweep(m.DAG, store, xs, client=client)
    finally:
        second.stop()
    assert_same(res, ref, xs)
    assert set(counted(tmp_path)[before:]) == set(range(items)) - done_items


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_every_worker_killed_mid_sweep_the_sweep_completes_into_its_store(tmp_path):
    import dask
    from distributed import Client

    from .support.clusters import local_cluster
    from .support.faults import KEEP_NANNIES, bounded, sigkill, worker_pids

    m = dag_module(tmp_path, pause=0.05)
    items = 160
    xs = np.random.default_rng(4).uniform(0.1, 1.5, (items, 4)).astype(np.float32)
    ref = sweep(m.DAG, None, xs)
    store = tmp_path / "store"
    with dask.config.set(KEEP_NANNIES), local_cluster() as cluster, \
            Client(cluster, set_as_default=False) as client:
        client.wait_for_workers(2, timeout=120)
        pids = worker_pids(client)

        def kill_all():
            wait_for_chunks(store, 3)
            sigkill(pids.values())

        killer = threading.Thread(target=kill_all, daemon=True)
        killer.start()
        res, took = bounded(lambda: sweep(m.DAG, store, xs, client=client), 120,
                            "the sweep whose workers died")
        killer.join()
    assert_same(res, ref, xs)
    assert items_of(complete(store)) == set(range(items))
    assert_same(sweep(m.DAG, store, xs), ref, xs)  # read back from the store


def test_changed_items_recomputed_when_asked(tmp_path):
    m = dag_module(tmp_path)
    store = tmp_path / "store"
    sweep(m.DAG, store)
    xs = XS.copy()
    xs[9, 2] += 1.0
    xs[50, 0] -= 0.5
    ref = sweep(m.DAG, None, xs)
    before = len(counted(tmp_path))
    with pytest.raises(daskdag.StoreError, match="changed_items='recompute'"):
        sweep(m.DAG, store, xs)
    res = sweep(m.DAG, daskdag.SweepStore(store, changed_items="recompute"), xs)
    assert_same(res, ref, xs)
    assert sorted(counted(tmp_path)[before:]) == [*range(8, 16), *range(48, 56)]
    assert_same(sweep(m.DAG, store, xs), ref, xs)  # the store now holds the new items
    with pytest.raises(ValueError, match="changed_items must be"):
        daskdag.SweepStore(store, changed_items="ignore")
