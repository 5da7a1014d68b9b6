"""What tasks on workers tell their client while they run, through distributed's event log:
each event goes to every listener of its topic, which keeps what is its own."""

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
    """Within it, ``handler(message)`` for each event of ``topic`` reaching ``client``. A client
    stays subscribed: an event no one listens to is dropped here (distributed would log one)."""
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
