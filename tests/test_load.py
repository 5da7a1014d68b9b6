"""Load: 8 threads of one process issuing mixed calls (compute_grads, jacobian, compute_jvps,
sweep_grads, and lazy grads().compute()) on ONE client, against the same 200 calls from one
thread. Every result must be right and nothing of the calls may stay on the scheduler; the
throughput ratio is printed and recorded (``record_property``), not asserted: these machines
are too noisy for a bound."""

import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag

from .support.clusters import local_client, scheduler_tasks, wait_only_kept_left
from .support.numbers import assert_tree_close, seed_functions

THREADS = 8
PER_THREAD = 25
KINDS = ("compute_grads", "jacobian", "compute_jvps", "sweep_grads", "lazy_grads")
INPUTS = 10  # distinct inputs: calls repeat them, so they share what the client keeps
F = seed_functions()
DAG = {"A": (F["x_to_A"], ["x"]), "B": (F["A_to_B"], ["A"]), "C": (F["B_to_C"], ["B"]),
       "D": (F["C_to_D"], ["C"]), "E": (F["B_to_E"], ["B"])}
V = jnp.linspace(-1.0, 1.0, 5)


def composed(x):
    B = F["A_to_B"](F["x_to_A"](x))
    C = F["B_to_C"](B)
    return {"C": C, "D": F["C_to_D"](C), "E": F["B_to_E"](B)}


def x_of(i):
    return jnp.array([1.0, 2.0, 3.0, 4.0, 5.0]) + 0.1 * (i % INPUTS)


def xs_of(i):
    return x_of(i) + jnp.linspace(0.0, 0.5, 6)[:, None]  # 6 items


def call(client, kind, i):
    x = x_of(i)
    if kind == "compute_grads":
        return daskdag.compute_grads(DAG, x, ["D", "E"], client=client)
    if kind == "jacobian":
        return daskdag.jacobian(DAG, x, ["C", "E"], client=client)
    if kind == "compute_jvps":
        return daskdag.compute_jvps(DAG, x, V, ["D", "E"], client=client)
    if kind == "sweep_grads":
        return daskdag.sweep_grads(DAG, xs_of(i), ["D", "E"], client=client)
    # lazy_grads, computed on this client. (Not inside client.as_current(): it sets Dask's
    # global config, which threads entering and leaving it out of order leave set.)
    return daskdag.grads(DAG, x, ["D", "E"]).compute(scheduler=client)


@functools.cache
def expected(kind, i):
    """Plain JAX's answer to the call ``(kind, i)``, ``{output: parts}`` (calls with the same
    input share it)."""
    x = x_of(i)
    if kind == "jacobian":
        return {o: (composed(x)[o], jax.jacrev(lambda x: composed(x)[o])(x)) for o in ("C", "E")}
    out = {}
    for o in ("D", "E"):
        f = lambda x: composed(x)[o]  # noqa: E731
        if kind == "compute_jvps":
            out[o] = jax.jvp(f, (x,), (V,))
        elif kind == "sweep_grads":
            out[o] = jax.vmap(jax.value_and_grad(f))(xs_of(i))
        else:
            out[o] = jax.value_and_grad(f)(x)
    return out


def check(kind, i, res):
    for o, want in expected(kind, i % INPUTS).items():
        if kind == "compute_jvps":
            assert_tree_close((res[o].value, res[o].tangent), want, rtol=1e-5)
        else:
            assert_tree_close((res[o].value, res[o].grad), want, rtol=1e-5)
        if kind == "sweep_grads":
            assert not res[o].failed


def run_calls(client, calls, threads):
    """``calls`` (``[(kind, i)]``) split over ``threads`` threads, each making its share one
    after another. Returns ``(seconds, {(kind, i): result})``; fails on the first error, or if
    a thread is not done within 150 s."""
    results, errors = {}, []

    def worker(share):
        for kind, i in share:
            try:
                results[kind, i] = call(client, kind, i)
            except BaseException as e:
                e.add_note(f"(raised by {kind} call {i}, one of {threads} threads)")
                errors.append(e)
                return

    pool = [threading.Thread(target=worker, args=(calls[t::threads],), daemon=True)
            for t in range(threads)]
    start = time.monotonic()
    for t in pool:
        t.start()
    for t in pool:
        t.join(max(1.0, 150 - (time.monotonic() - start)))
    took = time.monotonic() - start
    assert not any(t.is_alive() for t in pool), f"{threads} threads: calls still running after 150 s"
    if errors:
        raise errors[0]
    return took, results


@pytest.mark.cluster
@pytest.mark.timeout(400)
def test_eight_threads_of_mixed_calls_on_one_client(distributed_log, record_property):
    calls = [(KINDS[i % len(KINDS)], i) for i in range(THREADS * PER_THREAD)]
    with local_client() as client:
        before = scheduler_tasks(client)
        run_calls(client, [(k, 0) for k in KINDS], 1)  # warm-up: JAX in the workers, compiles
        seconds = {}
        for threads in (1, THREADS):
            seconds[threads], results = run_calls(client, calls, threads)
            assert sorted(results) == sorted(calls)
            for (kind, i), res in results.items():
                check(kind, i, res)
            del results
            distributed_log.check()
        ratio = seconds[1] / seconds[THREADS]
        print(f"\n{len(calls)} mixed calls: 1 thread {len(calls) / seconds[1]:.1f} calls/s, "
              f"{THREADS} threads {len(calls) / seconds[THREADS]:.1f} calls/s; "
              f"throughput {THREADS} threads / 1 thread: {ratio:.2f}")
        record_property("calls_per_s_1_thread", round(len(calls) / seconds[1], 2))
        record_property(f"calls_per_s_{THREADS}_threads", round(len(calls) / seconds[THREADS], 2))
        record_property(f"throughput_{THREADS}_threads_over_1", round(ratio, 3))
        wait_only_kept_left(client, before)
    assert np.isfinite(ratio)
