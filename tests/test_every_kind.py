"""Every derivative kind gets every capability: the whole matrix, each cell against plain JAX.

kinds {grads, value_and_grad, jacobian, jvps, hvps} x forms {eager, lazy, prepared} x
{plain, store= resumed after a kill, reused across 3 calls, swept over 8 items} x {threads, a
2-worker ``LocalCluster(processes=True)``}.

The DAG: a jitted trunk ``T = tanh(W @ d)`` over fixed data ``d``, which counts its runs in a
file (an ``io_callback``: it runs wherever the trunk runs, on a worker too), a jitted gate
``G = T`` (which can wait), and a head of the parameters ``p``: ``H = sin(G * p)``, ``L =
sum(H ** 2)``. Each cell counts the trunk's
runs: once for a call, once for 3 calls (reuse), once for a sweep's 8 items (a node of shared
inputs alone), and not again when a killed call resumes from its store (its stage finished).

A stored cell's first call runs in a child process (``every_kind_child.py``), whose gate
waits for a flag file: once the store holds the trunk's stage, the child is SIGKILLed, the
flag is set, and the same call in this process resumes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dask
import dask.array as da
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import daskdag

W = np.array([[0.5, -0.2, 0.1], [0.3, 0.8, -0.4], [0.2, 0.1, 0.9]], np.float32)
D = np.array([1.0, -0.5, 0.25], np.float32)
P = np.array([0.3, -0.7, 1.1], np.float32)
T = np.array([1.0, 0.5, -2.0], np.float32)  # a tangent, the HVPs' v
ITEMS = 8
KINDS = ("grads", "value_and_grad", "jacobian", "jvps", "hvps")
FORMS = ("eager", "lazy", "prepared")
OUTPUT = {"grads": "L", "value_and_grad": "L", "jacobian": "H", "jvps": "H", "hvps": "L"}


def make_dag(runs: str, flag: str | None = None) -> dict:
    """The DAG, its trunk counting its runs in the file ``runs``; with ``flag``, a node after
    it (``G``, the identity when it runs) waits until that file exists: as it runs, not as a
    Jacobian's mode traces it."""

    def mark():
        with open(runs, "a") as f:
            f.write("x")
        return np.float32(0.0)

    def wait():
        while flag is not None and not os.path.exists(flag):
            time.sleep(0.02)
        return np.float32(0.0)

    def trunk(d):
        return jnp.tanh(W @ d) + io_callback(mark, jax.ShapeDtypeStruct((), np.float32))

    def gate(t):
        return t + io_callback(wait, jax.ShapeDtypeStruct((), np.float32))

    return {"T": daskdag.Node(trunk, ["d"], jit=True), "G": daskdag.Node(gate, ["T"], jit=True),
            "H": (lambda g, p: jnp.sin(g * p), ["G", "p"]),
            "L": (lambda h: jnp.sum(h ** 2), ["H"])}


# -- plain JAX, the reference ------------------------------------------------------------------

def _h(p):
    return jnp.sin(jnp.tanh(W @ D) * p)


def _l(p):
    return jnp.sum(_h(p) ** 2)


def want(kind: str, p) -> tuple:
    """What plain JAX gives for one point ``p``: the parts the call's form returns."""
    if kind == "grads":
        return (jax.grad(_l)(p),)
    if kind == "value_and_grad":
        return jax.value_and_grad(_l)(p)
    if kind == "jacobian":
        return _h(p), jax.jacrev(_h)(p)
    if kind == "jvps":
        return jax.jvp(_h, (p,), (jnp.asarray(T),))
    value, (grad, hvp) = _l(p), jax.jvp(jax.grad(_l), (p,), (jnp.asarray(T),))
    return value, grad, hvp


def want_items(kind: str, ps) -> tuple:
    """``want`` over items, as ``jax.vmap`` gives it."""
    return jax.vmap(lambda p: want(kind, p))(ps)


# -- one call of a kind in a form --------------------------------------------------------------

def _data(kind: str, items: int | None = None) -> tuple:
    """A call's data: the tangents (JVPs) or ``v`` (HVPs), per item in a sweep."""
    if kind not in ("jvps", "hvps"):
        return ()
    t = T if items is None else np.tile(T, (items, 1))
    return ({"p": t},)


def _parts(kind: str, res) -> tuple:
    """The parts of an eager or lazy call's result, as ``want`` gives them."""
    if kind == "jvps":
        return res.value, res.tangent
    grad = res.grad["p"] if isinstance(res.grad, dict) else res.grad
    if kind == "grads":
        return (grad,)
    if kind in ("value_and_grad", "jacobian"):
        return res.value, grad
    hvp = res.hvp["p"] if isinstance(res.hvp, dict) else res.hvp
    return res.value, grad, hvp


def _of_p(out) -> tuple:
    """A prepared function's parts, each with respect to ``p`` (of ``{input: ...}``)."""
    return tuple(part["p"] if isinstance(part, dict) else part
                 for part in (out if isinstance(out, tuple) else (out,)))


def _eager(kind: str, dag, x, where: dict, store=None):
    out = OUTPUT[kind]
    if kind in ("grads", "value_and_grad"):
        return daskdag.compute_grads(dag, x, out, wrt=["p"], store=store, **where)
    if kind == "jacobian":
        return daskdag.jacobian(dag, x, out, wrt=["p"], store=store, **where)
    if kind == "jvps":
        return daskdag.compute_jvps(dag, x, *_data(kind), out, store=store, **where)
    return daskdag.compute_hvps(dag, x, *_data(kind), out, wrt=["p"], store=store, **where)


def _lazy(kind: str, dag, x, store=None):
    out = OUTPUT[kind]
    if kind in ("grads", "value_and_grad"):
        return daskdag.grads(dag, x, out, wrt=["p"], store=store)
    if kind == "jacobian":
        return daskdag.jacobians(dag, x, out, wrt=["p"], store=store)
    if kind == "jvps":
        return daskdag.jvps(dag, x, *_data(kind), out, store=store)
    return daskdag.hvps(dag, x, *_data(kind), out, wrt=["p"], store=store)


def prepared(kind: str, dag, where: dict):
    out = OUTPUT[kind]
    return {"grads": lambda: daskdag.grad(dag, out, wrt=["p"], **where),
            "value_and_grad": lambda: daskdag.value_and_grad(dag, out, wrt=["p"], **where),
            "jacobian": lambda: daskdag.value_and_jacobian(dag, out, wrt=["p"], **where),
            "jvps": lambda: daskdag.value_and_jvp(dag, out, **where),
            "hvps": lambda: daskdag.value_grad_and_hvp(dag, out, wrt=["p"], **where)}[kind]()


def call(kind: str, form: str, dag, p, client=None, store=None, f=None) -> tuple:
    """One call of ``kind`` in ``form`` at the point ``p``, on ``client`` (None: threads);
    ``f``: the prepared function to call. Returns the parts ``want`` gives."""
    where = {"client": client} if client is not None else {"scheduler": "threads"}
    x = {"d": D, "p": jnp.asarray(p)}
    if form == "eager":
        return _parts(kind, _eager(kind, dag, x, where, store))
    if form == "lazy":
        lazy = _lazy(kind, dag, x, store)
        (res,) = dask.compute(lazy, scheduler=client if client is not None else "threads")
        return _parts(kind, res)
    f = f or prepared(kind, dag, where)
    return _of_p(f(x, *_data(kind), store=store))


def sweep(kind: str, form: str, dag, ps, client=None) -> tuple:
    """``kind`` over the items ``ps`` of ``p`` in ``form`` (lazy: ``p`` a dask array, the
    results dask arrays), on ``client`` (None: threads)."""
    where = {"client": client} if client is not None else {"scheduler": "threads"}
    out = OUTPUT[kind]
    items = da.from_array(np.asarray(ps), chunks=(ITEMS // 2, 3)) if form == "lazy" else ps
    xs, data = {"d": D, "p": items}, _data(kind, ITEMS)
    if form == "lazy":
        data = tuple({"p": da.from_array(d["p"], chunks=(ITEMS // 2, 3))} for d in data)
    if form == "prepared":
        return _of_p(prepared(kind, dag, where).sweep(xs, *data, batched=["p"]))
    fn = {"grads": daskdag.sweep_grads, "value_and_grad": daskdag.sweep_grads,
          "jacobian": daskdag.sweep_jacobians, "jvps": daskdag.sweep_jvps,
          "hvps": daskdag.sweep_hvps}[kind]
    wrt = {} if kind == "jvps" else {"wrt": ["p"]}
    res = fn(dag, xs, *data, out, batched=["p"], **wrt, **where)
    parts = _parts(kind, res)
    if form == "lazy":  # (dask arrays, computed here)
        parts = dask.compute(*parts, scheduler=client if client is not None else "threads")
    return tuple(parts)


def _complete(mark: Path) -> bool:
    """A stage's mark written whole (the child may be writing it as it is read)."""
    try:
        return "sha256" in json.loads(mark.read_text())["attributes"]
    except (OSError, ValueError, KeyError):
        return False


def killed_once_stored(kind: str, form: str, count: Path, flag: Path, store: Path,
                       address: str = "", env: dict | None = None) -> str | None:
    """The call of ``kind`` in ``form`` started in a child process (``every_kind_child.py``,
    with ``env``; on the cluster at ``address``, else threads), its gate waiting for ``flag``,
    and SIGKILLed once ``store`` holds the trunk's stage: None, or why that did not happen."""
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("every_kind_child.py")), kind, form,
         str(count), str(flag), str(store), address],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not any(_complete(mark) for mark in store.glob("stages/*%3AT%3A*/zarr.json")):
            if child.poll() is not None:
                return f"the child ended: {child.stdout.read().decode()[-3000:]}"
            if time.monotonic() > deadline:
                return "the trunk's stage never reached the store"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    return None


def runs(path: Path) -> int:
    jax.effects_barrier()
    return len(path.read_text()) if path.exists() else 0


def check(got: tuple, expected: tuple) -> None:
    assert len(got) == len(expected)
    for g, w in zip(got, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)


# -- the matrix ---------------------------------------------------------------------------------

@pytest.fixture(params=["threads", pytest.param("cluster", marks=pytest.mark.cluster)])
def placed(request):
    """None (threads), or a client of the module's 2-worker ``LocalCluster(processes=True)``
    (conftest's ``cluster``; a cluster test fails on what distributed logs as a defect)."""
    return None if request.param == "threads" else request.getfixturevalue("client")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_plain(kind, form, placed, tmp_path):
    count = tmp_path / "runs"
    check(call(kind, form, make_dag(str(count)), P, placed), want(kind, P))
    assert runs(count) == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_reused_across_three_calls(kind, form, placed, tmp_path):
    """The trunk reads no moving input: it runs once in 3 calls with new parameters."""
    count = tmp_path / "runs"
    dag = make_dag(str(count))
    where = {"client": placed} if placed is not None else {"scheduler": "threads"}
    f = prepared(kind, dag, where) if form == "prepared" else None
    for step in range(3):
        p = P + 0.1 * step
        check(call(kind, form, dag, p, placed, f=f), want(kind, p))
    assert runs(count) == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_swept_over_eight_items(kind, form, placed, tmp_path):
    """Each item against ``jax.vmap`` of plain JAX; the trunk, a node of the shared input
    alone, runs once for the 8 items."""
    count = tmp_path / "runs"
    ps = P + 0.1 * np.arange(ITEMS, dtype=np.float32)[:, None]
    check(sweep(kind, form, make_dag(str(count)), ps, placed), want_items(kind, ps))
    assert runs(count) == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.subprocess
def test_stored_resumed_after_a_kill(kind, form, placed, tmp_path):
    """The call, in a child process, is SIGKILLed once its store holds the trunk's stage;
    the same call here resumes: the trunk does not run again, and the results are JAX's."""
    count, flag, store = tmp_path / "runs", tmp_path / "flag", tmp_path / "store"
    address = placed.scheduler.address if placed is not None else ""
    failed = killed_once_stored(kind, form, count, flag, store, address)
    assert failed is None, failed
    assert runs(count) == 1
    flag.touch()
    check(call(kind, form, make_dag(str(count), str(flag)), P, placed, store=str(store)),
          want(kind, P))
    assert runs(count) == 1  # (the trunk's stage was read back, not run again)


@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_on_a_cluster_that_cannot_import_this_module(kind, cli_client, tmp_path):
    """A call and a sweep of each kind on workers started with the ``dask`` command, which
    cannot import this test module: the DAG's functions travel by value."""
    count = tmp_path / "runs"
    dag = make_dag(str(count))
    check(call(kind, "eager", dag, P, cli_client), want(kind, P))
    ps = P + 0.1 * np.arange(ITEMS, dtype=np.float32)[:, None]
    check(sweep(kind, "eager", dag, ps, cli_client), want_items(kind, ps))
    assert runs(count) == 2  # (once for the call, once for the sweep's items)
