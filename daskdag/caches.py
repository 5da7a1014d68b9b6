"""What daskdag keeps between calls in this process, and :func:`clear_caches`, which drops it all.

Every cache is a :class:`Cache` (bounded, thread-safe), keyed by what makes an entry valid, so
that an entry is either right for the key or absent; others register how to empty them
(:func:`register`).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Generic, Hashable, TypeVar

V = TypeVar("V")
_MISSING = object()
_clearers: dict[str, Callable[[], None]] = {}


class Cache(Generic[V]):
    """A bounded, thread-safe mapping: at most ``size`` entries (a number, or a function read
    at each insertion, such as a ``dask.config`` setting), the least recently used evicted
    first; ``size`` 0 keeps nothing. ``name`` says what it holds, for :func:`clear_caches`."""

    def __init__(self, name: str, size: int | Callable[[], int]):
        self.name = name
        self._size = size if callable(size) else (lambda: size)
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.RLock()  # (re-entrant: an eviction may run a weakref callback)
        register(name, self.clear)

    def get(self, key: Hashable, default: Any = None) -> V | Any:
        with self._lock:
            value = self._entries.get(key, _MISSING)
            if value is _MISSING:
                return default
            self._entries.move_to_end(key)
            return value

    def put(self, key: Hashable, value: V) -> V:
        size = max(0, int(self._size()))
        with self._lock:
            if size:
                self._entries[key] = value
                self._entries.move_to_end(key)
            while len(self._entries) > size:
                self._entries.popitem(last=False)
        return value

    def setdefault(self, key: Hashable, make: Callable[[], V]) -> V:
        """The entry for ``key``, made by ``make()`` and kept when there is none (for a cache
        of ``size`` 0, made and not kept)."""
        with self._lock:
            value = self.get(key, _MISSING)
            return self.put(key, make()) if value is _MISSING else value

    def pop(self, key: Hashable, default: Any = None) -> V | Any:
        with self._lock:
            return self._entries.pop(key, default)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries


class ByObject(Generic[V]):
    """A :class:`Cache` keyed by objects' identity, each entry going with its object (held
    weakly where it can be: a function or an array it describes is not kept alive by it)."""

    def __init__(self, name: str, size: int | Callable[[], int]):
        self._cache: Cache[tuple[Callable[[], Any], V]] = Cache(name, size)

    def get(self, obj: Any, default: Any = None) -> V | Any:
        hit = self._cache.get(id(obj))
        return hit[1] if hit is not None and hit[0]() is obj else default

    def put(self, obj: Any, value: V) -> V:
        key = id(obj)
        try:
            ref: Callable[[], Any] = weakref.ref(obj, lambda r: self._forget(key, r))
        except TypeError:  # not weakly referenceable: held, as the value holds it anyway
            ref = _Strong(obj)
        self._cache.put(key, (ref, value))
        return value

    def _forget(self, key: int, ref: Callable[[], Any]) -> None:
        hit = self._cache.get(key)
        if hit is not None and hit[0] is ref:
            self._cache.pop(key)

    def clear(self) -> None:
        self._cache.clear()

    def __len__(self) -> int:
        return len(self._cache)


class _Strong:
    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


def register(name: str, clear: Callable[[], None]) -> None:
    """Have :func:`clear_caches` call ``clear`` (the cache called ``name``)."""
    _clearers[name] = clear


def clear_caches() -> None:
    """Drop everything daskdag keeps between calls in this process: prepared calls (a
    [`Prepared`][daskdag.Prepared] function's own included), packed functions and their
    fingerprints, compiled programs, sparsity patterns and colourings, learned task durations.
    The next call prepares everything again, as a first call does. (JAX's own compilation
    caches are JAX's: ``jax.clear_caches()``.)

    For example:

    ```python
    import daskdag

    daskdag.clear_caches()
    ```
    """
    for clear in list(_clearers.values()):
        clear()
