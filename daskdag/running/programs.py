"""Programs: a call compiled once and run at every call that fits it, in JAX's ``jit`` ->
``Compiled`` idiom, for as long as nothing it relies on has changed.

Compiling a call of a DAG with inputs like ``x`` and its options (:func:`compile`) checks and
plans the DAG, groups its stages, packs functions, traces nodes for a mode or a sparsity
pattern, and builds the call's graph or the whole call as one XLA program: a :class:`Program`,
whose inputs a call's inputs, cotangents, tangents or directions are, never its structure.

What a program relies on, and how a call checks it:

- the DAG: each entry, its function and options by identity, its deps and resources by value;
- the inputs' structure, shapes and dtypes (:func:`daskdag.model.shapes.signature`);
- the outputs and the call's options; the settings in effect (``dask.config``'s ``daskdag.*``
  and JAX's that change results, :class:`~daskdag.transport.scope.JaxSettings`);
- the content of the node functions it packed or traced: their fingerprints
  (:mod:`daskdag.transport.fingerprints`), each checked by the check it compiled.

An eager call finds its program by a key of the first four (:data:`PROGRAMS`) and checks the
fingerprints. A prepared function holds its programs itself, per input signature
(:class:`Held`), and asks one whether it is stale (:meth:`Program.stale`) before running it.
Anything new or changed compiles anew, and :func:`compile` says why.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Generic, TypeVar

import dask.config

import daskdag.config as config
from daskdag.caches import Cache, register
from daskdag.model.shapes import signature
from daskdag.model.implicit import Implicit
from daskdag.model.spec import Node
from daskdag.rules.lifted import Lift
from daskdag.transport.fingerprints import Fingerprint, fingerprint
from daskdag.transport.packing import Packed
from daskdag.transport.scope import JaxSettings
from daskdag.transport.weak import Weak

P = TypeVar("P")
_UNSET = object()
#: The programs kept for eager calls, by key (the least recently used out first).
PROGRAMS: Cache = Cache("prepared calls", lambda: config.get("prepared-calls"))
_last: Cache = Cache("the last key per DAG", 256)  # (kind, id(dag)) -> (key, note)
OFF = "prepared calls are off (dask.config daskdag.prepared-calls is 0)"

#: Functions daskdag makes of a DAG's own (packed, lifted): fingerprinted to be packed, not
#: watched, for what they hold is a packed copy of a function watched as it was packed, or the
#: DAG's function itself, called as it is.
MADE = (Packed, Lift)


class Watch:
    """What a program relies on, as it is compiled: ``watch(node name, fn)`` takes a function's
    fingerprint before the program packs or traces it (None: it cannot be taken, and the
    program is not kept); ``hold(fn)``: the function held weakly (when it goes, the program
    goes); ``refuse(why)``: the program serves this call only, and is not kept."""

    def __init__(self) -> None:
        self.watched: list[tuple[str, Any, Fingerprint]] = []
        self.refused: list[str] = []
        self.held: list[Weak] = []
        self._prints: dict[int, Fingerprint | None] = {}  # (each function watched once)

    def hold(self, fn: Any) -> Weak:
        weak = Weak(fn)
        self.held.append(weak)
        return weak

    def __call__(self, name: str, fn: Any) -> Fingerprint | None:
        if id(fn) in self._prints:
            return self._prints[id(fn)]
        print_ = self._prints[id(fn)] = fingerprint(fn, checked=config.get("prepared-calls") > 0)
        if print_ is None:
            self.refuse(f"node {name!r}: its function holds something a fingerprint cannot "
                        f"read (a lock, a file, a generator...)")
        elif not isinstance(fn, MADE):
            self.watched.append((name, fn, print_))
        return print_

    def refuse(self, why: str) -> None:
        self.refused.append(why)


@dataclass(frozen=True, eq=False)
class Program(Generic[P]):
    """A call compiled: the kind's compiled ``value``, the functions whose content it relies on
    (``watched``: ``(node name, function, fingerprint)``), its ``key``, and ``kept``: it may
    serve later calls (False: this call only, and ``why`` says why)."""

    value: P
    watched: tuple[tuple[str, Any, Fingerprint], ...]
    key: tuple | None
    kept: bool = True
    why: str | None = None
    settings_seen: dict = field(default_factory=dict)  # daskdag's dask.config when compiled

    def changed(self) -> str | None:
        """Why this program no longer holds (a watched function changed), or None."""
        for name, fn, print_ in self.watched:
            if not print_.holds(fn):
                return (f"node {name!r}: its function changed (what it closes over, a global "
                        f"it uses, or an attribute)")
        return None

    def stale(self, entries: Entries) -> str | None:
        """Why this program cannot serve a call whose DAG's entries are ``entries``, or None:
        the entries, the settings, then the fingerprints, cheapest first."""
        if not self.kept:
            return self.why
        if not entries.same():
            return entries.why()
        ours = dask.config.config.get("daskdag", {})
        if ours != self.settings_seen or self.key is None or \
                JaxSettings.current() != self.key[-1][0]:
            if self.key is None or settings() != self.key[-1]:
                return _PARTS[5]
        return self.changed()


def compile(kind: str, dag: Any, x: Any, options: tuple, make: Callable[[Watch], P],
            inputs: Any = _UNSET) -> tuple[Program[P], str | None]:
    """The program of a call of ``kind`` on ``dag`` with inputs like ``x`` and ``options``
    (hashable): the one compiled before while it holds, else ``make(watch)`` (:class:`Watch`).
    Returns it and why it was compiled now (None: reused). ``inputs``: what of ``x`` the
    program depends on, as a key (default: :func:`signature` of ``x``; None: no key fits)."""
    key = _key(kind, dag, x, options, inputs)
    if key is None:  # (a malformed DAG or unhashable options: make() says what is wrong)
        why = "its arguments cannot key a prepared call"
        return Program(make(Watch()), (), None, kept=False, why=why), why
    if config.get("prepared-calls") <= 0:  # (none is kept, nor used)
        _remember(kind, dag, key, OFF)
        return Program(make(Watch()), (), key, kept=False, why=OFF), OFF
    hit = PROGRAMS.get(key)
    if hit is not None:
        why = hit.changed()
        if why is None:
            _remember(kind, dag, hit.key, None)
            return hit, None
    else:
        why = _why_new(kind, dag, key)
    watch = Watch()
    value = make(watch)
    if watch.refused:
        note = "; ".join(watch.refused) + ": such a call is prepared anew each time"
        _remember(kind, dag, key, note)
        return Program(value, (), key, kept=False, why=note), why
    made = Program(value, tuple(watch.watched), key,
                   settings_seen=dict(dask.config.config.get("daskdag", {})))
    for weak in watch.held:  # (the ids in the key stay the functions' while it lasts)
        weak.on_gone(partial(_forget, made))
    PROGRAMS.put(key, made)
    _remember(kind, dag, key, None)
    return made, why


def _forget(made: Program) -> None:
    """A function the program ``made`` holds is gone: so is the program, wherever it is."""
    if PROGRAMS is None:  # (the interpreter is shutting down)
        return
    if PROGRAMS.get(made.key) is made:
        PROGRAMS.pop(made.key)
    for held in list(_holders):
        held.drop(made)


class Entries:
    """A DAG's entries as a program was compiled with them, to tell at the next call, without a
    key, whether the DAG is the same: the same entry objects under the same names, with the
    same functions, deps and resources (lists and dicts change in place)."""

    __slots__ = ("dag", "parts")

    def __init__(self, dag: Mapping[str, Any]):
        self.dag = dag
        self.parts = tuple((name, entry, _content(entry)) for name, entry in dag.items())

    def same(self) -> bool:
        dag = self.dag
        if len(dag) != len(self.parts):
            return False
        for name, entry, content in self.parts:
            if dag.get(name) is not entry or _content(entry) != content:
                return False
        return True

    def why(self) -> str:
        before = {name: (entry, content) for name, entry, content in self.parts}
        for name, entry in self.dag.items():
            if name not in before:
                return f"the DAG changed: node {name!r} was added"
            if entry is not before[name][0] or _content(entry) != before[name][1]:
                return f"the DAG changed: node {name!r} was replaced or its deps changed"
        gone = [name for name in before if name not in self.dag]
        return f"the DAG changed: node(s) {gone} removed"


def _content(entry) -> tuple:
    """What of a DAG entry can change in place, as values compared in C: a list entry's items,
    deps, resources (copies, as they are now)."""
    if type(entry) is tuple and len(entry) == 2:
        return entry[0], list(entry[1]) if type(entry[1]) is list else entry[1]
    if isinstance(entry, (Node, Implicit)):
        deps, resources = entry.deps, entry.resources
        return (list(deps) if type(deps) is list else deps,
                dict(resources) if type(resources) is dict else resources)
    if isinstance(entry, list):
        return tuple(entry[:1]) + tuple(list(e) if type(e) is list else e for e in entry[1:])
    return (entry,)


class Held:
    """A prepared function's own programs by the signature of its call's inputs (and where it
    runs), the latest :data:`HELD`, each with its :class:`Entries`, as ``jax.jit``'s wrapper
    holds its executables. Unused while ``daskdag.prepared-calls`` is 0."""

    __slots__ = ("programs", "__weakref__")

    def __init__(self) -> None:
        self.programs: OrderedDict[Any, tuple[Program, Entries]] = OrderedDict()
        _holders.add(self)

    def get(self, signature: Any) -> tuple[Program, Entries] | None:
        if config.get("prepared-calls") <= 0:
            return None
        hit = self.programs.get(signature)
        if hit is not None:
            self.programs.move_to_end(signature)
        return hit

    def put(self, signature: Any, program: Program, entries: Entries) -> None:
        if not program.kept:
            self.programs.pop(signature, None)
            return
        self.programs[signature] = (program, entries)
        self.programs.move_to_end(signature)
        while len(self.programs) > HELD:
            self.programs.popitem(last=False)

    def drop(self, program: Program) -> None:
        for signature, (held, _) in list(self.programs.items()):
            if held is program:
                self.programs.pop(signature, None)

    def clear(self) -> None:
        self.programs.clear()


HELD = 8  # the input signatures a prepared function keeps a program for
_holders: weakref.WeakSet[Held] = weakref.WeakSet()


def _clear_held() -> None:
    for held in list(_holders):
        held.clear()


register("prepared functions' own programs", _clear_held)

#: daskdag's settings that each call reads as it runs: no program depends on them.
PER_CALL = frozenset({"worker-wait", "keep-calls", "tune-workers", "prepared-calls",
                      "reuse-bytes", "sweep-results"})


def settings() -> tuple:
    """The settings a program may depend on, as a key: JAX's that change results (the calling
    thread's :class:`~daskdag.transport.scope.JaxSettings`) and daskdag's (``dask.config``,
    less :data:`PER_CALL`)."""
    ours = dask.config.config.get("daskdag", {})
    return JaxSettings.current(), tuple(sorted(
        (k, repr(v)) for k, v in ours.items() if k not in PER_CALL))


def dag_key(dag: Any) -> tuple | None:
    """The DAG as a key: per entry its name, its functions' identities, its deps, resources and
    options by value; None for what is not a well-formed DAG. (A program goes with its
    functions, so no other function takes an id in its key while it lasts.)"""
    if not isinstance(dag, Mapping):
        return None
    parts = [_entry_key(name, entry) for name, entry in dag.items()]
    return None if any(p is None for p in parts) else tuple(parts)


def _entry_key(name: str, entry: Any) -> tuple | None:
    """One entry's part of :func:`dag_key`: its functions by identity, its deps, options and
    resources by value; None where it is malformed."""
    if isinstance(entry, Node):
        return _options_key(name, entry, (entry.fn, entry.vjp, entry.fwd, entry.bwd, entry.jvp),
                            ())
    if isinstance(entry, Implicit):
        return _options_key(name, entry, (entry.residual, entry.guess, entry.solver,
                                          entry.linear_solver),
                            (Implicit, entry.rtol, entry.atol, entry.maxiter))
    if isinstance(entry, (tuple, list)) and len(entry) == 2:
        fn, deps = entry
        return (name, type(deps), tuple(deps), id(fn)) if isinstance(deps, (list, tuple)) else None
    return None


def _options_key(name: str, entry: Any, functions: tuple, more: tuple) -> tuple | None:
    """A :class:`Node`'s or an :class:`Implicit`'s :func:`_entry_key` (``more``: its kind's
    own options)."""
    deps, resources = entry.deps, entry.resources
    if not isinstance(deps, (list, tuple)) or not (
            resources is None or isinstance(resources, Mapping)):
        return None
    return (name, type(deps), tuple(deps), *map(id, functions), *more, entry.jit, entry.vmap,
            entry.device, entry.remat,
            None if resources is None else tuple(sorted(resources.items())))


def _key(kind: str, dag: Any, x: Any, options: tuple, inputs: Any) -> tuple | None:
    structure = dag_key(dag)
    if structure is None or inputs is None:
        return None
    try:
        key = (kind, structure, frozenset(x) if isinstance(x, Mapping) else None,
               signature(x) if inputs is _UNSET else inputs, options, settings())
        hash(key)
    except (TypeError, ValueError):
        return None
    return key


def _remember(kind: str, dag: Any, key: tuple, note: str | None) -> None:
    """Remember ``key`` as the last of ``dag`` (by id: a DAG dict cannot be held weakly, so
    another one may take its id once it is gone, and be explained by its key)."""
    last = _last.get((kind, id(dag)))
    if last is None or last[0] is not key or last[1] != note:
        _last.put((kind, id(dag)), (key, note))


_PARTS = ("", "the DAG changed", "the inputs given changed", "the inputs' structure, shapes or "
          "dtypes changed", "the outputs or options changed", "a setting changed (dask.config "
          "daskdag.*, or a JAX setting that changes results: jax_enable_x64, "
          "jax_default_matmul_precision...)")


def _why_new(kind: str, dag: Any, key: tuple) -> str:
    """Why ``key`` has no program: first call, or what differs from the last key of the
    same DAG (the entry concerned, when the DAG changed)."""
    last = _last.get((kind, id(dag)))
    if last is None:
        return "first call"
    if last[0] == key:
        return last[1] or ("its preparation was let go (daskdag.prepared-calls, or one of its "
                           "functions went)")
    if not {p[0] for p in last[0][1]} & {p[0] for p in key[1]}:  # (a DAG took a gone one's id)
        return "first call"
    for k, (old, new) in enumerate(zip(last[0], key)):
        if old != new and k == 1:
            return _entry_changed(old, new)
        if old != new:
            return _PARTS[k]
    return "first call"


def _entry_changed(old: tuple, new: tuple) -> str:
    before = {p[0]: p for p in old}
    for part in new:
        if part[0] not in before:
            return f"the DAG changed: node {part[0]!r} was added"
        if before[part[0]] != part:
            return f"the DAG changed: node {part[0]!r} was replaced or its deps changed"
    gone = [name for name in before if name not in {p[0] for p in new}]
    return f"the DAG changed: node(s) {gone} removed" if gone else "the DAG changed"
