"""What tasks on a cluster's workers tell their client while they run, through distributed's
event log (``Worker.log_event``, ``Client.subscribe_topic``): a sweep's progress, the solves of
implicit nodes. Several calls or sweeps of one client may listen to one topic at once: each
event goes to every listener of its topic, which keeps what is its own.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

_lock = threading.Lock()
# (client id, topic) -> {listener id: handler(message)}, for the listeners in this process
_listeners: dict[tuple[str, str], dict[int, Callable[[Any], None]]] = {}
_subscribed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # client -> its topics


@contextlib.contextmanager
def listening(client, topic: str, handler: Callable[[Any], None]) -> Iterator[None]:
    """Within it, ``handler(message)`` for each event of ``topic`` that reaches ``client`` (in
    its event loop's thread). The subscription is sent before anything submitted within it,
    and a worker's events reach the client before the completion of a task that it reported
    after them. A client stays subscribed to a topic once it was: an event that reaches it
    when no one listens (from a task of a call that ended early) is dropped here, where
    distributed would log an error for a topic it has no handler for."""
    where, me = (client.id, topic), object()
    with _lock:
        _listeners.setdefault(where, {})[id(me)] = handler
        topics = _subscribed.setdefault(client, set())
        if topic not in topics:
            client.subscribe_topic(topic, partial(_heard, where))
            topics.add(topic)
    try:
        yield
    finally:
        with _lock:
            mine = _listeners[where]
            mine.pop(id(me))
            if not mine:
                del _listeners[where]


def _heard(where: tuple[str, str], event: tuple[float, Any]) -> None:
    with _lock:
        handlers = list(_listeners.get(where, {}).values())
    for handler in handlers:
        handler(event[1])
