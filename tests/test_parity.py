"""One answer wherever a call runs: every kind (and a sweep of each) on Dask's threads, on its
multiprocessing scheduler and on a 2-worker ``LocalCluster(processes=True)``, with JAX's x64
and matmul precision set in the calling thread only (``jax.enable_x64``,
``jax.default_matmul_precision``: context managers that neither Dask's worker threads nor other
processes see). Each gives the dtypes of the threaded call, and its values to 1e-12 in float64;
the threaded call itself agrees with plain JAX under the same settings."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
from collections.abc import Callable

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag

W = np.linspace(-1.0, 1.0, 12).reshape(4, 3) * (1.0 + 1e-9)  # float64: cut to float32 without x64
P = np.array([0.3, -0.7, 1.1]) * (1.0 + 1e-9)
V = np.array([1.0, 0.5, -2.0])
ITEMS = 4
PS = np.stack([P * (1.0 + 0.1 * k) for k in range(ITEMS)])
VS = np.tile(V, (ITEMS, 1))
KINDS = ("grads", "value_and_grad", "jacobian rev", "jacobian fwd", "jvps", "hvps")


def make_dag() -> dict:
    """A jitted matmul (precision matters), an eager node (run op by op, with a branch on a
    shape), a vmapped node, and a scalar loss. Made in a function: it travels to workers by
    value."""
    def eager(h):
        return h * 2.0 if h.ndim == 1 else h

    return {"H": daskdag.Node(lambda w, p: jnp.tanh(w @ p), ["w", "p"], jit=True),
            "E": (eager, ["H"]),
            "S": daskdag.Node(lambda e: jnp.sin(e) * e, ["E"], jit=True, vmap=True),
            "L": (lambda s, p: jnp.sum(s ** 2) + jnp.sum(p ** 3), ["S", "p"])}


def _s(w, p):
    e = jnp.tanh(w @ p) * 2.0
    return jnp.sin(e) * e


def _l(w, p):
    return jnp.sum(_s(w, p) ** 2) + jnp.sum(p ** 3)


def plain(kind: str, p, v) -> tuple:
    """Plain JAX at one point, in the parts :func:`parts` takes from a call."""
    w = jnp.asarray(W)
    if kind in ("grads", "value_and_grad"):
        value, grad = jax.value_and_grad(_l, 1)(w, p)
        return (grad,) if kind == "grads" else (value, grad)
    if kind.startswith("jacobian"):
        return _s(w, p), jax.jacrev(_s, 1)(w, p)
    if kind == "jvps":
        return jax.jvp(lambda p: _s(w, p), (p,), (v,))
    value, (grad, hvp) = _l(w, p), jax.jvp(lambda p: jax.grad(_l, 1)(w, p), (p,), (v,))
    return value, grad, hvp


def parts(kind: str, res) -> tuple:
    """A result's parts, as :func:`plain` gives them (each with respect to ``p``)."""
    if kind == "jvps":
        return res.value, res.tangent
    grad = res.grad["p"]
    if kind == "grads":
        return (grad,)
    if kind == "hvps":
        return res.value, grad, res.hvp["p"]
    return res.value, grad


def call(kind: str, where: dict) -> tuple:
    dag, x = make_dag(), {"w": W, "p": P}
    if kind in ("grads", "value_and_grad"):
        return parts(kind, daskdag.compute_grads(dag, x, "L", wrt="p", **where))
    if kind.startswith("jacobian"):
        return parts(kind, daskdag.jacobian(dag, x, "S", wrt="p", mode=kind.split()[1], **where))
    if kind == "jvps":
        return parts(kind, daskdag.compute_jvps(dag, x, {"p": V}, "S", **where))
    return parts(kind, daskdag.compute_hvps(dag, x, {"p": V}, "L", wrt="p", **where))


def sweep(kind: str, where: dict) -> tuple:
    dag, xs = make_dag(), {"w": W, "p": PS}
    common = dict(batched=["p"], chunk_size=2, **where)
    if kind in ("grads", "value_and_grad"):
        return parts(kind, daskdag.sweep_grads(dag, xs, "L", wrt="p", **common))
    if kind.startswith("jacobian"):
        return parts(kind, daskdag.sweep_jacobians(dag, xs, "S", wrt="p", mode=kind.split()[1],
                                                   **common))
    if kind == "jvps":
        return parts(kind, daskdag.sweep_jvps(dag, xs, {"p": VS}, "S", **common))
    return parts(kind, daskdag.sweep_hvps(dag, xs, {"p": VS}, "L", wrt="p", **common))


@contextlib.contextmanager
def settings(x64: bool):
    """x64 as given and the highest matmul precision, in this thread only."""
    with jax.enable_x64(x64), jax.default_matmul_precision("highest"):
        yield


def same(got: tuple, want: tuple, x64: bool, what: str) -> None:
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, f"{what}: dtype {g.dtype}, threads gave {w.dtype}"
        assert g.shape == w.shape, what
        np.testing.assert_allclose(g, w, rtol=1e-12 if x64 else 1e-6, atol=1e-12 if x64 else 1e-6,
                                   err_msg=what)


@pytest.fixture(scope="module")
def processes():
    """Dask's multiprocessing scheduler over one pool of spawned processes for the module."""
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")
                                                ) as pool:
        yield {"scheduler": "processes", "pool": pool}


def _where(name: str, request) -> tuple[dict, Callable[[], contextlib.AbstractContextManager]]:
    """A call's keyword, and what makes the context it runs in (anew for each ``with``: a
    ``dask.config.set`` sets at its creation, and its exit undoes it), for the scheduler
    ``name``."""
    if name == "threads":
        return {"scheduler": "threads"}, contextlib.nullcontext
    if name == "processes":
        p = request.getfixturevalue("processes")
        return {"scheduler": "processes"}, lambda: dask.config.set(pool=p["pool"])
    return {"client": request.getfixturevalue("client")}, contextlib.nullcontext


SCHEDULERS = ["processes", pytest.param("cluster", marks=pytest.mark.cluster)]


def reference(kind: str, form: str) -> tuple:
    """Plain JAX under the calling thread's settings: at ``P``, or over the items ``PS``."""
    p = jnp.asarray(P)
    if form == "call":
        return plain(kind, p, jnp.asarray(V, p.dtype))
    ps = jnp.asarray(PS)
    return jax.vmap(lambda p, v: plain(kind, p, v))(ps, jnp.asarray(VS, ps.dtype))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@pytest.mark.parametrize("form", ["call", "sweep"])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.subprocess
def test_every_kind_the_same_on_every_scheduler(scheduler, form, x64, request):
    where, context = _where(scheduler, request)
    run = call if form == "call" else sweep
    with settings(x64):
        for kind in KINDS:
            want = run(kind, {"scheduler": "threads"})
            assert np.asarray(want[-1]).dtype == (np.float64 if x64 else np.float32), kind
            same(want, reference(kind, form), x64, f"{form} of {kind} on threads")
            with context():
                got = run(kind, where)
            same(got, want, x64, f"{form} of {kind} on {scheduler}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.subprocess
def test_prepared_and_lazy_calls_take_the_settings_of_the_calling_thread(scheduler, request):
    """A prepared function computes under the settings of the thread that calls it, each call
    (a change prepares it anew); a lazy call under those of the thread that made it, computed
    later on the cluster. (A lazy call that the user computes on Dask's multiprocessing
    scheduler takes its values in with Dask's own unpickling, which cuts float64 JAX arrays to
    float32 in a process without x64: docs/guides/lazy.md.)"""
    where, context = _where(scheduler, request)
    f = daskdag.value_and_grad(make_dag(), "L", wrt="p", **where)
    x = {"w": W, "p": P}
    with settings(True):
        want = call("value_and_grad", {"scheduler": "threads"})
        lazy = daskdag.grads(make_dag(), x, "L", wrt="p")
    with context():
        with settings(True):
            value, grad = f(x)
        same((value, grad["p"]), want, True, f"prepared, x64, on {scheduler}")
        value, grad = f(x)  # (this thread's own settings: float32)
        assert np.asarray(value).dtype == np.asarray(grad["p"]).dtype == np.float32
        if "client" in where:
            client = where["client"]
            computed = dask.compute(lazy, scheduler=client)[0]
            same((computed.value, computed.grad["p"]), want, True, f"lazy, x64, on {scheduler}")

            def plain_dtype():  # (nested: travels by value) other work, in the same threads
                import jax.numpy as jnp
                return str(jnp.ones(2).dtype)
            # The workers' own settings are back once daskdag's tasks end.
            assert {client.submit(plain_dtype, pure=False, workers=[w]).result(timeout=60)
                    for w in client.scheduler_info(n_workers=-1)["workers"]} == {"float32"}
