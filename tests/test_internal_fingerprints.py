"""A function's fingerprint (daskdag.transport.fingerprints): it changes with anything packing
would see change, stays the same otherwise, and keeps nothing of its function alive."""

import functools
import gc
import threading
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

from daskdag.transport import packing, pickler
from daskdag.transport.fingerprints import by_reference, fingerprint
from daskdag.transport.weak import Weak


def _same_until(fn, change):
    before = fingerprint(fn)
    assert before is not None and fingerprint(fn) == before  # (stable while nothing changes)
    change()
    after = fingerprint(fn)
    assert after is not None and after != before
    return after


def test_arrays_by_content_jax_arrays_by_identity():
    W = np.ones((64, 64))  # large: hashed, not copied into the fingerprint
    small = np.ones(3)
    fn = lambda x: W @ x + small  # noqa: E731
    _same_until(fn, lambda: W.__setitem__((3, 4), 2.0))
    _same_until(fn, lambda: small.__setitem__(0, 5.0))
    J = jnp.ones(3)
    holder = {"J": J}
    g = lambda x: holder["J"] * x  # noqa: E731
    print_ = fingerprint(g)
    holder["J"] = jnp.ones(3)  # equal content, another array: JAX arrays count by identity
    assert fingerprint(g) != print_


def test_globals_closures_defaults_attributes_containers():
    namespace = {"__name__": "daskdag_test_fp", "scale": 1.0, "table": [1, 2], "np": np}
    exec("def f(x, k=1):\n    return np.sum(x) * scale * table[0] * k", namespace)
    f = namespace["f"]
    _same_until(f, lambda: namespace.__setitem__("scale", 2.0))
    _same_until(f, lambda: namespace["table"].append(3))
    _same_until(f, lambda: setattr(f, "__defaults__", (2,)))
    _same_until(f, lambda: setattr(f, "note", "an attribute"))

    cell = {"w": 1.0}

    def outer():
        value = cell

        def inner(x):
            return x * value["w"]

        def rebind():
            nonlocal value
            value = {"w": 3.0}
        return inner, rebind

    inner, rebind = outer()
    _same_until(inner, lambda: cell.__setitem__("w", 2.0))
    _same_until(inner, rebind)


def test_objects_as_pickling_sees_them():
    class Config:
        def __init__(self):
            self.scale = 1.0

    cfg = Config()
    fn = functools.partial(lambda c, x: c.scale * x, cfg)
    _same_until(fn, lambda: setattr(cfg, "scale", 2.0))
    _same_until(fn, lambda: setattr(Config, "extra", 1))  # (a class of the user's, by value)


def test_installed_code_by_reference_and_a_weak_hold_by_its_function():
    assert by_reference(jnp.sin) and by_reference(np.add) and not by_reference(lambda: 0)
    fn = lambda x: jnp.sin(x)  # noqa: E731
    assert fingerprint(Weak(fn)) == fingerprint(fn)


def test_unreadable_objects_make_a_function_unwatchable():
    lock = threading.Lock()
    assert fingerprint(lambda x: x if lock else x) is None
    gen = (i for i in range(3))
    assert fingerprint(lambda x: next(gen)) is None


def test_a_fingerprint_keeps_nothing_of_its_function_alive():
    def make():
        big = np.ones(1000)
        return lambda x: x * big

    fn = make()
    kept = [fingerprint(fn), fingerprint(Weak(fn)), fingerprint(functools.partial(Weak(fn), 1))]
    ref = weakref.ref(fn)
    del fn
    gc.collect()
    assert ref() is None and all(k is not None for k in kept)


def test_packed_functions_are_pickled_again_only_when_changed(monkeypatch):
    dumped = []
    dump = pickler.Pickler.dump
    monkeypatch.setattr(pickler.Pickler, "dump", lambda self, obj: dumped.append(obj) or dump(self, obj))
    W = np.ones(3)
    fn = lambda x: W * x  # noqa: E731
    first = packing.pack_function("f", fn, strict=False)
    second = packing.pack_function("f", fn, strict=False)
    assert len(dumped) == 1 and first.token == second.token
    W[0] = 2.0
    third = packing.pack_function("f", fn, strict=False)
    assert len(dumped) == 2 and third.token != first.token


@pytest.mark.parametrize("value", [np.float32(1.5), 3, "text", (1, 2.0), frozenset({1, 2})])
def test_atoms_and_immutable_containers_by_value(value):
    holder = [value]
    fn = lambda x: holder[0]  # noqa: E731
    print_ = fingerprint(fn)
    holder[0] = type(value)(value) if not isinstance(value, np.generic) else np.float32(1.5)
    assert fingerprint(fn) == print_  # (an equal value: nothing packing would see changed)


def test_cloudpickles_private_submodule_finder_is_there():
    """:class:`daskdag.transport.pickler.user_modules_by_value` answers cloudpickle's private
    ``_find_imported_submodules`` from its last scan of ``sys.modules``: a cloudpickle release
    that renames it fails here, instead of packing silently getting slower."""
    import cloudpickle.cloudpickle as cp

    assert callable(getattr(cp, "_find_imported_submodules", None))
