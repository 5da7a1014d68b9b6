"""Prepared calls: what a call works out before it runs anything, worked out once and reused by
the next calls of the same kind, DAG, outputs, options and input shapes, for as long as nothing
it relies on has changed.

Each kind of call prepares itself (:mod:`daskdag.api`, :mod:`daskdag.full_jacobians`,
:mod:`daskdag.hessians`): it parses and checks the DAG, plans it, groups its stages, packs the
functions that need packing, traces nodes for a mode or a sparsity pattern, colours patterns.
What a preparation may rely on, and how a call checks it:

- the DAG: each entry, its function and options by identity, its deps and resources by value
  (:func:`dag_key`, one pass over the dict);
- the inputs' structure, shapes and dtypes (:func:`daskdag.model.shapes.signature`);
- the outputs and the call's options; the settings in effect (``dask.config``'s ``daskdag.*``
  and JAX's ``jax_enable_x64``);
- the content of the node functions it packed or traced: their fingerprints
  (:mod:`daskdag.transport.fingerprints`), taken again and compared, as they must be whenever
  the call runs them here or sends them.

The first four make the key of :data:`PREPARED`; the fingerprints are checked on every hit.
Anything new or changed prepares the call anew, and :func:`get` says why.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Generic, TypeVar

import dask.config
import jax

from daskdag import config
from daskdag.caches import Cache, register
from daskdag.model.shapes import signature
from daskdag.model.spec import Node
from daskdag.transport.fingerprints import Fingerprint, fingerprint
from daskdag.transport.weak import Weak

P = TypeVar("P")
_UNSET = object()
#: The preparations kept, by key (the least recently used out first).
PREPARED: Cache = Cache("prepared calls", lambda: config.get("prepared-calls"))
_last: Cache = Cache("the last key per DAG", 256)  # (kind, id(dag)) -> (key, note)
_pins: ContextVar[Pins | None] = ContextVar("daskdag_pins", default=None)


class Pins:
    """The latest preparation of one owner (a :class:`daskdag.Prepared` function), kept
    however many others the process keeps (``entries``: key -> preparation); emptied by
    :func:`daskdag.clear_caches` as every other preparation is."""

    __slots__ = ("entries", "__weakref__")

    def __init__(self) -> None:
        self.entries: dict[tuple, Preparation] = {}
        _all_pins.add(self)


_all_pins: weakref.WeakSet[Pins] = weakref.WeakSet()


def _unpin_all() -> None:
    for pins in list(_all_pins):
        pins.entries.clear()


register("prepared functions' own preparations", _unpin_all)


@contextlib.contextmanager
def pinning(pins: Pins) -> Iterator[None]:
    """Within it, the latest preparation a call makes or reuses is also kept in ``pins``."""
    token = _pins.set(pins)
    try:
        yield
    finally:
        _pins.reset(token)



class Watch:
    """What a preparation relies on, as it is made: ``watch(node name, fn)`` takes the
    fingerprint of a function before the preparation packs or traces it, and returns it (None:
    it cannot be taken, and the preparation is not kept); ``hold(fn)``: the function as the
    preparation holds it, weakly (:class:`~daskdag.transport.weak.Weak`: when it goes, the
    preparation goes); ``refuse(why)``: the preparation holds for this call only (a sparsity
    pattern probed at this point), and is not kept."""

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
        print_ = self._prints[id(fn)] = fingerprint(fn, checked=True)
        if print_ is None:
            self.refuse(f"node {name!r}: its function holds something a fingerprint cannot "
                        f"read (a lock, a file, a generator...)")
        else:
            self.watched.append((name, fn, print_))
        return print_

    def refuse(self, why: str) -> None:
        self.refused.append(why)


@dataclass(frozen=True)
class Preparation(Generic[P]):
    """A kind's prepared ``value``, the functions whose content it relies on (``watched``:
    ``(node name, function, fingerprint)``, each function held weakly), and its ``key``."""

    value: P
    watched: tuple[tuple[str, Any, Fingerprint], ...]
    key: tuple

    def changed(self) -> str | None:
        """Why this preparation no longer holds (a watched function changed), or None."""
        for name, fn, print_ in self.watched:
            if not print_.holds(fn):
                return (f"node {name!r}: its function changed (what it closes over, a global "
                        f"it uses, or an attribute)")
        return None


def get(kind: str, dag: Any, x: Any, options: tuple, make: Callable[[Watch], P],
        inputs: Any = _UNSET) -> tuple[P, str | None]:
    """The preparation of a call of ``kind`` on ``dag`` with inputs like ``x`` and ``options``
    (hashable): the one made before while it holds, else ``make(watch)``, which calls
    ``watch(name, fn)`` for each node function whose content it relies on. Returns it and why
    it was made now (None: reused). ``inputs``: what of ``x`` the preparation depends on, as a
    key (default: :func:`~daskdag.model.shapes.signature` of ``x``; None: no key fits)."""
    key = _key(kind, dag, x, options, inputs)
    if key is None:  # (a malformed DAG or unhashable options: make() says what is wrong)
        return make(Watch()), "its arguments cannot key a preparation"
    if config.get("prepared-calls") <= 0:  # (none is kept, nor used: a pinned one neither)
        _remember(kind, dag, key, OFF)
        return make(Watch()), OFF
    pins = _pins.get()
    hit = PREPARED.get(key)
    if hit is None and pins is not None:
        hit = pins.entries.get(key)
    if hit is not None:
        why = hit.changed()
        if why is None:
            _remember(kind, dag, hit.key, None)
            _pin(pins, hit)
            return hit.value, None
    else:
        why = _why_new(kind, dag, key)
    watch = Watch()
    value = make(watch)
    note = None
    if watch.refused:
        note = "; ".join(watch.refused) + ": such a call is prepared anew each time"
    else:
        made = Preparation(value, tuple(watch.watched), key)
        for weak in watch.held:  # (the ids in the key stay the functions' while it lasts)
            weak.on_gone(partial(_forget, key, made, pins))
        PREPARED.put(key, made)
        _pin(pins, made)
    _remember(kind, dag, key, note)
    return value, why


OFF = "prepared calls are off (dask.config daskdag.prepared-calls is 0)"


def _forget(key: tuple, made: Preparation, pins: Pins | None) -> None:
    """A function the preparation ``made`` holds is gone: so is the preparation."""
    if PREPARED is None:  # (the interpreter is shutting down)
        return
    if PREPARED.get(key) is made:
        PREPARED.pop(key)
    if pins is not None and pins.entries.get(key) is made:
        pins.entries.pop(key)


def _pin(pins: Pins | None, made: Preparation) -> None:
    if pins is not None and pins.entries.get(made.key) is not made:
        pins.entries = {made.key: made}


#: daskdag's settings that each call reads as it runs: no preparation depends on them.
PER_CALL = frozenset({"worker-wait", "keep-calls", "tune-workers", "prepared-calls"})


def settings() -> tuple:
    """The settings a preparation may depend on, as a key: daskdag's (``dask.config``, less
    :data:`PER_CALL`) and JAX's ``jax_enable_x64``."""
    ours = dask.config.config.get("daskdag", {})
    return bool(jax.config.read("jax_enable_x64")), tuple(sorted(
        (k, repr(v)) for k, v in ours.items() if k not in PER_CALL))


def dag_key(dag: Any) -> tuple | None:
    """The DAG as a key: per entry its name, the identity of its functions, its deps, resources
    and options by value (lists and dicts can change in place); None for what is not a
    well-formed DAG. (A preparation holds those functions weakly and goes with them, so no
    other function takes an id in its key while it lasts.)"""
    if not isinstance(dag, Mapping):
        return None
    parts: list[tuple] = []
    for name, entry in dag.items():
        if isinstance(entry, Node):
            deps, resources = entry.deps, entry.resources
            if not isinstance(deps, (list, tuple)) or not (
                    resources is None or isinstance(resources, Mapping)):
                return None
            parts.append((name, type(deps), tuple(deps), *map(id, (
                entry.fn, entry.vjp, entry.fwd, entry.bwd, entry.jvp)), entry.jit, entry.vmap,
                entry.device, entry.remat,
                None if resources is None else tuple(sorted(resources.items()))))
        elif isinstance(entry, (tuple, list)) and len(entry) == 2:
            fn, deps = entry
            if not isinstance(deps, (list, tuple)):
                return None
            parts.append((name, type(deps), tuple(deps), id(fn)))
        else:
            return None
    return tuple(parts)


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
          "daskdag.*, or jax_enable_x64)")


def _why_new(kind: str, dag: Any, key: tuple) -> str:
    """Why ``key`` has no preparation: first call, or what differs from the last key of the
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
