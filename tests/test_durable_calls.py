"""Durable calls (``compute_grads(store=...)`` and its siblings, :mod:`daskdag.durable.calls`):
each stage's forward result written to a Zarr store by the task that computed it; the same call
again, after its client or scheduler was killed, runs only the stages the store does not hold
and returns the uninterrupted call's numbers bit for bit. A store holding another call (a node
changed, an array changed in place, another input, output or setting) refuses with StoreError
naming what changed; a damaged entry is computed again, never returned."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag

from .support.clusters import eventually, local_client
from .support.disks import small_tmpfs

DAG_MODULE = '''
import time
import jax.numpy as jnp
import numpy as np

COUNT = {count!r}
PAUSE = {pause!r}
W = np.linspace(0.5, 1.5, 4).astype(np.float32)  # a weight the nodes read, changed in place


def node(name, scale):
    def f(*args):
        time.sleep(PAUSE)
        with open(COUNT, "a") as fh:
            fh.write(name + "\\n")
        return jnp.tanh(sum(args) * W * scale)
    return f


def loss(p0, p1, p2):
    with open(COUNT, "a") as fh:
        fh.write("L\\n")
    return jnp.sum(p0 ** 2) + jnp.sum(p1 * p2)


DAG = {{**{{f"b{{k}}": (node(f"b{{k}}", 0.5 + 0.1 * k), ["x"]) for k in range(6)}},
       **{{f"p{{k}}": (node(f"p{{k}}", 1.0 - 0.2 * k), [f"b{{2 * k}}", f"b{{2 * k + 1}}"])
          for k in range(3)}},
       "L": (loss, ["p0", "p1", "p2"])}}
NODES = sorted(DAG)
'''

X = np.linspace(-1.0, 1.0, 4).astype(np.float32)


def dag_module(tmp_path: Path, pause: float = 0.0):
    """The DAG in a module of its own (as users write it; a cluster's workers cannot import
    it), each node appending its name to ``tmp_path/count`` when it runs."""
    name = f"calldag_{abs(hash((str(tmp_path), pause)))}"
    (tmp_path / f"{name}.py").write_text(DAG_MODULE.format(count=str(tmp_path / "count"),
                                                           pause=pause))
    sys.path.insert(0, str(tmp_path))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(tmp_path))


def counted(tmp_path: Path) -> list[str]:
    f = tmp_path / "count"
    return f.read_text().split() if f.exists() else []


def stored_nodes(store: Path) -> set[str]:
    """The nodes of the stages the store holds complete (their group records their hashes)."""
    out = set()
    stages = store / "stages"
    for entry in stages.iterdir() if stages.exists() else ():
        mark = entry / "zarr.json"
        if mark.exists() and "sha256" in json.loads(mark.read_text()).get("attributes", {}):
            out.update(unquote(entry.name).split(":")[1].split("+"))
    return out


def composed(m):
    """The DAG as one function, for jax.grad."""
    def f(x):
        b = [m.DAG[f"b{k}"][0](x) for k in range(6)]
        p = [m.DAG[f"p{k}"][0](b[2 * k], b[2 * k + 1]) for k in range(3)]
        return m.DAG["L"][0](*p)
    return f


def grads(m, store, **kw):
    return daskdag.compute_grads(m.DAG, X, ["L", "p1"], cotangents={"p1": jnp.ones(4)},
                                 store=store, **kw)


def assert_close(res, ref):
    for o in ref:
        np.testing.assert_allclose(np.asarray(res[o].value), np.asarray(ref[o].value), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(res[o].grad), np.asarray(ref[o].grad), rtol=1e-6,
                                   atol=1e-7)


def assert_same(res, ref):
    """Bit for bit."""
    for o in ref:
        np.testing.assert_array_equal(np.asarray(res[o].value), np.asarray(ref[o].value))
        np.testing.assert_array_equal(np.asarray(res[o].grad), np.asarray(ref[o].grad))


def test_a_stored_call_is_the_call_and_runs_again_nothing(tmp_path):
    m = dag_module(tmp_path)
    ref = grads(m, None)
    np.testing.assert_allclose(ref["L"].grad, jax.grad(composed(m))(X), rtol=1e-5)
    (tmp_path / "count").unlink()
    store = tmp_path / "store"
    first = grads(m, store)
    assert_close(first, ref)
    ref = first
    assert sorted(counted(tmp_path)) == m.NODES  # each node once
    assert stored_nodes(store) == set(m.NODES)
    record = json.loads((store / "zarr.json").read_text())["attributes"]["daskdag"]
    assert record["call"] == "compute_grads" and record["outputs"] == ["L", "p1"]
    assert record["wrt"] == ["x"] and set(record["dag"]) == set(m.NODES)
    again = grads(m, store)
    assert sorted(counted(tmp_path)) == m.NODES  # resumed: no node ran
    assert_same(again, ref)


@pytest.mark.parametrize("where", ["threads", pytest.param("cluster", marks=pytest.mark.cluster)])
@pytest.mark.timeout(240)
def test_only_the_stages_the_store_lacks_run_again(tmp_path, where):
    """Stages missing (never written) or whose group was never completed (a crash between
    the result and its group) run again; the others are read, on threads and on a
    ``LocalCluster(processes=True)``, whose workers write the stages themselves."""
    m = dag_module(tmp_path)
    store = tmp_path / "store"

    def call():
        if where == "threads":
            return grads(m, store)
        with local_client(2) as client:
            return grads(m, store, client=client)

    ref = call()
    assert_close(ref, grads(m, None))
    entries = sorted((store / "stages").glob("*%3A*"))
    gone = [e for e in entries if "b3" in unquote(e.name) or "p2" in unquote(e.name)
            or "L" in unquote(e.name)]
    for e in gone[:1]:
        (e / "zarr.json").unlink()  # torn: the result there, its group not written
    for e in gone[1:]:
        import shutil
        shutil.rmtree(e)
    lost = {n for e in gone for n in unquote(e.name).split(":")[1].split("+")}
    before = len(counted(tmp_path))
    assert_same(call(), ref)
    assert sorted(counted(tmp_path)[before:]) == sorted(lost)
    assert stored_nodes(store) == set(m.NODES)


def test_a_weight_changed_in_place_is_refused_naming_it_and_nothing_is_lost(tmp_path):
    m = dag_module(tmp_path)
    store = tmp_path / "store"
    ref = grads(m, store)
    files = {p: p.read_bytes() for p in store.rglob("*") if p.is_file()}
    m.W[1] = 7.0  # in place: the nodes' global, the same object
    with pytest.raises(daskdag.StoreError, match=r"holds another call: the DAG's nodes .*"
                                                 r"node 'b0': the global 'W'") as refused:
        grads(m, store)
    assert "node 'L'" not in str(refused.value)  # (L does not read W)
    assert {p: p.read_bytes() for p in store.rglob("*") if p.is_file()} == files
    m.W[1] = np.linspace(0.5, 1.5, 4)[1]
    before = len(counted(tmp_path))
    assert_same(grads(m, store), ref)
    assert len(counted(tmp_path)) == before


def test_another_input_output_cotangent_or_setting_is_refused_naming_it(tmp_path):
    import dask

    m = dag_module(tmp_path)
    store = tmp_path / "store"
    grads(m, store)
    with pytest.raises(daskdag.StoreError, match=r"the inputs \['x'\] differ"):
        daskdag.compute_grads(m.DAG, X + 1, ["L", "p1"], cotangents={"p1": jnp.ones(4)},
                              store=store)
    with pytest.raises(daskdag.StoreError, match=r"outputs was \['L', 'p1'\], is now \['L'\]"):
        daskdag.compute_grads(m.DAG, X, "L", store=store)
    with pytest.raises(daskdag.StoreError, match="the cotangents differ"):
        daskdag.compute_grads(m.DAG, X, ["L", "p1"], cotangents={"p1": 2 * jnp.ones(4)},
                              store=store)
    with dask.config.set({"daskdag.fuse-chains": False}), \
            pytest.raises(daskdag.StoreError, match="settings was"):
        grads(m, store)
    with pytest.raises(daskdag.StoreError, match="holds a compute_grads call, not a jacobian"):
        daskdag.jacobian(m.DAG, X, "L", store=store)
    sweep_store = tmp_path / "sweep"
    daskdag.sweep_grads(m.DAG, np.stack([X, X]), "L", store=sweep_store)
    with pytest.raises(daskdag.StoreError, match="holds a sweep_grads sweep, not a compute_grads call"):
        daskdag.compute_grads(m.DAG, X, "L", store=sweep_store)
    with pytest.raises(daskdag.StoreError, match="holds a compute_grads call, not a sweep_grads sweep"):
        daskdag.sweep_grads(m.DAG, np.stack([X, X]), "L", store=store)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "results.csv").write_text("1,2\n")
    with pytest.raises(daskdag.StoreError, match="is not empty, and is not a daskdag call's "
                                                 "store: it holds results.csv. Nothing was "
                                                 "written there"):
        grads(m, tmp_path / "mine")
    assert os.listdir(tmp_path / "mine") == ["results.csv"]


def test_a_damaged_stage_is_computed_again_never_returned(tmp_path):
    m = dag_module(tmp_path)
    store = tmp_path / "store"
    ref = grads(m, store)
    entries = {unquote(e.name).split(":")[1]: e for e in (store / "stages").glob("*%3A*")}
    (b1,) = [e for label, e in entries.items() if "b1" in label.split("+")]
    (b4,) = [e for label, e in entries.items() if "b4" in label.split("+")]
    chunk = b1 / "result" / "c" / "0"
    body = bytearray(chunk.read_bytes())
    body[len(body) // 2] ^= 0xFF  # a flipped byte
    chunk.write_bytes(bytes(body))
    chunk4 = b4 / "result" / "c" / "0"
    chunk4.write_bytes(chunk4.read_bytes()[:10])  # truncated
    before = len(counted(tmp_path))
    assert_same(grads(m, store), ref)
    again = counted(tmp_path)[before:]
    assert sorted(again) == sorted({*unquote(b1.name).split(":")[1].split("+"),
                                    *unquote(b4.name).split(":")[1].split("+")})
    assert stored_nodes(store) == set(m.NODES)


def test_jacobians_jvps_and_hvps_keep_their_stages_too(tmp_path):
    m = dag_module(tmp_path)
    f = composed(m)
    calls = {
        "rev": lambda s: daskdag.jacobian(m.DAG, X, "L", mode="rev", store=s),
        "fwd": lambda s: daskdag.jacobian(m.DAG, X, "L", mode="fwd", store=s),
        "jvps": lambda s: daskdag.compute_jvps(m.DAG, X, jnp.ones(4), "L", store=s),
        "hvps": lambda s: daskdag.compute_hvps(m.DAG, X, jnp.ones(4), "L", store=s)}
    expected = {"rev": lambda r: (r.grad, jax.jacrev(f)(X)),
                "fwd": lambda r: (r.grad, jax.jacfwd(f)(X)),
                "jvps": lambda r: (r.tangent, jax.jvp(f, (X,), (jnp.ones(4),))[1]),
                "hvps": lambda r: (r.hvp, jax.jvp(jax.grad(f), (X,), (jnp.ones(4),))[1])}
    for name, call in calls.items():
        store = tmp_path / name
        first = call(store)
        got, want = expected[name](first)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
        assert stored_nodes(store) == set(m.NODES), name
        before = len(counted(tmp_path))
        again = call(store)
        assert len(counted(tmp_path)) == before, f"{name}: a node ran again"
        fields = [f for f in ("value", "grad", "tangent", "hvp") if hasattr(first, f)]
        for a, b in zip(jax.tree.leaves([getattr(again, f) for f in fields]),
                        jax.tree.leaves([getattr(first, f) for f in fields])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(daskdag.StoreError, match="the tangents differ"):
        daskdag.compute_jvps(m.DAG, X, 2 * jnp.ones(4), "L", store=tmp_path / "jvps")
    with pytest.raises(daskdag.StoreError, match="the directions differ"):
        daskdag.compute_hvps(m.DAG, X, 2 * jnp.ones(4), "L", store=tmp_path / "hvps")
    with pytest.raises(daskdag.StoreError, match="mode was 'rev', is now 'fwd'"):
        daskdag.jacobian(m.DAG, X, "L", mode="fwd", store=tmp_path / "rev")


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (where this machine lets the tests mount one)."""
    with small_tmpfs(tmp_path / "small_disk", "64k") as d:
        yield d


@pytest.mark.timeout(180)
@pytest.mark.subprocess
def test_a_full_disk_is_a_clear_error_and_what_was_written_stays_usable(tmp_path, small_disk):
    m = dag_module(tmp_path)
    x = np.linspace(-1.0, 1.0, 4).astype(np.float32)
    big = {**m.DAG, "big": (lambda x: jnp.tile(x, 8192), ["x"]),
           "L2": (lambda big, l: jnp.sum(big) + l, ["big", "L"])}
    call = lambda store: daskdag.compute_grads(big, x, "L2", store=store, scheduler="sync")
    ref = call(None)
    store = small_disk / "store"
    with pytest.raises(daskdag.StoreError, match="is full .* complete and stay usable"):
        call(store)
    kept = stored_nodes(store)
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    before = len(counted(tmp_path))
    res = call(store)
    np.testing.assert_array_equal(np.asarray(res.grad), np.asarray(ref.grad))
    assert not set(counted(tmp_path)[before:]) & kept


RUNNER = '''
import sys
sys.path.insert(0, {path!r})
import numpy as np
import jax.numpy as jnp
from distributed import Client
import daskdag
import {module} as m

with Client({scheduler!r}, set_as_default=False, timeout=60) as client:
    res = daskdag.compute_grads(m.DAG, np.linspace(-1.0, 1.0, 4).astype(np.float32),
                                ["L", "p1"], cotangents={{"p1": jnp.ones(4)}},
                                store={store!r}, client=client)
'''


def wait_for_stages(store: Path, least: int, timeout: float = 120) -> None:
    eventually(lambda: len(stored_nodes(store)) >= least, timeout, f"{least} nodes stored")


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_client_killed_mid_call_then_the_same_call_again(tmp_path, cli_cluster, cli_client):
    """The client process SIGKILLed once some nodes are stored, on a cluster of ``dask``
    CLI processes that cannot import the DAG's module: the same call then runs only the
    nodes not stored, and returns the uninterrupted call's numbers bit for bit."""
    m = dag_module(tmp_path, pause=0.4)
    ref = grads(m, tmp_path / "uninterrupted", client=cli_client)
    assert_close(ref, grads(m, None))
    (tmp_path / "count").unlink()
    store = tmp_path / "store"
    script = tmp_path / "runner.py"
    script.write_text(RUNNER.format(path=str(tmp_path), module=m.__name__,
                                    scheduler=cli_cluster, store=str(store)))
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(root)})
    try:
        wait_for_stages(store, 4)
    finally:
        kept = stored_nodes(store)
        seen = len(counted(tmp_path))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert 4 <= len(kept) < len(m.NODES), kept
    res = grads(m, store, client=cli_client)
    assert_same(res, ref)
    assert not set(counted(tmp_path)[seen:]) & kept, "a node stored before the kill ran again"
    assert stored_nodes(store) == set(m.NODES)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_the_scheduler_killed_mid_call_then_the_same_call_on_a_new_cluster(tmp_path):
    import dask
    from distributed import Client

    from .support.clusters import DaskCLI
    from .support.faults import bounded

    m = dag_module(tmp_path, pause=0.4)
    store = tmp_path / "store"
    first = DaskCLI(tmp_path)
    try:
        scheduler = first.scheduler()
        first.worker()
        first.worker()
        with dask.config.set({"daskdag.worker-wait": "5s"}), \
                Client(scheduler, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
            seen: dict = {}

            def killed_mid_call():
                wait_for_stages(store, 4)
                seen["kept"], seen["count"] = stored_nodes(store), len(counted(tmp_path))
                first.procs[0].kill()  # the scheduler

            killer = threading.Thread(target=killed_mid_call, daemon=True)
            killer.start()
            # (what a call says of its scheduler's death is not the store's concern: distributed's
            # FutureCancelledError today, where sweeps say ClusterError)
            with pytest.raises(Exception) as died:
                bounded(lambda: grads(m, store, client=client), 90, "the call whose scheduler "
                        "died")
            assert type(died.value).__name__ in ("ClusterError", "FutureCancelledError"), \
                repr(died.value)
            killer.join()
    finally:
        first.stop()
    kept = seen["kept"]
    assert 4 <= len(kept) < len(m.NODES), kept
    (tmp_path / "again").mkdir()
    second = DaskCLI(tmp_path / "again")
    try:
        scheduler = second.scheduler()
        second.worker()
        second.worker()
        with Client(scheduler, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=120)
            res = grads(m, store, client=client)
            ran = counted(tmp_path)[seen["count"]:]
            ref = grads(m, tmp_path / "uninterrupted", client=client)
    finally:
        second.stop()
    assert_same(res, ref)
    assert_close(res, grads(m, None))
    assert not set(ran) & kept, "a node stored before the kill ran again"
