"""Whose code travels by value, and a function's fingerprint: what its behaviour depends on, as
packing sees it (:mod:`daskdag.transport.packing`), read again and compared in microseconds
instead of pickled again in a millisecond.

Packing pickles the user's functions by value: their code, the globals and closure cells they
use, their defaults, and whatever those hold, arrays by content. A :class:`Fingerprint` walks
the same objects and keeps, for each, what can change under the same name:

- numbers, strings, bytes, ``None``: their value;
- NumPy arrays (which change in place): shape, dtype and content (the bytes of a small one, a
  SHA-1 digest of a larger one: hashing runs at memory speed, so a check costs in proportion
  to the arrays a function closes over);
- JAX arrays (immutable), code objects, modules, and functions, classes and other objects that
  installed packages define and that pickle by reference: their identity (each is kept
  referenced, so its id cannot be reused while the fingerprint lives);
- containers (tuples, lists, dicts, sets): their length and keys, then their items;
- the user's functions and classes (by value): their identity, then their code, the globals
  their code names, closure cells, defaults and attributes;
- other objects: what pickling them would save (``copyreg``'s table, else ``__reduce_ex__``),
  else their ``__dict__``;
- the user's modules (:func:`is_user_module`), however they are reached (a global, a closure
  cell, an object's attribute, a container's item, another module's attribute): their identity,
  then each attribute that some code the walk went through may read by name (its names, and the
  identifier-like strings among its constants, for ``getattr(module, "NAME")``), until no new
  name or module turns up; every attribute but the dunder ones where such code names
  ``getattr``, ``vars`` or ``__dict__`` (a name computed as it runs). Other modules are taken by
  their identity alone.

Two fingerprints of one function are equal when nothing that packing would see has changed: an
array changed in place, a global rebound, a closure cell or an attribute set, a list or dict
changed... each makes them differ. An object that none of these rules can read (a lock, an
open file, a generator) makes the function *unwatchable*: :func:`fingerprint` returns ``None``
and callers must not reuse anything derived from the function's content.
"""

from __future__ import annotations

import copyreg
import hashlib
import os
import site
import sys
import sysconfig
import types
from functools import cache, lru_cache
from typing import Any

import jax
import numpy as np

from daskdag.caches import Cache, register
from daskdag.transport.weak import Weak

LIMIT = 200_000  # facts a fingerprint may hold; beyond it, the function is unwatchable
SMALL = 256  # bytes: a NumPy array up to this size is compared by its bytes, not a digest
_ATOMS = frozenset((type(None), bool, int, float, complex, str, bytes, type(Ellipsis),
                    type(NotImplemented)))
_CONTAINERS = frozenset((tuple, list, dict, set, frozenset))
_ABSENT = ("absent",)  # a name a function's code uses that its globals do not hold (yet)
_EMPTY = ("empty cell",)
#: The names by which code reads an attribute whose name it computes as it runs.
DYNAMIC_ATTRIBUTES = frozenset(("getattr", "vars", "__dict__"))


class Unwatchable(Exception):
    """An object whose content a fingerprint cannot read."""


class Fingerprint:
    """What a function's behaviour depends on, at one moment (see the module's docstring).
    ``facts`` are compared; ``refs`` keep every object whose identity is a fact alive, so
    that no id in ``facts`` can name another object while this fingerprint exists."""

    __slots__ = ("facts", "refs")

    def __init__(self, facts: list, refs: list):
        self.facts, self.refs = facts, refs

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fingerprint) and self.facts == other.facts

    def digest(self) -> str:
        """Its facts as a hash (for a token that must differ where they do)."""
        return hashlib.sha1(repr(self.facts).encode()).hexdigest()

    __hash__ = None  # type: ignore[assignment]  # (equal by content; never a key)


def fingerprint(obj: Any) -> Fingerprint | None:
    """``obj``'s fingerprint now, or ``None`` when some object it holds cannot be read. It
    keeps alive what it holds by identity, but not ``obj`` itself: its holder knows it."""
    walk = _Walk(obj.target if isinstance(obj, Weak) else obj)
    try:
        walk.walk()
    except (Unwatchable, RecursionError):
        return None
    return Fingerprint(walk.facts, walk.refs)


class _Walk:
    __slots__ = ("facts", "refs", "seen", "walked", "root", "weakly", "read", "modules",
                 "anything")

    def __init__(self, root):
        self.facts: list = []
        self.refs: list = []  # what facts name by identity: kept with them
        self.seen: dict[int, int] = {}
        self.walked: list = []  # what the walk went through: kept while it goes (ids unique)
        self.root = root
        self.weakly: set[int] = set()  # functions held weakly (Weak): not kept alive here
        self.read: set[str] = set()  # the attribute names the code walked through may read
        self.modules: dict[int, tuple] = {}  # id -> (a user's module reached, names read of it)
        self.anything = False  # some code may read any attribute (getattr with a computed name)

    def walk(self) -> None:
        """The root, then the user's modules it reached, by the names its code reads, until
        neither the names nor the modules grow (what a module's attribute holds may read more
        names, or reach another module)."""
        self(self.root)
        grown = True
        while grown:
            grown = False
            for module, done in list(self.modules.values()):
                wanted = self.read
                if self.anything:
                    wanted = wanted | {k for k in vars(module) if not k.startswith("__")}
                todo = sorted(wanted - done)
                if not todo:
                    continue
                grown = True
                done.update(todo)
                self.facts.append(("module", module.__name__))
                for attribute in todo:
                    self.facts.append(attribute)
                    self(getattr(module, attribute, _ABSENT))

    def identity(self, obj) -> None:
        if obj is self.root:
            self.facts.append("root")
            return
        self.facts.append(id(obj))
        if id(obj) not in self.weakly:  # (one held weakly goes with what holds it)
            self.refs.append(obj)

    def __call__(self, obj) -> None:
        facts, kind = self.facts, type(obj)
        if len(facts) > LIMIT:
            raise Unwatchable("too large")
        if kind in _ATOMS:
            facts.append((kind, obj))
            return
        if kind is np.ndarray and not obj.dtype.hasobject:
            facts.append(("ndarray", obj.shape, obj.dtype.str, _content(obj)))
            return
        if isinstance(obj, (jax.Array, types.CodeType)):
            self.identity(obj)
            return
        if isinstance(obj, types.ModuleType):
            self.identity(obj)
            if id(obj) not in self.modules and is_user_module(obj.__name__):
                self.modules[id(obj)] = (obj, set())  # (its attributes: read in walk())
            return
        if kind is Weak:  # (a preparation's hold on a function: the function itself)
            target = obj.target
            self.weakly.add(id(target))
            self.walked.append(target)
            self(target)
            return
        at = self.seen.get(id(obj))
        if at is not None:  # (a cycle, or an object reached twice: once is enough)
            facts.append(("again", at))
            return
        self.seen[id(obj)] = len(self.seen)
        self.walked.append(obj)  # (so that its id stays its own while the walk goes on)
        if kind in _CONTAINERS:  # (a subclass pickles as its reduce says: below)
            self.container(obj)
        elif kind is types.FunctionType:
            self.identity(obj)
            if not by_reference(obj):
                self.function(obj)
        elif isinstance(obj, type):
            self.identity(obj)
            if not by_reference(obj):
                self.cls(obj)
        elif by_reference(obj):
            self.identity(obj)
        else:
            self.instance(obj)

    def container(self, obj) -> None:
        if type(obj) is dict:
            self.facts.append((type(obj), len(obj)))
            for k, v in obj.items():
                self(k)
                self(v)
            return
        if type(obj) in (set, frozenset):
            obj = sorted(obj, key=repr)  # (an order that does not depend on insertion)
        self.facts.append((type(obj), len(obj)))
        for v in obj:
            self(v)

    def function(self, fn: types.FunctionType) -> None:
        code, facts = fn.__code__, self.facts
        self.identity(code)
        self.read.update(attributes(code))
        if not self.anything and not DYNAMIC_ATTRIBUTES.isdisjoint(names(code)):
            self.anything = True
        namespace = fn.__globals__
        for name in names(code):
            value = namespace.get(name, _ABSENT)
            facts.append(name)
            if value is _ABSENT:
                facts.append(_ABSENT)
                continue
            self(value)
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # not yet set
                facts.append(_EMPTY)
            else:
                self(contents)
        self(fn.__defaults__)
        self(fn.__kwdefaults__)
        if fn.__dict__:
            self(fn.__dict__)

    def cls(self, cls: type) -> None:
        self(cls.__bases__)
        for name, value in vars(cls).items():
            if name not in ("__dict__", "__weakref__", "__doc__"):
                self.facts.append(name)
                self(value)

    def instance(self, obj) -> None:
        reduce = copyreg.dispatch_table.get(type(obj))
        try:
            reduced = reduce(obj) if reduce is not None else obj.__reduce_ex__(5)
        except Exception:
            reduced = None
        if isinstance(reduced, str):  # a global, pickled by its name
            self.identity(obj)
            return
        if isinstance(reduced, tuple):
            self.facts.append("reduced")
            self(tuple(item if not isinstance(item, types.GeneratorType) and
                       not hasattr(item, "__next__") else list(item) for item in reduced))
            return
        state = getattr(obj, "__dict__", None)
        if state is None:
            raise Unwatchable(f"cannot read a {type(obj).__qualname__}")
        self(type(obj))
        self(state)


def _content(a: np.ndarray) -> bytes:
    if a.nbytes <= SMALL:
        return a.tobytes()
    return hashlib.sha1(np.ascontiguousarray(a).data).digest()


@lru_cache(maxsize=8192)
def names(code: types.CodeType) -> tuple[str, ...]:
    """The global names ``code`` (and the code nested in it: lambdas, comprehensions) may read."""
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.update(names(const))
    return tuple(sorted(found))


@lru_cache(maxsize=8192)
def attributes(code: types.CodeType) -> frozenset[str]:
    """The attribute names ``code`` (and the code nested in it) may read of a module: its names,
    and its string constants that are identifiers (``getattr(module, "SCALE")``)."""
    found = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.update(attributes(const))
        elif isinstance(const, str) and const.isidentifier():
            found.add(const)
    return frozenset(found)


def by_reference(obj) -> bool:
    """An object that pickles by reference: an installed package's function, class or other
    object found under its own module and name (``jax.numpy.sin``), which the receiving side
    imports. The user's own code (:func:`is_user_module`) and objects made inside functions
    travel by value."""
    module = getattr(obj, "__module__", None)
    try:
        name = obj.__qualname__
    except AttributeError:
        name = getattr(obj, "__name__", None)
    if not isinstance(module, str) or not isinstance(name, str) or "<locals>" in name \
            or is_user_module(module):
        return False
    found = sys.modules.get(module)
    for part in name.split("."):
        found = getattr(found, part, None)
        if found is None:
            return False
    return found is obj


# -- whose code travels by value ------------------------------------------------------------------

@cache
def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= set(site.getsitepackages()) | {site.getusersitepackages()}
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


_decided: Cache[bool] = Cache("whose modules are the user's", 4096)  # (name, file) -> decided
def _forget_names() -> None:
    names.cache_clear()
    attributes.cache_clear()


register("names read by code objects", _forget_names)


def is_user_module(name: str) -> bool:
    """Whether module ``name`` is the user's own code (travels by value), not installed code
    (travels by reference, so the cluster must have it installed). daskdag is installed code
    on every worker, even from an editable checkout."""
    if name == "__main__":
        return True
    module = sys.modules.get(name)
    file: Any = getattr(module, "__file__", None)

    def decide() -> bool:
        return (bool(file) and name.partition(".")[0] != "daskdag"
                and not os.path.realpath(file).startswith(_installed_roots()))

    return _decided.setdefault((name, file), decide)
