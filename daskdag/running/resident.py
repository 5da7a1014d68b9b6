"""What a client keeps on its cluster between calls, under content keys, so that a call sends
only what changed; kept while one of the last ``daskdag.keep-calls`` calls uses it."""

from __future__ import annotations

import contextlib
import threading
import uuid
import warnings
import weakref
from collections import deque

from dask.sizeof import sizeof
import daskdag.config as config

_FAILED = ("error", "cancelled", "lost")
_lock = threading.Lock()
_by_client: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> Resident


class Resident:
    """One client's kept values. ``sent`` counts the bytes placed so far (for the log)."""

    def __init__(self):
        # (No reference to the client: this object is the value of a weak-keyed dict.)
        self.futures: dict = {}  # key -> the future holding it
        self.recent: deque[set] = deque()  # keys each recent call used, oldest first
        self.running: list[set] = []  # keys each call under way uses (several threads' calls)
        self.sent = 0

    @contextlib.contextmanager
    def keeping(self, client):
        """For one call: yields ``place(key, fn, payload, needs=None) -> Future``, the value
        ``fn(payload)`` kept under ``key``; on exit, values no recent call used are let go."""
        used: set = set()

        def place(key, fn, payload, needs=None):
            with _lock:
                fut = self.futures.get(key)
                if fut is None or fut.status in _FAILED:
                    # (the scheduler may still know a failed key: try again under a new one)
                    name = key if fut is None else f"{key}-{uuid.uuid4().hex[:8]}"
                    fut = keep(client, name, fn, payload, needs)
                    self.futures[key] = fut
                    self.sent += sizeof(payload)
                used.add(key)
                return fut

        with _lock:
            self.running.append(used)
        try:
            yield place
        finally:
            with _lock:
                self.running.remove(used)
                self.recent.append(used)
                while len(self.recent) > max(1, config.get("keep-calls")):
                    self.recent.popleft()
                live = set().union(*self.recent, *self.running)
                for key in [k for k in self.futures if k not in live]:
                    self.futures.pop(key).release()


def keep(client, key: str, fn, payload, needs=None):
    """``fn(payload)`` on the cluster under ``key``, as a task (recomputed if its worker dies)."""
    with warnings.catch_warnings():  # sending the value in the graph, once, is the point
        warnings.filterwarnings("ignore", message="Sending large graph")
        return client.submit(fn, payload, key=key, pure=False, resources=needs or None)


@contextlib.contextmanager
def placing(client):
    """``place`` for one call (with keeping off, under keys of its own, cancelled on exit)."""
    kept = of(client)
    if kept is not None:
        with kept.keeping(client) as kept_place:
            yield kept_place
        return
    held: list = []

    def place(key, fn, payload, needs=None):
        held.append(keep(client, f"{key}-{uuid.uuid4().hex}", fn, payload, needs))
        return held[-1]

    try:
        yield place
    finally:
        if held:
            with contextlib.suppress(Exception):  # a closed client has nothing left to cancel
                client.cancel(held)
            for fut in held:
                fut.release()


def of(client) -> Resident | None:
    """The client's :class:`Resident`, or ``None`` when keeping is turned off."""
    if config.get("keep-calls") <= 0:
        return None
    with _lock:
        return _by_client.setdefault(client, Resident())
