"""A function's fingerprint: what its behaviour depends on, as packing sees it
(:mod:`daskdag.transport.packing`), read again and compared far faster than pickling it again.

Packing pickles the user's functions by value: their code, the globals and closure cells they
use, their defaults, and whatever those hold. A :class:`Fingerprint` walks the same objects and
keeps, for each, what can change under the same name:

- numbers, strings, bytes, ``None``: their value;
- NumPy arrays (which change in place): shape, dtype and content (a small one's bytes, a larger
  one's SHA-1 digest);
- JAX arrays (immutable), code objects, modules, and functions, classes and other objects that
  installed packages define and that pickle by reference: their identity (each is kept
  referenced, so its id cannot be reused while the fingerprint lives);
- containers (tuples, lists, dicts, sets): their length and keys, then their items;
- the user's functions and classes (by value): their identity, then their code, the globals
  their code names, closure cells, defaults and attributes;
- other objects: what pickling them would save (``copyreg``'s table, else ``__reduce_ex__``),
  else their ``__dict__``;
- the user's modules (:func:`~daskdag.transport.whose.users_module`), however they are
  reached (a global, a closure cell, an object's attribute, a container's item, another
  module's attribute): their identity, then each attribute that some code the walk went through may read by name (its names, and the
  identifier-like strings among its constants, for ``getattr(module, "NAME")``), until no new
  name or module turns up; every attribute but the dunder ones where such code names
  ``getattr``, ``vars`` or ``__dict__`` (a name computed as it runs). Other modules are taken by
  their identity alone.

Two fingerprints of one function are equal when nothing that packing would see has changed. An
object none of these rules can read (a lock, an open file, a generator) makes the function
*unwatchable*: :func:`fingerprint` returns ``None`` and callers must not reuse anything derived
from the function's content.
"""

from __future__ import annotations

import copyreg
import hashlib
import sys
import types
from functools import cache, lru_cache
from typing import Any, Callable

import jax
import numpy as np

from daskdag.caches import Cache, register
from daskdag.transport.weak import Weak
from daskdag.transport.whose import by_reference, users_module

LIMIT = 200_000  # facts a fingerprint may hold; beyond it, the function is unwatchable
SMALL = 256  # bytes: a NumPy array up to this size is compared by its bytes, not a digest
CHECK_LINES = 20_000  # the longest check compiled; beyond it, a fingerprint is taken anew
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
    ``facts`` are compared; ``refs`` keep alive every object whose identity is a fact, so that
    no id in ``facts`` can name another object while this fingerprint exists."""

    __slots__ = ("facts", "refs", "_check")

    def __init__(self, facts: list, refs: list, check: Callable[[Any], bool] | None = None):
        self.facts, self.refs, self._check = facts, refs, check

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fingerprint) and self.facts == other.facts

    def holds(self, obj: Any) -> bool:
        """Whether ``obj`` (the function this was taken of) would have this fingerprint now: by
        the check compiled when it was taken, else by taking a new one."""
        root = obj.target if isinstance(obj, Weak) else obj
        if self._check is not None:
            try:
                return self._check(root)
            except Exception:  # (what changed broke a read: a different shape of object)
                return False
        return fingerprint(obj) == self

    def digest(self) -> str:
        """Its facts as a hash (for a token that must differ where they do)."""
        return hashlib.sha1(repr(self.facts).encode()).hexdigest()

    __hash__ = None  # type: ignore[assignment]  # (equal by content; never a key)


def fingerprint(obj: Any, checked: bool = False) -> Fingerprint | None:
    """``obj``'s fingerprint now, or ``None`` when some object it holds cannot be read. It
    keeps alive what it holds by identity, but not ``obj`` itself: its holder knows it.
    ``checked``: compile the check :meth:`Fingerprint.holds` runs (worth it only for a
    fingerprint checked many times)."""
    walk = _Walk(obj.target if isinstance(obj, Weak) else obj, checked)
    try:
        walk.walk()
    except (Unwatchable, RecursionError):
        return None
    return Fingerprint(walk.facts, walk.refs, walk.compiled())


class _Walk:
    """A fingerprint's walk (see the module's docstring). With ``checked``, it also writes, as
    it goes, the source of a check of the same facts (:meth:`Fingerprint.holds`): each object
    reached is bound to a variable of the check, read again from the root the way the walk read
    it (``at``: that variable), and compared with what the walk found (constants in
    ``consts``). The rules are written once, here: each fact appended has its test beside it.
    """

    __slots__ = ("facts", "refs", "seen", "walked", "root", "weakly", "read", "modules",
                 "anything", "lines", "consts", "names_of")

    def __init__(self, root, checked: bool = False):
        self.facts: list = []
        self.refs: list = []  # what facts name by identity: kept with them
        self.seen: dict[int, int] = {}
        self.walked: list = []  # what the walk went through: kept while it goes (ids unique)
        self.root = root
        self.weakly: set[int] = set()  # functions held weakly (Weak): not kept alive here
        self.read: set[str] = set()  # the attribute names the code walked through may read
        # id -> (a user's module reached, its variable in the check, the names read of it)
        self.modules: dict[int, tuple] = {}
        self.anything = False  # some code may read any attribute (getattr with a computed name)
        # the check's source (None: none is made, or it grew too long)
        self.lines: list[str] | None = [] if checked else None
        self.consts: list = []
        self.names_of: dict[int, str] = {}  # id of an object reached -> its variable

    def walk(self) -> None:
        """The root, then the user's modules it reached, by the names its code reads, until
        neither the names nor the modules grow (what a module's attribute holds may read more
        names, or reach another module)."""
        self(self.root, "root")
        grown = True
        while grown:
            grown = False
            for module, at, done in list(self.modules.values()):
                wanted = self.read
                if self.anything:
                    public = _public(module)
                    if self.lines is not None:
                        self.test(f"_public({at}) == {self.const(public)}")
                    wanted = wanted | public
                todo = sorted(wanted - done)
                if not todo:
                    continue
                grown = True
                done.update(todo)
                self.facts.append(("module", module.__name__))
                for attribute in todo:
                    self.facts.append(attribute)
                    self(getattr(module, attribute, _ABSENT),
                         self.bind(f"getattr({at}, {attribute!r}, _ABSENT)"))

    # -- the check's source (callers build what they write only while lines is not None) ----

    def test(self, condition: str) -> None:
        """The check returns False unless ``condition`` holds."""
        if self.lines is not None:
            self.lines.append(f"if not ({condition}): return False")

    def const(self, value) -> str:
        self.consts.append(value)
        return f"K[{len(self.consts) - 1}]"

    def bind(self, expr: str) -> str:
        """A new variable of the check, holding ``expr`` (``""`` when no check is made)."""
        lines = self.lines
        if lines is None:
            return ""
        if len(lines) > CHECK_LINES:
            self.lines = None
            return ""
        name = f"v{len(lines)}"
        lines.append(f"{name} = {expr}")
        return name

    def compiled(self) -> Callable[[Any], bool] | None:
        if self.lines is None:
            return None
        source = "def check(root):\n" + "".join(f"    {line}\n" for line in self.lines) + \
            "    return True\n"
        namespace = {"K": self.consts, **_CHECK_GLOBALS}
        exec(compile(source, "<daskdag fingerprint check>", "exec"), namespace)
        check: Callable[[Any], bool] = namespace["check"]  # type: ignore[assignment]
        return check

    # -- the walk -------------------------------------------------------------------------------

    def identity(self, obj, at: str) -> None:
        if obj is self.root:
            self.facts.append("root")
            if self.lines is not None:
                self.test(f"{at} is root")
            return
        self.facts.append(id(obj))
        held = id(obj) not in self.weakly  # (one held weakly goes with what holds it)
        if held:
            self.refs.append(obj)
        if self.lines is not None:
            self.test(f"{at} is {self.const(obj)}" if held else f"id({at}) == {id(obj)}")

    def __call__(self, obj, at: str) -> None:
        facts, kind, checked = self.facts, type(obj), self.lines is not None
        if len(facts) > LIMIT:
            raise Unwatchable("too large")
        if kind in _ATOMS:
            facts.append((kind, obj))
            if checked:
                value = self.const(obj)
                self.test(f"type({at}) is {self.const(kind)} and ({at} is {value} or "
                          f"{at} == {value})")
            return
        if kind is np.ndarray and not obj.dtype.hasobject:
            content = _content(obj)
            facts.append(("ndarray", obj.shape, obj.dtype.str, content))
            if checked:
                self.test(f"type({at}) is _ndarray and not {at}.dtype.hasobject and "
                          f"{at}.shape == {obj.shape!r} and {at}.dtype.str == {obj.dtype.str!r} "
                          f"and _content({at}) == {self.const(content)}")
            return
        if isinstance(obj, (jax.Array, types.CodeType)):
            self.identity(obj, at)
            return
        if isinstance(obj, types.ModuleType):
            self.identity(obj, at)
            if id(obj) not in self.modules and users_module(obj.__name__):
                self.modules[id(obj)] = (obj, at, set())  # (its attributes: read in walk())
            return
        if kind is Weak:  # (a preparation's hold on a function: the function itself)
            target = obj.target
            if checked:
                self.test(f"type({at}) is _Weak")
            self.weakly.add(id(target))
            self.walked.append(target)
            self(target, self.bind(f"{at}.target"))
            return
        seen = self.seen.get(id(obj))
        if seen is not None:  # (a cycle, or an object reached twice: once is enough)
            facts.append(("again", seen))
            if checked:
                self.test(f"{at} is {self.names_of[id(obj)]}")
            return
        self.seen[id(obj)] = len(self.seen)
        self.walked.append(obj)  # (so that its id stays its own while the walk goes on)
        if checked:
            self.names_of[id(obj)] = at
        if kind in _CONTAINERS:  # (a subclass pickles as its reduce says: below)
            self.container(obj, at)
        elif kind is types.FunctionType:
            self.identity(obj, at)
            if not by_reference(obj):
                self.function(obj, at)
        elif isinstance(obj, type):
            self.identity(obj, at)
            if not by_reference(obj):
                self.cls(obj, at)
        elif by_reference(obj):
            self.identity(obj, at)
        else:
            self.instance(obj, at)

    def container(self, obj, at: str) -> None:
        kind = type(obj)
        self.facts.append((kind, len(obj)))
        if self.lines is not None:
            self.test(f"type({at}) is {kind.__name__} and len({at}) == {len(obj)}")
        if kind is dict:
            items = self.bind(f"list({at}.items())")
            for j, (k, v) in enumerate(obj.items()):
                self(k, self.bind(f"{items}[{j}][0]"))
                self(v, self.bind(f"{items}[{j}][1]"))
            return
        if kind in (set, frozenset):
            obj = sorted(obj, key=repr)  # (an order that does not depend on insertion)
            at = self.bind(f"sorted({at}, key=repr)")
        for j, v in enumerate(obj):
            self(v, self.bind(f"{at}[{j}]"))

    def function(self, fn: types.FunctionType, at: str) -> None:
        code, facts, bind = fn.__code__, self.facts, self.bind
        self.identity(code, bind(f"{at}.__code__"))
        self.read.update(attributes(code))
        if not self.anything and not DYNAMIC_ATTRIBUTES.isdisjoint(names(code)):
            self.anything = True
        namespace = fn.__globals__
        scope = bind(f"{at}.__globals__")
        for name in names(code):
            value = namespace.get(name, _ABSENT)
            facts.append(name)
            read = bind(f"{scope}.get({name!r}, _ABSENT)")
            if value is _ABSENT:
                facts.append(_ABSENT)
                if self.lines is not None:
                    self.test(f"{read} is _ABSENT")
                continue
            self(value, read)
        cells = bind(f"{at}.__closure__ or ()")
        for j, cell in enumerate(fn.__closure__ or ()):
            contents = _cell(cell)
            if contents is _EMPTY:
                facts.append(_EMPTY)
                if self.lines is not None:
                    self.test(f"_cell({cells}[{j}]) is _EMPTY")
            else:
                self(contents, bind(f"_cell({cells}[{j}])"))
        self(fn.__defaults__, bind(f"{at}.__defaults__"))
        self(fn.__kwdefaults__, bind(f"{at}.__kwdefaults__"))
        if self.lines is not None:
            self.test(f"bool({at}.__dict__) is {bool(fn.__dict__)}")
        if fn.__dict__:
            self(fn.__dict__, bind(f"{at}.__dict__"))

    def cls(self, cls: type, at: str) -> None:
        self(cls.__bases__, self.bind(f"{at}.__bases__"))
        own = [(name, value) for name, value in vars(cls).items() if name not in _NOT_IN_CLASS]
        items = self.bind(f"[(k, v) for k, v in vars({at}).items() if k not in _NOT_IN_CLASS]")
        if self.lines is not None:
            self.test(f"len({items}) == {len(own)}")
        for j, (name, value) in enumerate(own):
            self.facts.append(name)
            if self.lines is not None:
                self.test(f"{items}[{j}][0] == {name!r}")
            self(value, self.bind(f"{items}[{j}][1]"))

    def instance(self, obj, at: str) -> None:
        how, reduced = _reduction(obj)
        again = self.bind(f"_reduction({at})")
        if self.lines is not None:
            self.test(f"{again}[0] == {how!r}")
        if how == "global":  # pickled by its name
            self.identity(obj, at)
            return
        if how == "reduced":
            self.facts.append("reduced")
        else:
            self(type(obj), self.bind(f"type({at})"))
        self(reduced, self.bind(f"{again}[1]"))


def _reduction(obj) -> tuple[str, Any]:
    """How pickling would save ``obj``: ``("global", None)`` by its name, ``("reduced", what
    its reduce returns)`` (iterators as lists), or ``("state", its __dict__)``; raises
    :class:`Unwatchable` for an object none of these can read."""
    reduce = copyreg.dispatch_table.get(type(obj))
    try:
        reduced = reduce(obj) if reduce is not None else obj.__reduce_ex__(5)
    except Exception:
        reduced = None
    if isinstance(reduced, str):
        return "global", None
    if isinstance(reduced, tuple):
        return "reduced", tuple(item if not isinstance(item, types.GeneratorType) and
                                not hasattr(item, "__next__") else list(item) for item in reduced)
    state = getattr(obj, "__dict__", None)
    if state is None:
        raise Unwatchable(f"cannot read a {type(obj).__qualname__}")
    return "state", state


def _cell(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not yet set
        return _EMPTY


def _public(module) -> frozenset:
    return frozenset(k for k in vars(module) if not k.startswith("__"))


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


def _forget_names() -> None:
    names.cache_clear()
    attributes.cache_clear()


register("names read by code objects", _forget_names)


_NOT_IN_CLASS = frozenset(("__dict__", "__weakref__", "__doc__"))
_CHECK_GLOBALS = {"_ABSENT": _ABSENT, "_EMPTY": _EMPTY, "_Weak": Weak, "_ndarray": np.ndarray,
                  "_content": _content, "_cell": _cell, "_public": _public,
                  "_reduction": _reduction, "_NOT_IN_CLASS": _NOT_IN_CLASS}
