"""Prepared calls: what a call works out before it runs anything, worked out once and reused by
the next calls of the same kind, DAG, outputs, options and input shapes, for as long as nothing
it relies on has changed.

Each kind of call prepares itself (:mod:`daskdag.api`, :mod:`daskdag.jacobians`,
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
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

import dask.config
import jax

from daskdag import config
from daskdag.caches import Cache
from daskdag.model.shapes import signature
from daskdag.model.spec import Node
from daskdag.transport.fingerprints import Fingerprint, fingerprint

P = TypeVar("P")
_UNSET = object()
#: The preparations kept, by key (the least recently used out first).
PREPARED: Cache = Cache("prepared calls", lambda: config.get("prepared-calls"))
_last: Cache = Cache("the last key per DAG", 256)  # (kind, id(dag)) -> (dag, key, note)
_pins: ContextVar[dict | None] = ContextVar("daskdag_pins", default=None)


@contextlib.contextmanager
def pinning(pins: dict) -> Iterator[None]:
    """Within it, the latest preparation a call makes or reuses is also kept in ``pins`` (its
    owner's: a :class:`daskdag.Prepared` function), however many others the process keeps."""
    token = _pins.set(pins)
    try:
        yield
    finally:
        _pins.reset(token)



class Watch:
    """What a preparation relies on, as it is made: ``watch(node name, fn)`` takes the
    fingerprint of a function before the preparation packs or traces it, and returns it (None:
    it cannot be taken, and the preparation is not kept); ``refuse(why)``: the preparation
    holds for this call only (a sparsity pattern probed at this point), and is not kept."""

    def __init__(self) -> None:
        self.watched: list[tuple[str, Any, Fingerprint]] = []
        self.refused: list[str] = []

    def __call__(self, name: str, fn: Any) -> Fingerprint | None:
        print_ = fingerprint(fn)
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
    ``(node name, function, fingerprint)``), its ``key``, and ``keep``: objects whose ids its
    key holds."""

    value: P
    watched: tuple[tuple[str, Any, Fingerprint], ...]
    key: tuple
    keep: tuple

    def changed(self) -> str | None:
        """Why this preparation no longer holds (a watched function changed), or None."""
        for name, fn, print_ in self.watched:
            if fingerprint(fn) != print_:
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
    pins = _pins.get()
    hit = PREPARED.get(key)
    if hit is None and pins is not None:
        hit = pins.get(key)
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
    elif config.get("prepared-calls") > 0 or pins is not None:
        made = Preparation(value, tuple(watch.watched), key, tuple(dag.values()))
        PREPARED.put(key, made)  # (a size of 0 keeps nothing)
        _pin(pins, made)
    else:
        note = "prepared calls are off (dask.config daskdag.prepared-calls is 0)"
    _remember(kind, dag, key, note)
    return value, why


def _pin(pins: dict | None, made: Preparation) -> None:
    if pins is not None and pins.get(made.key) is not made:
        pins.clear()
        pins[made.key] = made


def settings() -> tuple:
    """The settings a preparation may depend on, as a key: daskdag's (``dask.config``) and
    JAX's ``jax_enable_x64``."""
    ours = dask.config.config.get("daskdag", {})
    return bool(jax.config.read("jax_enable_x64")), tuple(sorted((k, repr(v)) for k, v in ours.items()))


def dag_key(dag: Any) -> tuple | None:
    """The DAG as a key: per entry its name, the identity of its function (or ``Node``), its
    deps and resources by value (lists and dicts can change in place); None for what is not a
    well-formed DAG."""
    if not isinstance(dag, Mapping):
        return None
    parts: list[tuple] = []
    for name, entry in dag.items():
        if isinstance(entry, Node):
            deps, resources = entry.deps, entry.resources
            parts.append((name, id(entry), type(deps), tuple(deps) if isinstance(
                deps, (list, tuple)) else id(deps),
                None if resources is None else tuple(sorted(resources.items()))
                if isinstance(resources, Mapping) else id(resources)))
        elif isinstance(entry, (tuple, list)) and len(entry) == 2:
            fn, deps = entry
            parts.append((name, id(fn), type(deps),
                          tuple(deps) if isinstance(deps, (list, tuple)) else id(deps)))
        else:
            return None
    return tuple(parts)


def _key(kind: str, dag: Any, x: Any, options: tuple, inputs: Any) -> tuple | None:
    structure = dag_key(dag)
    if structure is None or inputs is None:
        return None
    try:
        key = (kind, structure, tuple(x) if isinstance(x, Mapping) else None,
               signature(x) if inputs is _UNSET else inputs, options, settings())
        hash(key)
    except (TypeError, ValueError):
        return None
    return key


def _remember(kind: str, dag: Any, key: tuple, note: str | None) -> None:
    last = _last.get((kind, id(dag)))
    if last is None or last[0] is not dag or last[1] is not key or last[2] != note:
        _last.put((kind, id(dag)), (dag, key, note))


_PARTS = ("", "the DAG changed", "the inputs given changed", "the inputs' structure, shapes or "
          "dtypes changed", "the outputs or options changed", "a setting changed (dask.config "
          "daskdag.*, or jax_enable_x64)")


def _why_new(kind: str, dag: Any, key: tuple) -> str:
    """Why ``key`` has no preparation: first call, or what differs from the last key of the
    same DAG (the entry concerned, when the DAG changed)."""
    last = _last.get((kind, id(dag)))
    if last is None or last[0] is not dag:
        return "first call"
    if last[1] == key:
        return last[2] or "its preparation was evicted (daskdag.prepared-calls)"
    for k, (old, new) in enumerate(zip(last[1], key)):
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
