"""A function's content as tokens that do not depend on where its source is written: what a
durable record of a computation (a sweep's store) keeps to tell, in another process and after
the script was edited, whether the function may compute something else.

A token is the walk of :mod:`daskdag.transport.walk` (what packing sends by value) recorded by
content: code by what it computes (bytecode, constants, names, arguments, flags), NumPy and JAX
arrays by dtype, shape and bytes, installed code by its module and name, a user's module by its
place in the order reached, and an installed wrapper around a user's function
(``jax.jit(f)``, ``functools.lru_cache``) as its kind and that function. Where the source is
(file, module name, lines), a function's own name, docstrings and annotations do not count: a
comment added above a function, or a script renamed or moved, keeps its tokens. Sets are taken
sorted, so that tokens are the same in every process.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import types

import jax
import numpy as np

from daskdag.transport.walk import (Unwatchable, Walk, array_content, cell_contents, names,
                                    reduction)
from daskdag.transport.whose import by_reference, users

_CO_HAS_DOCSTRING = 0x4000000  # (Python 3.14 on; before, a def's first constant is its docstring)


def parts(fn, digests: dict | None = None) -> dict[str, str]:
    """``fn``'s content as tokens by part: ``"code"``, ``"global NAME"`` for each global its
    code reads, ``"closure NAME"`` for each value it closes over, ``"defaults"``, and
    ``"attributes"`` where it has any. A callable that is not a plain function of the user's (a
    ``functools.partial``, a jitted function, ``jax.numpy.tanh``) is one part, ``"function"``.

    ``digests``: ``{id: (array, digest)}`` of the arrays read already, added to: an array that
    several functions read is hashed once. Raises ``TypeError`` for a value that cannot be
    pickled (a lock)."""
    digests = {} if digests is None else digests
    if type(fn) is not types.FunctionType or not users(fn):
        return {"function": token(fn, digests)}
    code, namespace = fn.__code__, fn.__globals__

    def part(value) -> str:  # (what it reads of a module held by a part: its code names it)
        return token(value, digests, reader=code)

    out = {"code": token(code, digests)}
    out.update((f"global {name}", part(namespace[name])) for name in names(code)
               if name in namespace)  # (else a builtin, or a global not yet bound)
    out.update((f"closure {name}", part(cell_contents(cell)))
               for name, cell in zip(code.co_freevars, fn.__closure__ or ()))
    out["defaults"] = part((fn.__defaults__, fn.__kwdefaults__))
    if fn.__dict__:
        out["attributes"] = part(dict(fn.__dict__))
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
    """SHA-256 of ``obj``'s content (``digests`` as for :func:`parts`), the user's modules it
    reaches read by the attribute names its code, and ``reader``'s (the code that holds
    ``obj``), may read."""
    walk = _Content(obj, {} if digests is None else digests)
    if reader is not None:
        walk.reads(reader)
    try:
        walk.walk()
    except Unwatchable as e:
        raise TypeError(str(e)) from None
    return hashlib.sha256(repr(walk.facts).encode()).hexdigest()


def array_digest(a) -> bytes:
    """SHA-256 of an array's dtype, shape and bytes (a JAX array's copied to the host)."""
    a = np.ascontiguousarray(np.asarray(a))
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.data)
    return h.digest()


class _Content(Walk):
    """The walk, recording by content what it does not go into."""

    __slots__ = ("digests",)

    def __init__(self, root, digests: dict):
        super().__init__(root)
        self.digests = digests

    def digest(self, a) -> bytes:
        kept = self.digests.get(id(a))
        if kept is None or kept[0] is not a:
            kept = self.digests[id(a)] = (a, array_content(np.asarray(a)))  # (kept: id unique)
        return kept[1]

    def by_value(self, cls: type) -> bool:  # (installed code's, found under no name: named)
        return users(cls)

    def opened(self, obj, at: str) -> None:
        self.facts.append(("class", obj.__name__) if isinstance(obj, type) else "function")

    def leaf(self, obj, at: str) -> None:
        if isinstance(obj, jax.Array):
            self.facts.append(("array", obj.shape, obj.dtype.str, self.digest(obj)))
        elif isinstance(obj, types.CodeType):
            self.facts.append(_code_form(obj))
        elif isinstance(obj, types.ModuleType):
            entry = self.modules.get(id(obj))
            self.facts.append(("module", obj.__name__ if entry is None else entry[3]))
        else:
            name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
            self.facts.append(("named", getattr(obj, "__module__", None),
                               name if isinstance(name, str) else reduction(obj)[1]))

    def instance(self, obj, at: str) -> None:
        wrapped = getattr(obj, "__wrapped__", None) if callable(obj) else None
        if type(wrapped) is types.FunctionType and by_reference(type(obj)):
            # An installed wrapper around a user's function (``jax.jit(f)``): the function, not
            # the wrapper's internals (``jax.jit`` keeps where ``f`` is written).
            self.facts.append("wrapped")
            self(type(obj), at)
            self(wrapped, at)
            return
        super().instance(obj, at)


def _code_form(code: types.CodeType) -> tuple:
    """What a code object computes: all but its file, name, first line and line table."""
    consts = [_const(c) for c in code.co_consts]
    if _has_docstring(code):
        consts[0] = None
    return (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
            code.co_code, tuple(consts), code.co_names, code.co_varnames, code.co_freevars,
            code.co_cellvars, code.co_exceptiontable)


def _const(c):
    if isinstance(c, types.CodeType):
        return _code_form(c)
    if type(c) is tuple:
        return tuple(_const(v) for v in c)
    if type(c) is frozenset:  # (sorted: string hashing differs between processes)
        return "frozenset", tuple(sorted((_const(v) for v in c), key=repr))
    return c


def _has_docstring(code: types.CodeType) -> bool:
    """Whether the code's first constant is its docstring: a ``def``'s body (not a lambda's,
    a comprehension's or a class body's) whose first constant is a string."""
    if sys.version_info >= (3, 14):
        return bool(code.co_flags & _CO_HAS_DOCSTRING)
    return (bool(code.co_flags & inspect.CO_OPTIMIZED) and not code.co_name.startswith("<")
            and bool(code.co_consts) and isinstance(code.co_consts[0], str))
