"""The one walk over what a user's function reaches, as packing sends it by value: the rules
that fingerprints (:mod:`daskdag.transport.fingerprints`), content tokens
(:mod:`daskdag.transport.content`) and the pickling of ``__main__``
(:mod:`daskdag.transport.pickler`) follow. Each subclasses :class:`Walk` to record what it
reaches its own way (by identity, by content); what is reached, and how, is written here only.

From the root (each object once; reached again, by its first place):

- numbers, strings, bytes, ``None``: their value; NumPy arrays: shape, dtype and content;
- JAX arrays, code, modules, and installed code (found under its module and name,
  :func:`~daskdag.transport.whose.by_reference`): themselves (:meth:`Walk.leaf`);
- containers (tuples, lists, dicts, sets sorted by ``repr``): length, then items;
- functions found under no name (the user's, and those installed code makes as it runs):
  code, the globals their code names (:func:`names`), closure cells, defaults, ``__dict__``;
- classes by value: metaclass, bases and own attributes (less where they are written, slots,
  ABC caches, and what their bases hold);
- other objects: what pickling saves of them (cloudpickle's and ``copyreg``'s reducers, else
  ``__reduce_ex__``), else their ``__dict__``; none of these: :class:`Unwatchable`;
- the user's modules (:func:`~daskdag.transport.whose.users_module`), however reached: after
  the rest, each attribute that code walked may read (:func:`attributes`), all but the dunder
  ones where such code names ``getattr``, ``vars`` or ``__dict__``; until no new name or module
  turns up.

With ``checked``, the walk also writes how it reached each object, as the source of a check
(:meth:`Walk.bind`, :meth:`Walk.test`) that a fingerprint compiles.
"""

from __future__ import annotations

import copyreg
import hashlib
import dis
import io
import types
from functools import lru_cache
from typing import Any

import cloudpickle
import jax
import numpy as np

from daskdag.caches import register
from daskdag.transport.weak import Weak
from daskdag.transport.whose import by_reference, users_module

CHECK_LINES = 20_000  # the longest check written; beyond it, none is
SMALL = 256  # bytes: a NumPy array up to this size is recorded by its bytes, not a digest
ATOMS = frozenset((type(None), bool, int, float, complex, str, bytes, type(Ellipsis),
                   type(NotImplemented)))
CONTAINERS = frozenset((tuple, list, dict, set, frozenset))
ABSENT = ("absent",)  # a name code uses that its globals or module do not hold (yet)
EMPTY = ("empty cell",)
#: The names by which code reads an attribute whose name it computes as it runs.
DYNAMIC_ATTRIBUTES = frozenset(("getattr", "vars", "__dict__"))
# cloudpickle's reducers, but one that reads an open file's content (copyreg's: asked each time)
_REDUCERS = {k: v for k, v in cloudpickle.Pickler.dispatch_table.maps[0].items()
             if k is not io.TextIOWrapper}
# Not a class's content: where it is written, its docstring, what Python makes of it.
_NOT_IN_CLASS = frozenset(("__module__", "__qualname__", "__doc__", "__dict__", "__weakref__",
                           "__firstlineno__", "__static_attributes__", "_abc_impl",
                           "__slotnames__"))


class Unwatchable(TypeError):
    """An object whose content the walk cannot read."""


class Walk:
    """One walk (see the module's docstring), recording ``facts`` as it goes (:attr:`LIMIT` at
    most); a subclass records more by its hooks (:meth:`leaf`, :meth:`opened`...). Alone, it
    finds what its code reads of the user's modules (:func:`read`)."""

    LIMIT = float("inf")
    __slots__ = ("facts", "seen", "walked", "root", "weakly", "read", "modules", "anything",
                 "lines", "consts", "names_of", "prefix")

    def __init__(self, root, checked: bool = False, prefix: str = ""):
        self.facts: list = []
        self.root = root
        self.seen: dict[int, int] = {}  # id -> its place in the order reached
        self.walked: list = []  # what the walk went through: kept while it goes (ids unique)
        self.weakly: set[int] = set()  # ids of functions held weakly (Weak)
        self.read: set[str] = set()  # the attribute names the code walked through may read
        self.anything = False  # some code may read any attribute (a name computed as it runs)
        # id -> (a user's module reached, its expression, the names taken of it, its place)
        self.modules: dict[int, tuple] = {}
        self.lines: list[str] | None = [] if checked else None  # the check's source
        self.consts: dict[str, Any] = {}  # the check's constants, by name
        self.names_of: dict[int, str] = {}  # id of an object reached -> its variable
        self.prefix = prefix  # of the check's names: ``{prefix}root``, constants ``{prefix}k{n}``,
        # variables ``{prefix}v{n}``

    def leaf(self, obj, at: str) -> None:
        """``obj`` reached, not walked into: a JAX array, a code object, a module, installed
        code, the root, an object pickled by its name."""

    def opened(self, obj, at: str) -> None:
        """A function or class, before the walk goes into it."""

    def digest(self, a: np.ndarray) -> bytes:
        """A NumPy array's content."""
        return array_content(a)

    def by_value(self, cls: type) -> bool:
        """Whether the walk goes into class ``cls``."""
        return not by_reference(cls)

    def test(self, condition: str) -> None:
        """The check fails unless ``condition`` holds."""
        if self.lines is not None:
            self.lines.append(f"if not ({condition}): return False")

    def const(self, value) -> str:
        name = f"{self.prefix}k{len(self.consts)}"
        self.consts[name] = value
        return name

    def bind(self, expr: str) -> str:
        """A new variable of the check, holding ``expr`` (``""`` when no check is made)."""
        lines = self.lines
        if lines is None:
            return ""
        if len(lines) > CHECK_LINES:
            self.lines = None
            return ""
        name = f"{self.prefix}v{len(lines)}"
        lines.append(f"{name} = {expr}")
        return name

    def walk(self) -> None:
        """The root, then the user's modules it reached, by the names its code reads, until
        neither grows (a module's attribute may read more names, or reach another module)."""
        self(self.root, f"{self.prefix}root")
        grown = True
        while grown:
            grown = False
            for module, at, done, place in list(self.modules.values()):
                wanted = self.read
                if self.anything:
                    public = public_names(module)
                    if self.lines is not None:
                        self.test(f"_public({at}) == {self.const(public)}")
                    wanted = wanted | public
                todo = sorted(wanted - done)
                if not todo:
                    continue
                grown = True
                done.update(todo)
                self.facts.append(("module", place))
                for attribute in todo:
                    self.facts.append(attribute)
                    self(getattr(module, attribute, ABSENT),
                         self.bind(f"getattr({at}, {attribute!r}, ABSENT)"))

    def __call__(self, obj, at: str) -> None:
        facts, kind, checked = self.facts, type(obj), self.lines is not None
        if len(facts) > self.LIMIT:
            raise Unwatchable("too large")
        if kind in ATOMS:
            facts.append((kind, obj))
            if checked and (obj is None or kind is bool):  # (singletons)
                self.test(f"{at} is {obj!r}")
            elif checked:
                value = self.const(obj)
                self.test(f"type({at}) is {self.const(kind)} and ({at} is {value} or "
                          f"{at} == {value})")
            return
        if kind is np.ndarray and not obj.dtype.hasobject:
            content = self.digest(obj)
            facts.append(("ndarray", obj.shape, obj.dtype.str, content))
            if checked:
                self.test(f"type({at}) is _ndarray and not {at}.dtype.hasobject and "
                          f"{at}.shape == {obj.shape!r} and {at}.dtype.str == {obj.dtype.str!r} "
                          f"and _content({at}) == {self.const(content)}")
            return
        if isinstance(obj, (jax.Array, types.CodeType)):
            self.leaf(obj, at)
            return
        if isinstance(obj, types.ModuleType):
            if id(obj) not in self.modules and users_module(obj.__name__):
                self.modules[id(obj)] = (obj, at, set(), len(self.modules))
            self.leaf(obj, at)
            return
        if kind is Weak:  # (a preparation's hold on a function: the function itself)
            target = obj.target
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
        if kind in CONTAINERS:  # (a subclass pickles as its reduce says: below)
            self.container(obj, at)
        elif kind is types.FunctionType and not by_reference(obj):
            self.opened(obj, at)
            self.function(obj, at)
        elif isinstance(obj, type) and self.by_value(obj):
            self.opened(obj, at)
            self.cls(obj, at)
        elif kind is types.FunctionType or isinstance(obj, type) or by_reference(obj):
            self.leaf(obj, at)
        else:
            self.instance(obj, at)

    def reads(self, code: types.CodeType) -> None:
        """Take the names ``code`` may read of a module of the user's."""
        read = attributes(code)
        self.read.update(read)
        if not self.anything and not DYNAMIC_ATTRIBUTES.isdisjoint(read):
            self.anything = True

    def container(self, obj, at: str) -> None:
        kind = type(obj)
        self.facts.append((kind, len(obj)))
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
        self(code, bind(f"{at}.__code__"))
        self.reads(code)
        namespace = fn.__globals__
        scope = bind(f"{at}.__globals__")
        for name in names(code):
            value = namespace.get(name, ABSENT)
            facts.append(name)
            read = bind(f"{scope}.get({name!r}, ABSENT)")
            if value is ABSENT:
                facts.append(ABSENT)
                self.test(f"{read} is ABSENT")
            else:
                self(value, read)
        cells = bind(f"{at}.__closure__ or ()")
        for j, cell in enumerate(fn.__closure__ or ()):
            contents = cell_contents(cell)
            if contents is EMPTY:
                facts.append(EMPTY)
                self.test(f"_cell({cells}[{j}]) is EMPTY")
            else:
                self(contents, bind(f"_cell({cells}[{j}])"))
        self(fn.__defaults__, bind(f"{at}.__defaults__"))
        self(fn.__kwdefaults__, bind(f"{at}.__kwdefaults__"))
        self.test(f"{at}.__dict__" if fn.__dict__ else f"not {at}.__dict__")
        if fn.__dict__:
            self(fn.__dict__, bind(f"{at}.__dict__"))

    def cls(self, cls: type, at: str) -> None:
        self(type(cls), self.bind(f"type({at})"))
        self(cls.__bases__, self.bind(f"{at}.__bases__"))
        own = class_items(cls)
        items = self.bind(f"_own({at})")
        self.test(f"len({items}) == {len(own)}")
        for j, (name, value) in enumerate(own):
            self.facts.append(name)
            self.test(f"{items}[{j}][0] == {name!r}")
            self(value, self.bind(f"{items}[{j}][1]"))

    def instance(self, obj, at: str) -> None:
        how, reduced = reduction(obj)
        again = self.bind(f"_reduction({at})")
        self.test(f"{again}[0] == {how!r}")
        if how == "global":  # pickled by its name
            self.leaf(obj, at)
            return
        if how == "reduced":
            self.facts.append("reduced")
        else:
            self(type(obj), self.bind(f"type({at})"))
        self(reduced, self.bind(f"{again}[1]"))


def read(root, module: types.ModuleType) -> set[str] | None:
    """The attributes of ``module`` (one of the user's) that the code reached from ``root``
    may read; ``None`` where the walk cannot read what ``root`` holds."""
    walk = Walk(root)
    try:
        walk.walk()
    except (Unwatchable, RecursionError):
        return None
    entry = walk.modules.get(id(module))
    return set() if entry is None else entry[2]


def reduction(obj) -> tuple[str, Any]:
    """How pickling saves ``obj``: ``("global", its name)``, ``("reduced", what its reduce
    returns)`` (iterators as lists), or ``("state", its __dict__)``; else raises
    :class:`Unwatchable` (from what pickling raised)."""
    kind = type(obj)
    reduce = _REDUCERS.get(kind) or copyreg.dispatch_table.get(kind)
    error = None
    try:
        reduced = reduce(obj) if reduce is not None else obj.__reduce_ex__(5)
    except Exception as e:
        reduced, error = None, e
    if isinstance(reduced, str):
        return "global", reduced
    if isinstance(reduced, tuple):
        return "reduced", tuple(item if not isinstance(item, types.GeneratorType) and
                                not hasattr(item, "__next__") else list(item) for item in reduced)
    state = getattr(obj, "__dict__", None)
    if state is None:
        raise Unwatchable(str(error) if error else f"cannot read a {type(obj).__qualname__}")
    return "state", state


def class_items(cls: type) -> list[tuple[str, Any]]:
    """A class's own attributes, by name, as the walk reads them (see the module's
    docstring)."""
    own = vars(cls)
    slots = own.get("__slots__", ())
    skip = _NOT_IN_CLASS.union((slots,) if isinstance(slots, str) else slots) if slots else \
        _NOT_IN_CLASS
    bases = [vars(base) for base in cls.__bases__]
    out = []
    for k, v in own.items():
        if k not in skip:
            for base in bases:
                if base.get(k, ABSENT) is v:
                    break
            else:
                out.append((k, v))
    return out


def cell_contents(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # not yet set
        return EMPTY


def public_names(module) -> frozenset:
    return frozenset(k for k in vars(module) if not k.startswith("__"))


def array_content(a: np.ndarray) -> bytes:
    if a.nbytes <= SMALL:
        return a.tobytes()
    return hashlib.sha1(np.ascontiguousarray(a).data).digest()


@lru_cache(maxsize=8192)
def names(code: types.CodeType) -> tuple[str, ...]:
    """The global names ``code`` (and the code nested in it: lambdas, comprehensions) may read:
    those its instructions look up as globals (not its attributes' names)."""
    found = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_LOOKUPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.update(names(const))
    return tuple(sorted(found))


_GLOBAL_LOOKUPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME",
                             "STORE_NAME", "DELETE_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})


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

#: What a check (the source :meth:`Walk.bind` and :meth:`Walk.test` wrote) runs with.
CHECK_GLOBALS = {"ABSENT": ABSENT, "EMPTY": EMPTY, "_Weak": Weak, "_ndarray": np.ndarray,
                 "_content": array_content, "_cell": cell_contents, "_public": public_names,
                 "_reduction": reduction, "_own": class_items}
