"""What a client keeps on its cluster between calls: the packed inputs and nodes of its last few
``compute_grads`` calls, and the shared inputs and chunk graphs of its last few sweeps, each
under a content key, so a repeated call sends only what changed.

A call's graph refers to these values instead of carrying them (:func:`daskdag._graph.build`'s
``place``). Each goes to the cluster once, as a task whose result is the value: the scheduler
keeps it as that task's recipe, so when the worker holding it dies it is computed again
elsewhere (a scattered value would be lost with its only holder). Keys are content tokens
(:mod:`daskdag._shipping`), so an in-place change to an input or a closed-over array gives a new
key, and the old value is dropped once no recent call uses it.

``dask.config`` ``daskdag.keep-calls`` (default 8): how many recent calls' values a client keeps;
0 keeps none, and values travel inside each call's graph again.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
import warnings
import weakref
from collections import deque

import dask
from dask.sizeof import sizeof

from ._cluster import workers

KEEP_CALLS = "daskdag.keep-calls"
KEEP_CALLS_DEFAULT = 8

_FAILED = ("error", "cancelled", "lost")
_lock = threading.Lock()
_by_client: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> Resident


class Resident:
    """One client's kept values. ``sent`` counts the bytes placed so far (a measure, for the
    benchmarks and the log)."""

    def __init__(self):
        # (No reference to the client: this object is the value of a weak-keyed dict.)
        self.futures: dict = {}  # key -> the future holding it
        self.recent: deque[set] = deque()  # keys each recent call used, oldest first
        self.sent = 0
        self.home: str | None = None  # the worker its values go to (those needing no resources)

    def _home(self, client) -> str | None:
        """One worker for all of this client's values that need no resources, so that a call's
        nodes and inputs sit together and its forward chain does not hop between workers for
        them (Dask places tasks by their data). Chosen anew when it left."""
        live = workers(client)
        if self.home not in live:
            self.home = min(live, key=lambda w: live[w].get("metrics", {}).get("memory", 0),
                            default=None)
        return self.home

    @contextlib.contextmanager
    def call(self, client):
        """For one call: yields ``place(key, fn, payload, needs=None) -> Future``, the value
        ``fn(payload)`` kept under ``key``, sent now unless a recent call sent it, to a worker
        with the resources ``needs`` (those of the node that uses it). On exit, values that none
        of the last ``daskdag.keep-calls`` calls used are let go."""
        used: set = set()
        home: list = []  # this call's home worker, asked of the scheduler once, when needed

        def place(key, fn, payload, needs=None):
            with _lock:
                fut = self.futures.get(key)
                if fut is None or fut.status in _FAILED:
                    # A key that failed (it could not be unpickled there, say) may still be
                    # known to the scheduler as failed: try again under a key of its own.
                    name = key if fut is None else f"{key}-{uuid.uuid4().hex[:8]}"
                    if not needs and not home:
                        home.append(self._home(client))
                    fut = keep(client, name, fn, payload, needs, None if needs else home[0])
                    self.futures[key] = fut
                    self.sent += sizeof(payload)
                used.add(key)
                return fut

        try:
            yield place
        finally:
            with _lock:
                self.recent.append(used)
                while len(self.recent) > max(1, dask.config.get(KEEP_CALLS, KEEP_CALLS_DEFAULT)):
                    self.recent.popleft()
                live = set().union(*self.recent)
                for key in [k for k in self.futures if k not in live]:
                    self.futures.pop(key).release()


def keep(client, key: str, fn, payload, needs=None, worker: str | None = None):
    """``fn(payload)`` on the cluster under ``key``, as a task whose result is the value: the
    scheduler keeps a task's recipe (here the payload), so when the worker holding the result
    dies it runs the task again on another (a scattered value is lost with its only holder).
    ``needs``: the resources of the worker it should go to; ``worker``: the one it should go to
    while that one lives."""
    with warnings.catch_warnings():  # sending the value in the graph, once, is the point
        warnings.filterwarnings("ignore", message="Sending large graph")
        where = {"workers": [worker], "allow_other_workers": True} if worker else {}
        return client.submit(fn, payload, key=key, pure=False, resources=needs or None, **where)


@contextlib.contextmanager
def placing(client):
    """``place(key, fn, payload, needs=None) -> Future`` for one call, as
    :meth:`Resident.call` yields it: through ``client``'s :class:`Resident`, so values stay for
    the next calls; with keeping off (``daskdag.keep-calls`` 0), under keys of this call's own,
    each cancelled and let go on exit."""
    kept = of(client)
    if kept is not None:
        with kept.call(client) as place:
            yield place
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
    if dask.config.get(KEEP_CALLS, KEEP_CALLS_DEFAULT) <= 0:
        return None
    with _lock:
        resident = _by_client.get(client)
        if resident is None:
            resident = _by_client[client] = Resident()
        return resident
