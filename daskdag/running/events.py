"""What tasks on a cluster's workers tell their client while they run, through distributed's
event log (``Worker.log_event``, ``Client.subscribe_topic``): a sweep's progress, the solves of
implicit nodes. Several calls or sweeps of one client may listen to one topic at once: each
event goes to every listener of its topic, which keeps what is its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

_lock = threading.Lock()
# (client id, topic) -> {listener id: handler(message)}, for the listeners in this process
_listeners: dict[tuple[str, str], dict[int, Callable[[Any], None]]] = {}


@contextlib.contextmanager
def listening(client, topic: str, handler: Callable[[Any], None]) -> Iterator[None]:
    """Within it, ``handler(message)`` for each event of ``topic`` that reaches ``client`` (in
    its event loop's thread). The client's subscription is sent before anything submitted
    within it, and events reach the client in the order their workers logged them, before a
    task's completion that the worker reported after them."""
    where, me = (client.id, topic), object()
    with _lock:
        first = where not in _listeners
        _listeners.setdefault(where, {})[id(me)] = handler
        if first:
            client.subscribe_topic(topic, lambda event: _heard(where, event))
    try:
        yield
    finally:
        with _lock:
            mine = _listeners[where]
            mine.pop(id(me))
            if not mine:
                del _listeners[where]
                with contextlib.suppress(Exception):  # a closed client is subscribed to nothing
                    client.unsubscribe_topic(topic)


def _heard(where: tuple[str, str], event: tuple[float, Any]) -> None:
    with _lock:
        handlers = list(_listeners.get(where, {}).values())
    for handler in handlers:
        handler(event[1])
