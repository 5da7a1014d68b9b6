"""A function's content tokens (:mod:`daskdag.transport.content`): the same wherever its source is
written (file, module name, line numbers, docstrings) and in every process; another where what
it computes may change, in the part that changed."""

import os
import subprocess
import sys
import textwrap
import threading
import types

import numpy as np
import pytest

from daskdag.transport.content import describe, parts, token

SOURCE = '''
import numpy as np
import jax.numpy as jnp

SCALE = 2.0
NAMES = {"alpha", "beta", "gamma"}
W = np.arange(4.0)


def helper(x):
    """A helper."""
    return x * SCALE


def make(w):
    def inner(x, k=3):
        """Closes over w."""
        def nested(y):
            return y + 1.0
        if "beta" in NAMES and "delta" not in {"delta", "epsilon"}:
            x = x - 1.0
        return nested(helper(x)) * w + k
    return inner


f = make(W)
'''

_loaded = iter(range(10 ** 6))


def module(source: str = SOURCE, filename: str = "/project/script.py", head: str = ""):
    """``source`` run as a fresh module from ``filename``, ``head`` (comments, blank lines)
    above it."""
    m = types.ModuleType(f"content_test_{next(_loaded)}")
    m.__file__ = filename
    sys.modules[m.__name__] = m
    exec(compile(head + source, filename, "exec"), m.__dict__)
    return m


def changed(a, b) -> set[str]:
    pa, pb = parts(a), parts(b)
    return {k for k in set(pa) | set(pb) if pa.get(k) != pb.get(k)}


def test_where_the_source_is_written_does_not_count():
    first = module()
    moved = module(SOURCE.replace('"""A helper."""', '"""A helper, its docstring edited."""')
                   .replace('"""Closes over w."""', '"""Its docstring edited too."""'),
                   "/elsewhere/renamed.py", head="# a comment\n\n\n# another\n")
    assert first.f.__code__.co_firstlineno != moved.f.__code__.co_firstlineno
    assert sorted(parts(first.f)) == ["closure w", "code", "defaults", "global NAMES",
                                      "global helper"]
    assert parts(first.f) == parts(moved.f)


@pytest.mark.parametrize("edit, part", [
    (lambda m: SOURCE.replace("x - 1.0", "x - 2.0"), "code"),
    (lambda m: SOURCE.replace("y + 1.0", "y + 1.5"), "code"),  # a nested function's code
    (lambda m: SOURCE.replace('"epsilon"', '"zeta"'), "code"),  # a set among the constants
    (lambda m: SOURCE.replace("k=3", "k=4"), "defaults"),
    (lambda m: setattr(m, "SCALE", 3.0), "global helper"),  # what a global function reads
    (lambda m: setattr(m, "NAMES", {"alpha"}), "global NAMES"),
    (lambda m: m.W.__setitem__(0, 9.0), "closure w"),  # an array closed over, changed in place
    (lambda m: setattr(m.f, "tag", 1), "attributes"),
])
def test_what_it_computes_counts_in_the_part_that_changed(edit, part):
    first, second = module(), module()
    source = edit(second)
    if source is not None:
        second = module(source)
    assert changed(first.f, second.f) == {part}


@pytest.mark.subprocess
def test_tokens_are_the_same_in_every_process():
    """String hashing differs between processes (sets of strings iterate in another order)."""
    script = textwrap.dedent(f"""
        import sys, types
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent.parent)!r})
        from daskdag.transport.content import parts
        m = types.ModuleType("content_probe")
        m.__file__ = "/project/script.py"
        sys.modules["content_probe"] = m
        exec(compile({SOURCE!r}, m.__file__, "exec"), m.__dict__)
        print(sorted(parts(m.f).items()))
    """)
    seen = {subprocess.run([sys.executable, "-c", script],
                           env={**os.environ, "PYTHONHASHSEED": str(seed)},
                           capture_output=True, text=True, check=True).stdout
            for seed in (1, 2, 3)}
    assert len(seen) == 1
    assert seen.pop().strip() == str(sorted(parts(module().f).items()))


def test_arrays_count_by_content_and_other_callables_are_one_part():
    import functools

    import jax

    m = module()
    assert token(np.arange(3.0)) == token(np.arange(3.0)) != token(np.arange(3.0) + 1)
    assert token(jax.numpy.arange(3.0)) != token(jax.numpy.arange(3.0) + 1)
    partial = functools.partial(m.f, k=2)
    jitted = jax.jit(m.helper)
    assert list(parts(partial)) == ["function"] and list(parts(jitted)) == ["function"]
    moved = module(filename="/elsewhere/other.py", head="\n\n")
    assert parts(jax.jit(moved.helper)) == parts(jitted)
    assert parts(functools.partial(moved.f, k=2)) == parts(partial)
    assert parts(functools.partial(moved.f, k=3)) != parts(partial)


def test_parts_in_words():
    assert [describe(p) for p in ["code", "global SCALE", "closure w", "defaults",
                                  "attributes", "function"]] == [
        "its code", "the global 'SCALE'", "the value it closes over, 'w'", "its defaults",
        "its attributes", "the function"]


def test_what_cannot_be_pickled_raises():
    lock = threading.Lock()

    def holds_a_lock(x):
        with lock:
            return x

    with pytest.raises(TypeError, match="lock"):
        parts(holds_a_lock)


HOLDERS = '''
class Box:
    def __init__(self, mod):
        self.mod = mod

    def __call__(self, x):
        return x * self.mod.SCALE


def by_closure(mod):
    return lambda x: x * mod.SCALE


def by_name(mod, first, rest):
    return lambda x: x * getattr(mod, first + rest)
'''


@pytest.mark.parametrize("hold, reads_all", [
    (lambda code, params: code.by_closure(params), False),
    (lambda code, params: code.by_closure({"m": [params]}["m"][0]), False),
    (lambda code, params: code.Box(params), False),
    (lambda code, params: code.by_name(params, "SC", "ALE"), True),
])
def test_a_module_of_the_users_counts_however_it_is_reached(hold, reads_all):
    """A module reached through a closure, a container or an object: what the code reads of it
    counts (all of it where a name is computed as it runs), what it does not read does not."""
    params, code = module("SCALE = 1.5\nOTHER = 1\n"), module(HOLDERS)
    fn = hold(code, params)
    before = parts(fn)
    params.OTHER = 2
    assert (parts(fn) != before) == reads_all
    params.OTHER = 1
    params.SCALE = -2.0
    assert parts(fn) != before
    params.SCALE = 1.5
    assert parts(fn) == before


def test_classes_count_by_what_pickling_saves_of_them():
    """A class with a property, slots or an ABC base is read (pickling saves it); its
    attributes count, where it is written does not."""
    source = '''
import abc


class Shape(abc.ABC):
    __slots__ = ("side",)
    scale = 1.0

    @property
    def area(self):
        return self.side ** 2 * self.scale


def area(side):
    return Shape.scale * side
'''
    first, moved = module(source), module(source, "/elsewhere/other.py", head="# moved\n")
    assert parts(first.area) == parts(moved.area)
    moved.Shape.scale = 2.0
    assert changed(first.area, moved.area) == {"global Shape"}
