"""Running a call's graph in this process, on Dask's threaded scheduler: a task runs in the
calling thread when it is the only one running or known to be short (:data:`SHORT`, measured on
recent calls), as a thread's round trip costs as much as a tiny node's work. Also a prepared
call's graph built once (:class:`Template`), and run whole in one task (:class:`GraphInOneTask`).
What it reads of the threaded scheduler that Dask does not document is in one place,
:func:`batch_tasks`, :func:`running` and :func:`threads_of` (checked by
``tests/test_internal_dask_local.py``).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import threading
import time
from collections import Counter, deque
from typing import Any, Callable

import dask.local
import jax
import dask.threaded
from dask.base import tokenize
from dask.callbacks import Callback
from dask.system import CPU_COUNT
from dask.task_spec import DataNode, TaskRef
from dask.threaded import ContextAwareThreadPoolExecutor

from daskdag.cancel import Stop
from daskdag.caches import Cache
from daskdag.graph import tasks
from daskdag.graph.assembly import kind_of, runs
from daskdag.transport.packing import unpack, unwrap
from daskdag.transport.weak import held, ref
from daskdag.model.spec import Custom, Node

SHORT = 5e-3  # seconds: a task shorter than this gains nothing from a thread of its own
CHEAP = (tasks.pick, tasks.cotangents_of, tasks.gradient)  # they pick or sum values: always short
KNOWN = 4096  # node functions whose durations are remembered (the most recent ones)
SAMPLES = 8  # durations remembered per node functions

_lock = threading.Lock()
# a stage's node functions (Functions) -> their recent durations
_durations: Cache[deque] = Cache("learned durations of local tasks", KNOWN)
_threads: list = []  # the pool, once made


def threads(dsk: dict, keys: list, functions: dict | None = None, **kwargs):
    """``dask.threaded.get`` of ``dsk`` through an :class:`Inline` pool, or :func:`in_order`
    where every forward task but one at most is short; ``functions``: known ones'."""
    if threading.current_thread() is not threading.main_thread():
        return dask.threaded.get(dsk, keys, **kwargs)
    timer = _Timer(keys[0], functions or {})
    if not Callback.active and sum(not _known_short(timer.functions(key, task))
                                   for key, task in dsk.items() if kind_of(key) in FORWARD) <= 1:
        return in_order(dsk, keys, timer)  # (a progress bar, a Dask callback, needs Dask's)
    with Callback(start_state=timer.watch):
        return dask.threaded.get(dsk, keys, pool=Inline(_pool(), timer), **kwargs)


def in_order(dsk: dict, keys: list, timer: "_Timer | None" = None) -> list:
    """The values of ``keys``, ``dsk``'s tasks run here in order, each let go once unused."""
    takers = Counter(d for task in dsk.values() for d in task.dependencies)
    values: dict[Any, Any]
    wanted, values = set(keys), {}
    for key, task in dsk.items():
        start = time.perf_counter()
        values[key] = task({d: values[d] for d in task.dependencies})
        if timer is not None and kind_of(key) in FORWARD:
            timer.record(key, task, time.perf_counter() - start)
        for d in task.dependencies:
            takers[d] -= 1
            if not takers[d] and d not in wanted:
                del values[d]
    return [values[k] for k in keys]


SCHEDULERS = {"threads": threads, "sync": dask.local.get_sync}
FORWARD = ("fwd", "jvp")


def slot(kind: str, name: str = "") -> TaskRef:
    """Where a :class:`Template` takes a value at each call; ``kind``: ``"input"``,
    ``"tangent"``, ``"cotangent"`` or ``"stop"``."""
    return TaskRef(f"slot:{kind}:{name}")


class Template:
    """A local call's graph, built once with :func:`slot` s, and filled at each call."""

    def __init__(self, built: dict) -> None:
        leaves, self.structure = jax.tree.flatten(built)  # (Delayed objects are leaves)
        self.dsk = dict(leaves[0].dask)
        self.keys = [d.key for d in leaves]
        self.functions = {k: functions_of(t) for k, t in self.dsk.items() if kind_of(k) in FORWARD}

    def __getstate__(self) -> dict:  # (where it is sent, it runs in order: untimed)
        return {**self.__dict__, "functions": {}}

    def fill(self, values: dict[TaskRef, Any]) -> "Filled":
        """The graph of one call, ``values`` in their slots (``{slot: value}``)."""
        dsk = {ref.key: DataNode(ref.key, value) for ref, value in values.items()}
        dsk.update(self.dsk)  # (after the slots: in_order runs a graph in its order)
        return Filled(dsk, self.keys, self.structure, self.functions)


class Filled:
    """A :class:`Template` filled for one call."""

    __slots__ = ("dsk", "keys", "structure", "functions")

    def __init__(self, dsk: dict, keys: list, structure, functions: dict) -> None:
        self.dsk, self.keys, self.structure, self.functions = dsk, keys, structure, functions


class _Timer:
    """The forward tasks of one call, timed; ``watch`` gets the state of ``key``'s scheduler."""

    def __init__(self, key, functions: dict):
        self.key, self.state, self.known = key, None, functions
        self.took: dict = {}  # key -> seconds, for this call's forward tasks

    def watch(self, dsk, state):
        if self.key in dsk:
            self.state = state

    def functions(self, key, task) -> Functions:
        known = self.known.get(key)
        return known if known is not None else functions_of(task)

    def record(self, key, task, seconds: float) -> None:
        self.took[key] = seconds
        _remember(self.functions(key, task), seconds)


class Inline:
    """The pool of one call (see the module's docstring), whose forward tasks ``timer`` times."""

    def __init__(self, pool, timer: _Timer):
        self.pool, self._max_workers, self.timer = pool, threads_of(pool), timer

    def submit(self, fn, *args):
        if not self._here(batch_tasks(args)):
            return self.pool.submit(self._timed, fn, args)
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            done.set_result(self._timed(fn, args))  # (dask packs a task's exception)
        except BaseException as e:
            done.set_exception(e)
        return done

    def _timed(self, fn, args):
        # Tasks running side by side share the GIL: a task's time is divided by how many ran.
        state = self.timer.state
        alongside = min(running(state), self._max_workers + 1) if state is not None else 1
        start = time.perf_counter()
        out = fn(*args)
        batch = batch_tasks(args)
        if len(batch) == 1 and kind_of(batch[0][0]) in FORWARD:  # (one task at a time)
            took = (time.perf_counter() - start) / max(1, alongside)
            self.timer.record(*batch[0], took)
        return out

    def _here(self, batch) -> bool:
        state = self.timer.state
        if state is not None and running(state) == 1:
            return True
        return all(self._short(key, task) for key, task in batch)

    def _short(self, key, task) -> bool:
        if runs(task) in CHEAP:
            return True
        kind = kind_of(key)
        if kind == "bwd":  # a backward pass takes about as long as its forward
            took = self.timer.took
            fwd = next((a.key for a in task.args if isinstance(a, TaskRef) and a.key in took), None)
            return fwd is not None and took[fwd] < SHORT
        return kind in FORWARD and _known_short(self.timer.functions(key, task))


def _known_short(functions: Functions) -> bool:
    """Node ``functions`` (a forward task's) that took less than :data:`SHORT` recently."""
    recent = _durations.get(functions)
    return recent is not None and min(recent) < SHORT


def functions_of(task) -> Functions:
    """The node functions a forward task runs, as the user made them."""
    fns: list[Any] = []
    for a in task.args:
        if isinstance(a, Node):
            fn = held(unwrap(a.fn))
            fns.extend(held(f) for f in ((fn.fn, fn.fwd) if isinstance(fn, Custom) else (fn,)))
    return Functions(fns)


class Functions:
    """Node functions as a key, equal to another for the same live functions (held weakly)."""

    __slots__ = ("ids", "refs", "_hash")

    def __init__(self, fns: list) -> None:
        self.ids = tuple(map(id, fns))
        self.refs = tuple(map(ref, fns))
        self._hash = hash(self.ids)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Functions) and self.ids == other.ids
            and all(a() is not None and a() is b() for a, b in zip(self.refs, other.refs)))

    def __reduce__(self) -> tuple:  # (where it arrives, they are not these functions)
        return Functions, ([],)


def _remember(functions: Functions, seconds: float) -> None:
    """Keep the last :data:`SAMPLES` durations (the shortest is what the functions take)."""
    _durations.setdefault(functions, lambda: deque(maxlen=SAMPLES)).append(seconds)


def batch_tasks(args: tuple) -> list[tuple[Any, Any]]:
    """``(key, task)`` of each task of the batch ``dask.local`` submitted with ``args``."""
    return [(key, task) for key, (task, _), *_ in args[0]]


def running(state: dict) -> int:
    """How many tasks run now, by the threaded scheduler's ``state``."""
    return len(state["running"])


def threads_of(pool: concurrent.futures.ThreadPoolExecutor) -> int:
    """The number of threads ``pool`` runs at most."""
    return pool._max_workers


def _pool():
    with _lock:
        if not _threads:
            _threads.append(ContextAwareThreadPoolExecutor(CPU_COUNT))
            atexit.register(_threads[0].shutdown)
        return _threads[0]


class GraphInOneTask:
    """A cluster call's graph run whole inside one task: a :class:`Template`, kept on the
    cluster under its :attr:`token`, filled with the values of its ``slots`` (``(kind, name)``)
    and of its ``kept`` values, ``(key, fn, payload, needs)``, placed again by each call."""

    def __init__(self, template: Template, slots: tuple[tuple[str, str], ...], needs: dict,
                 kept: tuple = ()):
        self.template, self.slots, self.needs, self.kept = template, slots, needs, kept
        self.kept_keys = tuple(k for k, *_ in kept)

    @classmethod
    def built(cls, build: Callable[[Any], Any], slots: tuple[tuple[str, str], ...],
              needs: dict) -> GraphInOneTask:
        """The graph that ``build(place)`` builds, its kept values recorded."""
        kept: list = []

        def place(key, fn, payload, needs=None):
            kept.append((key, fn, payload, needs))
            return TaskRef(key)

        return cls(Template(build(place)), slots, needs, tuple(kept))

    @functools.cached_property
    def token(self) -> str:
        """What the graph is: its keys, and the slots and kept keys a call fills, in order."""
        return tokenize(self.template.keys, list(self.template.dsk), self.slots, self.kept_keys)

    def __reduce__(self):
        return _receive_graph, (self.token, self.template, self.slots, self.needs, self.kept_keys)

    def __call__(self, *values) -> Any:
        """The call's results for the values of its slots, then kept keys."""
        n = len(self.slots)
        filled = self.template.fill({**{slot(*s): v for s, v in zip(self.slots, values[:n])},
                                     **{TaskRef(k): v for k, v in zip(self.kept_keys, values[n:])},
                                     slot("stop"): Stop()})
        return jax.tree.unflatten(filled.structure, in_order(filled.dsk, filled.keys))


_graphs: Cache[GraphInOneTask] = Cache("graphs received to run in one task", 32)


def _receive_graph(token: str, template: Template, slots: tuple, needs: dict,
                   kept_keys: tuple) -> GraphInOneTask:
    hit = _graphs.get(token)
    if hit is None:
        hit = _graphs.put(token, GraphInOneTask(template, slots, needs))
        hit.token, hit.kept_keys = token, kept_keys
    return hit


def run_graph(graph: GraphInOneTask, *values) -> Any:
    """``graph`` run as a task, with its slots' packed values, then its kept values."""
    return graph(*(unpack(v) for v in values))
