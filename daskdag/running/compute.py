"""Running one call's graph: on Dask's local scheduler or a ``distributed`` client, with an
optional progress bar over its tasks, and leaving nothing running when interrupted; what tasks
on workers tell their client while they run (:func:`listening`); and what daskdag logs under
the logger ``"daskdag"``: each call and sweep at INFO, tasks at DEBUG.

Ctrl-C: locally no further task starts, and the stages running stop at their next node (the
call's ``stop`` event). On a cluster the call's futures are released, so the scheduler cancels
every task no other call wants, and a running stage stops at its next node
(:func:`daskdag.cancel.dropped`).

Workers lost: the scheduler runs again what the lost ones held or ran (a call's inputs and nodes
are tasks too). While no worker can run the call, a :class:`~daskdag.running.cluster.Watch`
counts; past ``daskdag.worker-wait`` the call ends with a :class:`~daskdag.ClusterError`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import jax

from daskdag.graph.assembly import kind_of, runs
from daskdag.graph.whole import OneTask
from daskdag.model import implicit
from daskdag.running.cluster import Watch
from daskdag.running.local import FORWARD, SCHEDULERS, Filled, FullCollectionsHeld

POLL = 1.0  # seconds between two looks at the cluster while a call waits on it

logger = logging.getLogger("daskdag")
logger.addHandler(logging.NullHandler())


def compute(graph: dict, client, progress: bool = False, stop=None, local: str | None = None,
            plan=None) -> dict:
    """``graph`` (``{output: (value, {input: grad})}`` of ``Delayed``, a prepared local call's
    :class:`~daskdag.running.local.Filled` graph, or a cluster's call as one
    :class:`~daskdag.graph.whole.OneTask`) computed, in that structure: on ``client``, else on
    Dask's ``local`` scheduler, whatever default client exists. ``stop``: the
    ``daskdag.cancel.Stop`` a local graph's stages watch; set when the call ends early.
    ``plan``: the call's, for what the cluster must offer. On a cluster, the solves of implicit
    nodes that its tasks tell of go into the record of the call this thread runs
    (:func:`daskdag.model.implicit.recording`)."""
    dsk: dict = {}
    # (jax.tree sorts a dict's keys: the results go back in the order the call named them)
    order = list(graph) if isinstance(graph, dict) else plan.outputs if plan is not None else ()
    if isinstance(graph, Filled):  # a prepared local call's graph (local.Template)
        keys, structure = graph.keys, graph.structure
    elif isinstance(graph, OneTask):  # (a cluster's call, as distributed's own submit)
        keys, structure = [graph], jax.tree.structure(0)
    else:
        delayed, structure = jax.tree.flatten(graph)  # Delayed objects are leaves to JAX
        keys = delayed
        if client is None:  # (one graph: every result is a key of it)
            dsk, keys = dict(delayed[0].dask), [d.key for d in delayed]
    if client is None:
        # To the scheduler's own function: the graph is fused already, so dask.compute's
        # optimizations would cost for nothing.
        try:
            from dask.diagnostics import ProgressBar  # (only for a bar: its import is slow)
            with ProgressBar() if progress else contextlib.nullcontext(), \
                    FullCollectionsHeld():
                run: Any = SCHEDULERS[local or "threads"]
                computed = (run(None, keys, filled=graph) if isinstance(graph, Filled) else
                            run(dsk, keys))
        except BaseException:  # Ctrl-C, or a failed node: running stages stop at their next node
            if stop is not None:
                stop.set()
            raise
        return _in_order(jax.tree.unflatten(structure, computed), order)
    record = implicit.recorded()
    told: list = []  # [task key, node, solve] that workers told of (implicit.TOPIC)
    with listening(client, implicit.TOPIC, told.append) if record is not None \
            else contextlib.nullcontext():  # (listening before the graph goes)
        futures = ([client.submit(graph.fn, *graph.args, key=graph.key, pure=False,
                                  resources=graph.needs or None)]
                   if isinstance(graph, OneTask) else client.compute(keys))
        try:
            with _bar(client, futures) if progress else contextlib.nullcontext():
                wait(client, futures, Watch(client, plan))
            computed = client.gather(futures)
        finally:  # early (Ctrl-C, a failed node): free the scheduler of this call's tasks now
            for f in futures:
                f.release()
    ours = {graph.key} if isinstance(graph, OneTask) else delayed[0].dask
    for key, node, solve in told:  # (the solves of other calls' tasks are theirs)
        if key in ours:
            record.setdefault(node, []).append(solve)  # type: ignore[union-attr]
    return _in_order(jax.tree.unflatten(structure, computed), order)


def _in_order(results: dict, order) -> dict:
    """``results`` with the keys named in ``order`` first, in that order."""
    return {**{k: results[k] for k in order if k in results}, **results}


def wait(client, futures: list, watch: Watch) -> None:
    """Until every future is done, looking at the cluster every :data:`POLL` seconds meanwhile
    (``watch.check()`` raises when it can no longer run them). Told by the futures' callbacks:
    ``distributed.wait`` needs ``Client.as_current``, which sets Dask's global config, left
    wrong by calls from several threads that finish out of order."""
    done = Arrivals(futures)
    while not done.all(POLL):
        watch.check()


class Arrivals:
    """Which of some ``distributed`` futures are done (finished, failed or cancelled), as their
    callbacks tell: :meth:`all` and :meth:`any` wait for them, up to a timeout. More futures
    can be added as they are made."""

    def __init__(self, futures=()):
        self.lock, self.event, self.waiting = threading.Lock(), threading.Event(), 0
        for f in futures:
            self.add(f)

    def add(self, future) -> None:
        with self.lock:
            self.waiting += 1
        future.add_done_callback(self._arrived)

    def _arrived(self, future) -> None:
        with self.lock:
            self.waiting -= 1
        self.event.set()

    def all(self, timeout: float) -> bool:
        """Whether all have arrived, waiting ``timeout`` seconds at most."""
        deadline = time.monotonic() + timeout
        while self.waiting > 0:
            left = deadline - time.monotonic()
            if left <= 0 or not self.event.wait(left):
                return False
            self.event.clear()
        return True

    def any(self, timeout: float) -> bool:
        """Whether some arrived since the last call, waiting ``timeout`` seconds at most."""
        arrived = self.event.wait(timeout)
        self.event.clear()
        return arrived


@contextlib.contextmanager
def _bar(client, futures):
    """distributed's text progress bar over ``futures``, drawn from a thread of its own while
    the call waits (it blocks; a notebook's widget would show nothing)."""
    import distributed  # (imported once a call goes to a cluster)
    bar = threading.Thread(target=distributed.progress, args=(futures,), daemon=True,
                           kwargs={"scheduler": client.scheduler.address, "notebook": False})
    bar.start()
    yield
    bar.join(timeout=2.0)  # (a call that finished: the bar draws its last state)


# -- what tasks on workers tell their client ------------------------------------------------------
# Through distributed's event log: each event goes to every listener of its topic, which keeps
# what is its own.

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


# -- what is logged of each call ------------------------------------------------------------------

def log_submitted(kind: str, plan, graph: dict, where: str, placed: int | None = None) -> None:
    """Log one call's graph as it goes to ``where``, with the bytes it ``placed`` there."""
    if not logger.isEnabledFor(logging.INFO):
        return
    tasks = _tasks(graph)
    stages = sum(1 for k in tasks if kind_of(k) in FORWARD)
    logger.info("%s: outputs %s, wrt %s: %d stages, %d tasks, on %s%s", kind, list(plan.outputs),
                list(plan.wrt), stages, len(tasks), where,
                "" if placed is None else f"; placed {placed} bytes on the cluster")
    if logger.isEnabledFor(logging.DEBUG):
        for key, task in tasks.items():
            fn = runs(task)
            logger.debug("  task %s: %s", key, getattr(fn, "__qualname__", type(task).__name__))


def log_whole(kind: str, plan, where: str) -> None:
    """Log one call run as one program (:mod:`daskdag.graph.whole`) at ``where``."""
    logger.info("%s: outputs %s, wrt %s: one program, on %s", kind, list(plan.outputs),
                list(plan.wrt), where)


def log_reused(kind: str, nodes) -> None:
    """Log the nodes whose values a call took from the call before."""
    logger.info("%s: nodes %s reused from the call before (their inputs are the same)", kind,
                list(nodes))


def _tasks(graph) -> dict:
    if isinstance(graph, Filled):
        return graph.dsk
    if isinstance(graph, OneTask):
        return {graph.key: graph}
    merged = {}
    for delayed in jax.tree.leaves(graph):  # (Delayed objects are leaves to JAX)
        merged.update({k: v for layer in delayed.dask.layers.values() for k, v in layer.items()})
    return merged
