"""A function's fingerprint (daskdag.transport.fingerprints): it changes with anything packing
would see change, stays the same otherwise, and keeps nothing of its function alive."""

import functools
import gc
import sys
import threading
import types
import weakref

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daskdag.transport import packing, pickler
from daskdag.transport.fingerprints import fingerprint
from daskdag.transport.whose import by_reference
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
    monkeypatch.setattr(pickler.Pickler, "dump",
                        lambda self, obj: dumped.append(obj) or dump(self, obj))
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
    """:class:`daskdag.transport.pickler._Submodules` answers cloudpickle's private
    ``_find_imported_submodules`` from its last scan of ``sys.modules``: a cloudpickle release
    that renames it fails here, instead of packing silently getting slower."""
    import cloudpickle.cloudpickle as cp

    assert callable(getattr(cp, "_find_imported_submodules", None))


# -- a fingerprint's compiled check holds exactly when a new fingerprint would be equal ----------



class _Box:
    """An object of the user's (pickled by value): read through its ``__dict__``."""


_checked_modules = iter(range(10 ** 6))


def _user_module():
    m = types.ModuleType(f"fingerprint_check_{next(_checked_modules)}")
    m.__file__ = f"/project/{m.__name__}.py"
    sys.modules[m.__name__] = m
    return m


def _leaves():
    return st.one_of(st.integers(-3, 3), st.floats(-2, 2, allow_nan=False), st.text(max_size=2),
                     st.none(), st.booleans(),
                     st.integers(1, 40).map(lambda n: np.arange(float(n))),  # small and hashed
                     st.just("jax").map(lambda _: jnp.ones(2)))


def _holders(children):
    def box(items):
        b = _Box()
        for k, v in enumerate(items):
            setattr(b, f"a{k}", v)
        return b

    def module(items):
        m = _user_module()
        for k, v in enumerate(items):
            setattr(m, f"a{k}", v)
        return m

    def closure(items):
        held = list(items)
        return lambda: held

    return st.one_of(st.lists(children, max_size=3), st.lists(children, max_size=3).map(tuple),
                     st.dictionaries(st.sampled_from("pqr"), children, max_size=3),
                     st.lists(children, max_size=3).map(box),
                     st.lists(children, max_size=3).map(module),
                     st.lists(children, max_size=3).map(closure),
                     st.lists(st.integers(0, 5), max_size=3).map(frozenset))


def _mutables(obj, seen=None):
    """Every place in ``obj`` that can change in place: (container, how to change it)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    found = []
    if isinstance(obj, np.ndarray) and obj.size:
        found.append(lambda: obj.__setitem__(0, obj[0] + 1))
    elif type(obj) is list:
        found.append(lambda: obj.append(7))
        if obj:
            found.append(lambda: obj.__setitem__(0, "changed"))
        for v in obj:
            found += _mutables(v, seen)
    elif type(obj) is tuple:
        for v in obj:
            found += _mutables(v, seen)
    elif type(obj) is dict:
        found.append(lambda: obj.__setitem__("new", 1))
        for v in list(obj.values()):
            found += _mutables(v, seen)
    elif isinstance(obj, (_Box, types.ModuleType)):
        found.append(lambda: setattr(obj, "a0", "rebound"))
        if isinstance(obj, types.ModuleType):  # (an attribute no code reads: no change)
            found.append(lambda: setattr(obj, "unread", 1))
        for v in list(vars(obj).values()):
            if not isinstance(v, str):
                found += _mutables(v, seen)
    elif isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            found += _mutables(cell.cell_contents, seen)
    return found


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.recursive(_leaves(), _holders, max_leaves=12), st.data())
def test_the_compiled_check_agrees_with_a_new_fingerprint(world, data):
    fn = data.draw(st.sampled_from([
        lambda: world,  # (reads no attribute of a module by name)
        lambda: (world, world.a0 if hasattr(world, "a0") else None),
        lambda: (world, getattr(world, "a0", None), getattr(world, "a1", None))]))
    before = fingerprint(fn, checked=True)
    assert before is not None and before.holds(fn) and fingerprint(fn) == before
    places = _mutables(world)
    if places:
        data.draw(st.sampled_from(places))()
    assert before.holds(fn) == (fingerprint(fn) == before)
    assert not before.holds(fn) or not places or fingerprint(fn) == before


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.recursive(_leaves(), _holders, max_leaves=12), st.data())
def test_fingerprints_and_content_tokens_follow_one_walk(world, data):
    """Fingerprints and content tokens are two records of one walk: an in-place change that one
    of them sees, the other sees too (JAX arrays aside, which neither changes in place)."""
    from daskdag.transport.content import token

    fn = data.draw(st.sampled_from([lambda: world, lambda: getattr(world, "a1", None)]))
    before, content = fingerprint(fn), token(fn)
    places = _mutables(world)
    if places:
        data.draw(st.sampled_from(places))()
    assert (fingerprint(fn) == before) == (token(fn) == content)


def test_classes_with_properties_slots_and_abcs_are_watched():
    """What pickling saves of a class (a property, slots, an ABC) is read; its attributes
    changing is seen."""
    import abc

    class Base(abc.ABC):
        pass

    class Box(Base):
        __slots__ = ("width", "height")
        ratio = property(lambda self: self.width / self.height)

    fn = lambda x: Box.ratio.fget(x)  # noqa: E731
    checked = fingerprint(fn, checked=True)
    assert checked is not None and checked.holds(fn)
    _same_until(fn, lambda: setattr(Box, "ratio", property(lambda self: self.width)))
    assert not checked.holds(fn)
    _same_until(fn, lambda: setattr(Box, "extra", 1))
