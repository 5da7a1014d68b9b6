"""Running a call's graph in this process, on Dask's threaded scheduler: a task runs in the
calling thread when it is the only one running or known to be short (:data:`SHORT`, measured on
recent calls), as a thread's round trip costs as much as a tiny node's work. Also a prepared
call's graph built once (:class:`Template`), run in order by its :class:`Schedule`, and run
whole in one task (:class:`GraphInOneTask`); Python's full garbage collections held off while a
call runs here (:class:`FullCollectionsHeld`).
What it reads of the threaded scheduler that Dask does not document is in one place,
:func:`batch_tasks`, :func:`running` and :func:`threads_of` (checked by
``tests/test_internal_dask_local.py``).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import gc
import os
import threading
import time
from collections import Counter, deque
from typing import Any, Callable, Iterable

import dask.local
import jax
import dask.threaded
from dask.base import tokenize
from dask.callbacks import Callback
from dask.system import CPU_COUNT
from dask.task_spec import DataNode, GraphNode, Task, TaskRef
from dask.threaded import ContextAwareThreadPoolExecutor

from daskdag.cancel import Stop
from daskdag.caches import Cache
from daskdag.graph import tasks
from daskdag.graph.assembly import kind_of, runs
from daskdag.transport.packing import unpack, unwrap
from daskdag.transport.scope import within
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


def threads(dsk: dict, keys: list, functions: dict | None = None,
            filled: "Filled | None" = None, **kwargs):
    """``dask.threaded.get`` of ``dsk`` through an :class:`Inline` pool, or :func:`in_order`
    where every forward task but one at most is short; ``functions``: known ones'. A prepared
    call gives its ``filled`` graph instead, which runs in order by its :class:`Schedule`."""
    if filled is not None:
        keys, functions = filled.keys, filled.functions
    main = threading.current_thread() is threading.main_thread()
    timer = _Timer(keys[0], functions or {})
    if main and not Callback.active:  # (a progress bar, a Dask callback, needs Dask's)
        forward = (functions.values() if filled is not None else  # type: ignore[union-attr]
                   [timer.functions(k, t) for k, t in dsk.items() if kind_of(k) in FORWARD])
        if sum(not _known_short(f) for f in forward) <= 1:
            return filled.run(timer) if filled is not None else in_order(dsk, keys, timer)
    if filled is not None:
        dsk = filled.dsk
    if not main:
        return dask.threaded.get(dsk, keys, **kwargs)
    with Callback(start_state=timer.watch):
        return dask.threaded.get(dsk, keys, pool=Inline(_pool(), timer), **kwargs)


def sync(dsk: dict, keys: list, filled: "Filled | None" = None, **kwargs):
    """``dask.local.get_sync`` of ``dsk``; a prepared call's ``filled`` graph runs in order by
    its :class:`Schedule` (the same tasks in this thread, without Dask's bookkeeping), unless a
    Dask callback watches."""
    if filled is not None:
        if not Callback.active:
            return filled.run()
        dsk, keys = filled.dsk, filled.keys
    return dask.local.get_sync(dsk, keys, **kwargs)


def in_order(dsk: dict, keys: list, timer: "_Timer | None" = None) -> list:
    """The values of ``keys``, ``dsk``'s tasks run here in order (a :class:`Schedule` of it)."""
    return Schedule(dsk, keys, [k for k in dsk if kind_of(k) in FORWARD]).run({}, timer)


class Schedule:
    """A graph's tasks as plain calls, to run in order in one thread: each task's function with
    its arguments looked up among the values before it, each value let go after its last
    taker. Where the tasks wrapped in :func:`~daskdag.transport.scope.within` all have the same
    settings, the wrapper is entered once for the whole run, not once per task (the others, which
    pick values apart, run in it as they are); what a task computes is the same as under Dask's
    own schedulers (``tests/test_internal_schedule.py``).
    ``graph``: the tasks, in an order that runs each after its dependencies (a :class:`Template`'s
    is), without the values a run is given; ``forward``: the keys of its forward tasks, which a
    run's timer times.
    """

    def __init__(self, graph: dict, keys: list, forward: Iterable = ()):
        settings = {t.args[0] for t in graph.values() if _wrapped(t)}
        self.settings = settings.pop() if len(settings) == 1 else None
        self.keys, self.tasks, forward = list(keys), graph, set(forward)
        takers = Counter(d for task in graph.values() for d in task.dependencies)
        wanted = set(keys)
        self.steps = []
        for key, task in graph.items():
            frees = []
            for d in task.dependencies:
                takers[d] -= 1
                if not takers[d] and d not in wanted:
                    frees.append(d)
            self.steps.append((key, self._call(task), tuple(frees), key in forward))

    def _call(self, arg) -> Callable[[dict], Any]:
        """``arg`` (a task, or one of its arguments) as a function of the values before it."""
        if isinstance(arg, TaskRef):
            key = arg.key
            return lambda values: values[key]
        if not isinstance(arg, Task):  # (data, or a node Dask evaluates in its own way)
            deps = tuple(arg.dependencies) if isinstance(arg, GraphNode) else None
            return (lambda values: arg) if deps is None else (
                lambda values: arg({d: values[d] for d in deps}))
        fn, args, kwargs = arg.func, list(arg.args), dict(arg.kwargs)
        if fn is within and self.settings is not None and args[0] == self.settings:
            # (entered once, for the whole run)
            fn, args = args[1], args[2:]
        refs, calls = [], []  # (position, key), (position, function of the values)
        for i, a in enumerate(args):
            if isinstance(a, TaskRef):
                refs.append((i, a.key))
            elif isinstance(a, DataNode):
                args[i] = a.value
            elif isinstance(a, GraphNode):
                calls.append((i, self._call(a)))
        if any(isinstance(v, (TaskRef, GraphNode)) for v in kwargs.values()):
            kwarg_calls = {k: self._call(v) for k, v in kwargs.items()}
            return lambda values: fn(*_filled(args, refs, calls, values),
                                     **{k: c(values) for k, c in kwarg_calls.items()})
        if not calls and not kwargs:  # (the common task: values and constants)
            return lambda values: fn(*_filled(args, refs, (), values))
        return lambda values: fn(*_filled(args, refs, calls, values), **kwargs)

    def run(self, slots: dict, timer: "_Timer | None" = None) -> list:
        """The values of the graph's keys, with ``slots`` (``{key: value}``) filled in."""
        if self.settings is None:
            return self._run(dict(slots), timer)
        return within(self.settings, self._run, dict(slots), timer)

    def _run(self, values: dict, timer: "_Timer | None") -> list:
        for key, call, frees, forward in self.steps:
            if forward and timer is not None:
                start = time.perf_counter()
                values[key] = call(values)
                timer.record(key, self.tasks[key], time.perf_counter() - start)
            else:
                values[key] = call(values)
            for d in frees:
                del values[d]
        return [values[k] for k in self.keys]


def _filled(args: list, refs: list, calls, values: dict) -> list:
    """``args`` with the ``values`` of ``refs`` and what ``calls`` make of them in place."""
    args = args.copy()
    for i, key in refs:
        args[i] = values[key]
    for i, call in calls:
        args[i] = call(values)
    return args


def _wrapped(task) -> bool:
    """Whether ``task`` is one of daskdag's, wrapped in ``within``."""
    return isinstance(task, Task) and task.func is within


class FullCollectionsHeld:
    """A context manager: Python's full garbage collections (of its oldest generation) held off
    while a call runs its graph in this process, as Mercurial's ``nogc`` does for its large
    builds, but with the young generations still collected. A full collection walks every
    object of the process (JAX's own included) while a call keeps each node's values and
    pullback alive until its backward pass, so one during a call finds nothing to free, and a
    call of many small nodes grows the generations enough to make several. The oldest
    generation's threshold is back once the last call running here ends (unless it was set
    meanwhile), and in a process forked meanwhile, where no call runs; what the call left for a
    full collection is collected after it."""

    _lock = threading.Lock()
    _running = 0
    _threshold = 0  # the oldest generation's threshold before the first of them

    def __enter__(self) -> None:
        cls = FullCollectionsHeld  # (the count is the process's, not one instance's)
        with cls._lock:
            if cls._running == 0:
                young, middle, cls._threshold = gc.get_threshold()
                gc.set_threshold(young, middle, HELD)
            cls._running += 1

    def __exit__(self, *exc) -> None:
        cls = FullCollectionsHeld
        with cls._lock:
            cls._running -= 1
            if cls._running == 0:
                cls._back()

    @classmethod
    def forked(cls) -> None:
        """In a process just forked: no call runs here, so the threshold is back."""
        cls._lock = threading.Lock()
        if cls._running:
            cls._running = 0
            cls._back()

    @classmethod
    def _back(cls) -> None:
        young, middle, oldest = gc.get_threshold()
        if oldest == HELD:  # (else someone set it since: theirs stays)
            gc.set_threshold(young, middle, cls._threshold)


HELD = 2 ** 30  # the oldest generation's threshold while calls run: no full collection
os.register_at_fork(after_in_child=FullCollectionsHeld.forked)


SCHEDULERS = {"threads": threads, "sync": sync}
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

    @functools.cached_property
    def schedule(self) -> Schedule:
        """Its tasks as they run in order (made at the first call that runs them so)."""
        return Schedule(self.dsk, self.keys, self.functions)

    def __getstate__(self) -> dict:  # (where it is sent, it runs in order: untimed)
        state = {**self.__dict__, "functions": {}}
        state.pop("schedule", None)  # (its calls are closures: made again where it arrives)
        return state

    def fill(self, values: dict[TaskRef, Any]) -> "Filled":
        """The graph of one call, ``values`` in their slots (``{slot: value}``)."""
        return Filled(self, {ref.key: value for ref, value in values.items()})


class Filled:
    """A :class:`Template` filled for one call: its ``values`` (``{slot key: value}``)."""

    __slots__ = ("template", "values")

    def __init__(self, template: Template, values: dict) -> None:
        self.template, self.values = template, values

    @property
    def dsk(self) -> dict:
        """The call's graph for Dask: the slots' values as data, then the template's tasks."""
        dsk = {key: DataNode(key, value) for key, value in self.values.items()}
        dsk.update(self.template.dsk)  # (after the slots: in_order runs a graph in its order)
        return dsk

    @property
    def keys(self) -> list:
        return self.template.keys

    @property
    def structure(self):
        return self.template.structure

    @property
    def functions(self) -> dict:
        return self.template.functions

    def run(self, timer: "_Timer | None" = None) -> list:
        """The values of its keys, run in order here (:class:`Schedule`)."""
        return self.template.schedule.run(self.values, timer)


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
        return jax.tree.unflatten(filled.structure, filled.run())


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
