"""A function's content as tokens that do not depend on where its source is written: what a
durable record of a computation (a sweep's store) keeps to tell, in another process and after
the script was edited, whether the function may compute something else.

:func:`parts` gives a function's tokens by part (its code, each global it reads, each value it
closes over, its defaults, its attributes), so that a caller can say which part changed;
:func:`token` is the same token for any value.

What counts, as packing (:mod:`daskdag.transport.packing`) sends it to a cluster, by value:

- code: the bytecode, its constants (nested functions' code too), the names it uses, its
  arguments and flags;
- the globals its code (and the code nested in it) reads, by name, with their values;
- a module of the user's, however it is reached: the attributes that the code taken into the
  token may read, as a fingerprint reads them (:mod:`daskdag.transport.fingerprints`);
- the values it closes over, its defaults, its attributes (``__dict__``: ``__wrapped__`` too);
- those values in turn: NumPy and JAX arrays by content (dtype, shape, bytes), the user's
  functions and classes as above, installed code (``jax.numpy.sin``) by its module and name,
  a wrapper from an installed package around a function of the user's (``jax.jit(f)``,
  ``functools.lru_cache``) as its kind and that function; other objects as pickling them
  saves them.

What does not count: where the source is (file, module name, lines, columns), the function's
own name, docstrings and annotations. So a comment added above a function, a script renamed or
moved, or a function's text copied into another module keep its tokens. Sets are taken sorted,
so that tokens are the same in every process (string hashing differs between processes).
"""

from __future__ import annotations

import hashlib
import inspect
import io
import sys
import types
from typing import Any

import numpy as np

from daskdag.transport.fingerprints import DYNAMIC_ATTRIBUTES, attributes, names
from daskdag.transport.pickler import Pickler
from daskdag.transport.whose import by_reference, users, users_module

_NOT_IN_CLASS = frozenset(("__module__", "__qualname__", "__doc__", "__dict__", "__weakref__",
                           "__firstlineno__", "__static_attributes__", "_abc_impl"))
_ABSENT = object()
_CO_HAS_DOCSTRING = 0x4000000  # (Python 3.14 on; before, a def's first constant is its docstring)


def parts(fn, digests: dict | None = None) -> dict[str, str]:
    """``fn``'s content as tokens by part (see the module's docstring): ``"code"``, ``"global
    NAME"`` for each global its code reads, ``"closure NAME"`` for each value it closes over,
    ``"defaults"``, and ``"attributes"`` where it has any. A callable that is not a plain
    function of the user's (a ``functools.partial``, a jitted function, a callable object,
    ``jax.numpy.tanh``) is one part, ``"function"``.

    ``digests``: ``{id: (array, digest)}`` of the arrays hashed already, added to: an array
    that several functions read is hashed once.

    Raises what pickling raises for a value that cannot be pickled (a lock, an open file).
    """
    digests = {} if digests is None else digests
    if type(fn) is not types.FunctionType or not users(fn):
        return {"function": token(fn, digests)}
    state = _function_state(fn)
    code = fn.__code__  # (what it reads of a module held by a part: its code names it)

    def part(value) -> str:
        return token(value, digests, reader=code)

    out = {"code": token(code, digests)}
    out.update((f"global {name}", part(value)) for name, value in state["globals"].items())
    out.update((f"closure {name}", part(value))
               for name, value in zip(code.co_freevars, state["closure"]))
    out["defaults"] = part((state["defaults"], state["kwdefaults"]))
    if state["attributes"]:
        out["attributes"] = part(state["attributes"])
    return out


def describe(part: str) -> str:
    """A part of :func:`parts` in words, for a message: ``"global SCALE"`` is ``"the global
    'SCALE'"``."""
    kind, _, name = part.partition(" ")
    if kind == "global":
        return f"the global {name!r}"
    if kind == "closure":
        return f"the value it closes over, {name!r}"
    return {"code": "its code", "defaults": "its defaults", "attributes": "its attributes",
            "function": "the function"}.get(part, part)


def token(obj, digests: dict | None = None, reader: types.CodeType | None = None) -> str:
    """SHA-256 of ``obj`` as :class:`_Canonical` pickles it, arrays by content
    (:func:`array_digest`; ``digests`` as for :func:`parts`), then the user's modules it
    reaches, by the attributes that its code, and ``reader``'s (the code that holds ``obj``),
    may read (see the module's docstring)."""
    digests = {} if digests is None else digests
    arrays: list = []
    buffer = io.BytesIO()
    pickler = _Canonical(buffer, arrays)
    if reader is not None:
        pickler.reads(reader)
    pickler.dump(_stable(obj))
    pickler.follow_modules()
    h = hashlib.sha256(buffer.getvalue())
    for a in arrays:
        kept = digests.get(id(a))
        if kept is None or kept[0] is not a:
            kept = digests[id(a)] = (a, array_digest(a))  # (kept alive: its id stays its own)
        h.update(kept[1])
    return h.hexdigest()


def array_digest(a) -> bytes:
    """SHA-256 of an array's dtype, shape and bytes (a JAX array's copied to the host)."""
    a = np.ascontiguousarray(np.asarray(a))
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.data)
    return h.digest()


class _Canonical(Pickler):
    """daskdag's pickler, pickling code, the user's functions, classes and modules by what they
    compute, not where they are written; its bytes are hashed, never loaded. A user's module is
    pickled as its place in the order reached; :meth:`follow_modules` pickles what is read of it."""

    def __init__(self, file, arrays: list):
        super().__init__(file, arrays)
        self.read: set[str] = set()  # attribute names the code pickled may read
        self.anything = False  # some of it reads attributes by names it computes
        self.modules: dict[int, tuple] = {}  # id -> (a user's module, its place, names taken)

    def reads(self, code: types.CodeType) -> None:
        """Take the names ``code`` may read of a module (it is pickled, or holds what is)."""
        self.read |= attributes(code)
        self.anything = self.anything or not DYNAMIC_ATTRIBUTES.isdisjoint(names(code))

    def follow_modules(self) -> None:
        """Pickle, after the rest, each user's module's attributes that the code pickled may
        read, by place and name, until no new name or module turns up."""
        grown = True
        while grown:
            grown = False
            for module, place, done in list(self.modules.values()):
                wanted = self.read | ({k for k in vars(module) if not k.startswith("__")}
                                      if self.anything else set())
                todo = sorted(wanted - done)
                if todo:
                    grown = True
                    done.update(todo)
                    self.dump(_stable((place, {name: getattr(module, name, _missing)
                                               for name in todo})))

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            self.reads(obj)
            return _code, _code_form(obj)
        if type(obj) is types.FunctionType and users(obj):
            # Its state after it (pickle's memo then knows it): a function that reaches
            # itself (recursion through a global) pickles once.
            return _function, (obj.__code__,), _stable(_function_state(obj))
        if isinstance(obj, type) and not by_reference(obj):
            if not users(obj):  # installed code's, not found under its name (``jax.Array``):
                # by its name still (cloudpickle would pickle it by value, under a random id)
                return _named, (obj.__module__, obj.__qualname__)
            return _class, (type(obj), obj.__name__, obj.__bases__), _stable(_class_state(obj))
        if isinstance(obj, types.ModuleType) and users_module(obj.__name__):
            if id(obj) not in self.modules:
                self.modules[id(obj)] = (obj, len(self.modules), set())
            return _module, (self.modules[id(obj)][1],)  # (what is read of it: follow_modules)
        wrapped = getattr(obj, "__wrapped__", None) if callable(obj) else None
        if type(wrapped) is types.FunctionType and by_reference(type(obj)) \
                and not by_reference(obj):
            # An installed wrapper around a user's function (``jax.jit(f)``): the function, not
            # the wrapper's internals (``jax.jit`` keeps where ``f`` is written).
            return _wrapped, (type(obj), wrapped)
        return super().reducer_override(obj)


def _code_form(code: types.CodeType) -> tuple:
    """What a code object computes: all but its file, name, first line and line table."""
    consts = list(code.co_consts)
    if _has_docstring(code):
        consts[0] = None
    return (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
            code.co_code, tuple(_stable(c) for c in consts), code.co_names, code.co_varnames,
            code.co_freevars, code.co_cellvars, code.co_exceptiontable)


def _has_docstring(code: types.CodeType) -> bool:
    """Whether the code's first constant is its docstring: a ``def``'s body (not a lambda's,
    a comprehension's or a class body's) whose first constant is a string."""
    if sys.version_info >= (3, 14):
        return bool(code.co_flags & _CO_HAS_DOCSTRING)
    return (bool(code.co_flags & inspect.CO_OPTIMIZED) and not code.co_name.startswith("<")
            and bool(code.co_consts) and isinstance(code.co_consts[0], str))


def _function_state(fn: types.FunctionType) -> dict:
    """What a user's function computes with, besides its code: the globals its code reads
    (sorted by name), the values it closes over (in ``co_freevars`` order), its defaults and
    attributes."""
    read, namespace = names(fn.__code__), fn.__globals__
    found = {name: namespace[name] for name in read
             if name in namespace}  # (else a builtin, or an attribute's name)
    closure = []
    for cell in fn.__closure__ or ():
        try:
            closure.append(cell.cell_contents)
        except ValueError:  # (not set yet)
            closure.append(("empty cell",))
    return {"globals": found, "closure": tuple(closure), "defaults": fn.__defaults__,
            "kwdefaults": fn.__kwdefaults__, "attributes": dict(fn.__dict__)}


def _class_state(cls: type) -> dict:
    """A class's own attributes, as cloudpickle keeps them (less those its bases hold, which a
    metaclass may copy in, its slots' descriptors), less where it is written and its
    docstring."""
    inherited: dict = {}
    for base in reversed(cls.__bases__):
        inherited.update(vars(base))
    slots = cls.__dict__.get("__slots__", ())
    slots = (slots,) if isinstance(slots, str) else tuple(slots)
    return {k: v for k, v in vars(cls).items()
            if k not in _NOT_IN_CLASS and k not in slots and inherited.get(k, _ABSENT) is not v}


def _stable(value, seen: dict | None = None):
    """``value`` with its sets (in plain tuples, lists and dicts, at any depth) as sorted
    tuples, so that it pickles to the same bytes in every process."""
    seen = {} if seen is None else seen
    kind = type(value)
    if kind not in (set, frozenset, tuple, list, dict):
        return value
    if id(value) in seen:
        return seen[id(value)]
    if kind in (set, frozenset):
        items = [_stable(v, seen) for v in value]
        out: Any = ("set" if kind is set else "frozenset", tuple(sorted(items, key=repr)))
    elif kind is dict:
        out = {}
        seen[id(value)] = out
        out.update((k, _stable(v, seen)) for k, v in value.items())
    elif kind is list:
        out = []
        seen[id(value)] = out
        out.extend(_stable(v, seen) for v in value)
    else:
        out = tuple(_stable(v, seen) for v in value)
    seen[id(value)] = out
    return out


# What the canonical pickles name as their callables (never called: the bytes are only hashed).

def _code(*form):
    raise NotImplementedError


def _function(code):
    raise NotImplementedError


def _class(metaclass, name, bases):
    raise NotImplementedError


def _module(place):
    raise NotImplementedError


def _missing():
    """An attribute a module of the user's does not hold (yet)."""
    raise NotImplementedError


def _named(module, qualname):
    raise NotImplementedError


def _wrapped(kind, fn):
    raise NotImplementedError
