"""A warm call's path through daskdag (issue 59): which of its modules run code in a call
made again with new values, counted as ``docs/design.md`` says (every function called, in every
thread, through ``sys.settrace`` and ``threading.settrace``), and what that call still checks.

A prepared all-``jit`` ``value_and_grad`` of the seed DAG runs its whole program alone: the
freshness of what it relies on (the DAG's entries, the settings, each node function's
fingerprint), the program, the results. It compiles nothing, agrees with ``jax.value_and_grad``
of the composed function, and still sees each change: a global a node reads, rebound.
"""

import sys
import threading

import jax
import pytest
import jax.numpy as jnp

import daskdag
from daskdag import Node

from .support.numbers import assert_tree_close

SCALE = 2.0


def x_to_A(x):
    return jnp.tanh(x) * SCALE


def A_to_B(a):
    return jnp.outer(a, a) + jnp.eye(a.shape[0])


def B_to_C(b):
    return jnp.linalg.solve(b, jnp.ones(b.shape[0]))


def C_to_D(c):
    return jnp.sum(c ** 2)


def B_to_E(b):
    return jnp.log(jnp.trace(b))


DAG = {"A": Node(x_to_A, ["x"], jit=True), "B": Node(A_to_B, ["A"], jit=True),
       "C": Node(B_to_C, ["B"], jit=True), "D": Node(C_to_D, ["C"], jit=True),
       "E": Node(B_to_E, ["B"], jit=True)}


def composed(x):
    b = A_to_B(x_to_A(x))
    return C_to_D(B_to_C(b)), B_to_E(b)


COMPILED: list = []  # (XLA's compilations, as JAX reports them)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **_: COMPILED.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)


def modules_run(call) -> list[str]:
    """The daskdag modules whose code runs in ``call()``, in any thread."""
    seen = set()

    def tracer(frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__") or frame.f_code.co_filename
            if name == "daskdag" or name.startswith(("daskdag.", "<daskdag")):
                seen.add(name)

    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return sorted(seen)


def test_a_warm_prepared_call_runs_its_program_and_its_checks_alone():
    global SCALE
    f = daskdag.value_and_grad(DAG, ["D", "E"])
    x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
    for k in range(3):
        f(x + k)
    y = x + 0.5
    compiled = len(COMPILED)
    ran = modules_run(lambda: f(y))
    assert len(COMPILED) == compiled
    assert f.info.prepared
    assert len(ran) <= 4, ran  # (docs/design.md names them)
    values, grads = f(x)
    for k, o in enumerate(("D", "E")):
        want_value, want_grad = jax.value_and_grad(lambda x: composed(x)[k])(x)
        assert_tree_close((values[o], grads[o]), (want_value, want_grad))
    SCALE = 3.0  # (a global of x_to_A, rebound: the warm path sees it)
    try:
        values, grads = f(x)
        assert not f.info.prepared and "node 'A'" in f.info.why
        want_value, want_grad = jax.value_and_grad(lambda x: composed(x)[0])(x)
        assert_tree_close((values["D"], grads["D"]), (want_value, want_grad))
    finally:
        SCALE = 2.0


@pytest.mark.parametrize("keyed", [False, True], ids=["array", "dict"])
def test_entries_of_two_signatures_alternate(keyed):
    """The entry that ran last answers a call it takes at a glance (an array, or a dict of
    arrays by name); one of another signature (shape, dtype, weak type) is looked up by its
    key; each gives JAX's values, and nothing compiles once all are warm."""
    f = daskdag.value_and_grad(DAG, ["D", "E"])
    x5 = jnp.linspace(0.1, 1.0, 5)
    xs = [x5, jnp.linspace(0.2, 0.9, 6), x5 + 1, x5.astype(jnp.bfloat16),
          jax.lax.convert_element_type(x5, jnp.float32)]  # (weakly typed as jnp.linspace is not)
    want = [[jax.value_and_grad(lambda x: composed(x)[k])(x) for k in range(2)] for x in xs]
    given = [{"x": x} if keyed else x for x in xs]
    for x in given * 2:
        f(x)
    compiled = len(COMPILED)
    got = []
    for x in given * 2:
        got.append(f(x))
        assert f.info.prepared
    assert len(COMPILED) == compiled
    for (values, grads), wanted, x in zip(got, want * 2, xs * 2):
        for (want_value, want_grad), o in zip(wanted, ("D", "E")):
            assert values[o].dtype == want_value.dtype and grads[o].dtype == x.dtype
            rtol = 5e-2 if x.dtype == jnp.bfloat16 else 1e-5  # (bfloat16: rounded per node)
            assert_tree_close((values[o], grads[o]), (want_value, want_grad), rtol=rtol)


def test_a_warm_eager_call_runs_few_modules():
    """A warm eager all-``jit`` ``compute_grads`` of the seed DAG runs its one program through
    at most 15 of daskdag's modules, compiles nothing, and agrees with JAX."""
    x = jnp.linspace(0.1, 1.0, 5)
    for k in range(3):
        daskdag.compute_grads(DAG, {"x": x + k}, ["D", "E"])
    compiled = len(COMPILED)
    results = {}
    ran = modules_run(lambda: results.update(daskdag.compute_grads(DAG, {"x": x}, ["D", "E"])))
    assert len(COMPILED) == compiled
    assert len(ran) <= 14, ran
    for k, o in enumerate(("D", "E")):
        assert results[o].info.prepared
        want_value, want_grad = jax.value_and_grad(lambda x: composed(x)[k])(x)
        assert_tree_close((results[o].value, results[o].grad), (want_value, want_grad))


def squares(t):
    return jnp.sum(t ** 2)


def test_the_one_compiled_check_sees_each_change():
    """A warm prepared call's one compiled freshness check sees a JAX setting changed in the
    calling thread, a DAG entry's deps changed in place and an entry replaced: each call after
    a change is prepared anew, says why, and agrees with JAX."""
    dag = dict(DAG)
    f = daskdag.value_and_grad(dag, ["D", "E"])
    x = jnp.linspace(0.1, 1.0, 5)
    for _ in range(3):
        f(x)
    assert f.info.prepared

    with jax.numpy_rank_promotion("warn"):  # (JAX's, in this thread)
        f(x)
        assert not f.info.prepared and "a setting changed" in f.info.why
    for _ in range(2):
        f(x)
    assert f.info.prepared

    dag["E"] = Node(B_to_E, ["B"], jit=True)  # (the same entry anew: the same program serves)
    f(x)
    assert f.info.prepared
    deps = ["B"]
    dag["E"] = Node(squares, deps, jit=True)  # (an entry replaced)
    values, _ = f(x)
    assert not f.info.prepared and "node 'E'" in f.info.why
    assert_tree_close(values["E"], squares(A_to_B(x_to_A(x))))
    for _ in range(2):
        f(x)
    assert f.info.prepared
    deps[0] = "A"  # (its deps changed in place: E reads A now)
    values, grads = f(x)
    assert not f.info.prepared and "node 'E'" in f.info.why
    want_value, want_grad = jax.value_and_grad(lambda x: squares(x_to_A(x)))(x)
    assert_tree_close((values["E"], grads["E"]), (want_value, want_grad))


@pytest.mark.parametrize("keyed", [False, True], ids=["array", "dict"])
def test_a_call_like_the_last_finds_its_entry_without_a_key(keyed, monkeypatch):
    """A call whose input is, at a glance, the last call's signature (an array; a dict of
    arrays by name) runs the last entry without computing a key; another is looked up."""
    from daskdag.running import programs
    f = daskdag.value_and_grad(DAG, ["D", "E"])
    x = jnp.linspace(0.1, 1.0, 5)
    wrap = (lambda v: {"x": v}) if keyed else (lambda v: v)
    f(wrap(x))
    f(wrap(x))
    keyed_calls = []
    held_key = programs.held_key
    monkeypatch.setattr(programs, "held_key", lambda *a: keyed_calls.append(1) or held_key(*a))
    values, grads = f(wrap(x + 1))
    assert f.info.prepared and keyed_calls == []
    want_value, want_grad = jax.value_and_grad(lambda x: composed(x)[0])(x + 1)
    assert_tree_close((values["D"], grads["D"]), (want_value, want_grad))
    f(wrap(jnp.linspace(0.1, 1.0, 6)))  # another shape: looked up by its key
    assert keyed_calls
