"""Assembling a call's Dask graph, for every builder: task keys, how a graph takes in values it
does not compute (:class:`Intake`), and the graph itself (:class:`TaskGraph`).

Keys are readable, and their prefix (:func:`key`) names the stage, so that Dask learns how long
each stage takes: ``fwd:B+C-<token>``. Keys are read back only through :func:`kind_of` and
:func:`token_of`. Each key is a function of its whole task: the same key never names two tasks
that differ (distributed's "different `run_spec`").

The tasks go straight into one :class:`~dask.highlevelgraph.HighLevelGraph`, never through
``dask.delayed`` calls, each of which merges its arguments' graphs (quadratic in the nodes).
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any, Protocol

import dask
from dask.base import tokenize
from dask.delayed import Delayed
from dask.highlevelgraph import HighLevelGraph, Layer, MaterializedLayer
from dask.sizeof import sizeof
from dask.task_spec import GraphNode, List, Task, TaskRef

from daskdag.graph.run import identity
from daskdag.transport.packing import unpack
from daskdag.transport.scope import JaxSettings, within
from daskdag.transport.transports import Transport

# A packed input or node of at most this many bytes travels inside each task that takes it: a
# task whose inputs are all small then depends on no other task, and the scheduler spreads such
# tasks over the workers. A larger one is a task of its own, sent once.
INLINE_BYTES = 64 * 1024


def key(kind: str, label: str, token: str) -> str:
    """A task key: ``fwd:B+C-<token>``. Dask's prefix of it (``dask.utils.key_split``) is
    ``fwd:B+C``, everything before the token, unless a node name holds a ``-`` before a word
    that is not all letters: the prefix stops there (node ``x-1``: ``fwd:x``)."""
    return f"{kind}:{label}-{token}"


def kind_of(task_key) -> str:
    """The kind of a daskdag key (``fwd``, ``bwd``, ``val``, ``grad``, ...), else ``""``."""
    head = str(task_key).partition("-")[0]
    return head.partition(":")[0] if ":" in head else ""


class Inline:
    """A value that tasks take inside their own spec: ``arg``, the value itself or a nested task
    unpacking it; ``token`` identifies it in the keys of the tasks that take it."""

    __slots__ = ("arg", "token")

    def __init__(self, arg, token: str | None):
        self.arg, self.token = arg, token


def ident(ref) -> str | None:
    """What identifies a task's argument in its key: a task's key, or an inline value's token."""
    return ref.token if isinstance(ref, Inline) else ref.key


class Keeper(Protocol):
    """Where a durable call keeps its stages' results (:mod:`daskdag.durable.calls`), as its
    forward tasks use it (:func:`kept`): picklable, so that the task that computes a stage
    writes its result, wherever it runs. ``token``: what the keys of its calls' tasks hold,
    so that they differ from those of calls that keep nothing."""

    token: str

    def load(self, entry: str, inputs: tuple) -> tuple[bool, Any, str]:
        """``(found, result, digest)``: the result kept under ``entry`` for these ``inputs``
        (the stage's values in; ``digest``, their hash), where one is kept and intact."""
        ...

    def save(self, entry: str, digest: str, result: Any) -> Any:
        """``result`` kept under ``entry``, for inputs whose hash is ``digest``, durably;
        returns it as :meth:`load` reads it back (its pullback as the program it keeps)."""
        ...


def kept(keeper: Keeper, entry: str, inputs_at: int, fn, *args):
    """``fn(*args)``, read from ``keeper`` where it kept it for the same inputs (``args`` from
    ``inputs_at`` on), else computed and kept there, and returned as it reads back: so that
    a call's backward passes run the same pullbacks, to the bit, whether it ran through or
    was resumed."""
    found, result, digest = keeper.load(entry, args[inputs_at:])
    if found:
        return result
    return keeper.save(entry, digest, fn(*args))


class Intake:
    """How one call's graph takes in what it does not compute, its inputs and nodes, and the
    tokens of its keys, as its ``transport`` says (:mod:`daskdag.transport.transports`).

    Where values are packed, one of at most :data:`INLINE_BYTES` goes inline in each task that
    takes it; a larger one is a task of its own: kept on the cluster by ``place(key, fn,
    payload, needs) -> Future`` when given, else a task of ``graph``."""

    def __init__(self, graph: "TaskGraph", transport: Transport, place=None,
                 keep: Keeper | None = None):
        self.graph, self.transport, self.place, self.keep = graph, transport, place, keep
        self.call = None if transport.packs else uuid.uuid4().hex

    def key(self, kind: str, label: str, *content) -> str:
        """A key for a task that ``content`` identifies (where values are packed; else the
        call does)."""
        if self.call:
            return key(kind, label, self.call)
        return key(kind, label, tokenize(*content, self.graph.settings,
                                         *([self.keep.token] if self.keep else [])))

    def stage(self, task_key: str, needs: dict | None, fn, inputs_at: int, *args,
              root: bool = False) -> TaskRef:
        """A stage's forward task, ``fn(*args)`` (``args`` from ``inputs_at`` on: the values it
        takes in), as :meth:`TaskGraph.task` makes it; where the call keeps its stages
        (``keep``), read from there or computed and kept (:func:`kept`), under the stage's
        label and what ``fn`` computes."""
        if self.keep is None:
            return self.graph.task(task_key, needs, fn, *args, root=root)
        label = str(task_key).partition(":")[2].rpartition("-")[0]
        entry = f"{kind_of(task_key)}:{label}:{fn.__name__}"
        return self.graph.task(task_key, needs, kept, self.keep, entry, inputs_at, fn, *args,
                               root=root)

    def value(self, kind: str, name: str, what: str, value):
        """An input value (or a tangent) as tasks take it: an :class:`Inline` or a reference.
        ``what`` names it in an error. A ``TaskRef`` is a value already on the cluster."""
        if isinstance(value, TaskRef):
            return value
        if not self.transport.packs:
            return Inline(value, None)
        packed = self.transport.pack(what, value)
        return self._carried(kind, name, packed, Task(None, unpack, packed), unpack, packed)

    def packed(self, kind: str, name: str, what: str, value):
        """An input value (or a cotangent) packed, as the argument of a task that unpacks it
        itself (:func:`~daskdag.transport.packing.unpack`): inline when small, else kept as
        by :meth:`value`."""
        packed = self.transport.pack(what, value)
        if sizeof(packed) <= INLINE_BYTES:
            return packed
        return self.kept(kind, name, tokenize(packed), unpack, packed)

    def node(self, name: str, node):
        """A node (its function packed by :func:`~daskdag.model.plan.ship` where values are
        packed) as the forward task of its stage takes it."""
        if not self.transport.packs:
            return Inline(node, None)
        return self._carried("node", name, node, node, identity, node, node.needs)

    def _carried(self, kind: str, name: str, content, inline, fn, payload, needs=None):
        """``fn(payload)`` inline (as ``inline``) when small, else a task of its own, keyed by the
        token of ``content``."""
        token = tokenize(content)
        if sizeof(payload) <= INLINE_BYTES:
            return Inline(inline, token)
        return self.kept(kind, name, token, fn, payload, needs)

    def kept(self, kind: str, name: str, token: str, fn, payload, needs=None):
        """``fn(payload)`` as a task of its own, keyed by ``token``: kept on the cluster by
        ``place`` when given (sent by the first call that uses it), else a task of the graph."""
        k = key(kind, name, token)
        if self.place is not None:
            return self.place(k, fn, payload, needs)
        return self.graph.task(k, dict(needs or {}), fn, payload, computes=False)


def _contained(arg):
    """``arg`` as a task takes it: a tuple or list that holds a nested task (a cotangent's seed
    made from a template's slot, say) as a ``List`` node, which Dask evaluates as the task runs
    (it looks into a task's own arguments, not into the containers among them); else as it
    is."""
    if type(arg) in (tuple, list):
        items = [_contained(a) for a in arg]
        if any(isinstance(a, GraphNode) for a in items):
            return List(*items)
    return arg


def token_of(task_key: str) -> str:
    """The token of a daskdag key (:func:`key`): what follows its last ``-``."""
    return task_key.rpartition("-")[2]


def is_root(stage, spec) -> bool:
    """A stage that takes only the call's inputs (no other stage's values) and needs no
    resources: a root of the graph, which any worker can run as soon as the call starts."""
    return not stage.needs and not any(d in spec.nodes for d in stage.deps)


def runs(task) -> Any:
    """The function a task runs (a Dask ``Task``, or a ``OneTask``'s ``fn``), inside
    :func:`~daskdag.transport.scope.within` where it is wrapped; None for what is not a task."""
    fn = getattr(task, "func", None) or getattr(task, "fn", None)
    return task.args[1] if fn is within else fn


class TaskGraph:
    """Tasks in the order they are made, each after its dependencies, as layers of consecutive
    tasks that need the same resources: a layer's annotation places its tasks on distributed's
    workers. So the layers form a chain, each depending on the one before. ``settings``: the
    JAX settings its tasks compute under (default: the calling thread's)."""

    def __init__(self, settings: JaxSettings | None = None):
        self.settings = JaxSettings.current() if settings is None else settings
        self.layers: list[tuple[dict | None, dict]] = []  # (resources, {key: task})
        self.layer_of: dict = {}  # key -> index of its layer

    def task(self, key: str, needs: dict | None, fn, *args, root: bool = False,
             computes: bool = True) -> TaskRef:
        """``fn(*args)``, where any :class:`TaskRef` among ``args`` is replaced by its value, and
        an :class:`Inline` by what it carries; under the graph's ``settings``
        (:func:`~daskdag.transport.scope.within`) unless ``computes`` is false (a task that
        only unpacks what travelled, kept on a cluster by its content for any call). ``root``:
        a task that computes from the call's inputs alone (:func:`is_root`)."""
        args = tuple(_contained(a.arg if isinstance(a, Inline) else a) for a in args)
        if computes:
            fn, args = within, (self.settings, fn, *args)
        # Marked as Dask marks the tasks that read an array's chunks: distributed queues them
        # and hands each to the next worker with a free thread, whatever the estimates of their
        # durations (a first call's compilations throw those off).
        return self._add(key, needs, Task(key, fn, *args, _data_producer=root))

    def nested(self, fn, *args) -> Task:
        """``fn(*args)`` as a task run inside the task that takes it (:class:`Inline` s
        unwrapped), under the graph's ``settings`` as :meth:`task` runs it."""
        return Task(None, within, self.settings, fn,
                    *(a.arg if isinstance(a, Inline) else a for a in args))

    def _add(self, key, needs, task) -> TaskRef:
        needs = needs or None  # no resources, however spelled
        if not self.layers or self.layers[-1][0] != needs:
            self.layers.append((needs, {}))
        self.layers[-1][1][key] = task
        self.layer_of[key] = len(self.layers) - 1
        return TaskRef(key)

    def delayed(self, results: dict, token: str | None = None, base: HighLevelGraph | None = None
                ) -> dict:
        """``results`` with every reference to a task of this graph made a ``Delayed``. The
        layers are named by ``token``, or else by a hash of every key; ``base``: another call's
        graph that these tasks take values from."""
        ambient = dask.get_annotations()  # a dask.annotate around the call still applies
        if token is None:
            digest = hashlib.sha1()
            for _, layer in self.layers:
                digest.update("\0".join(map(str, layer)).encode())
            token = digest.hexdigest()
        names = [f"daskdag-{k}-{token}" for k in range(len(self.layers))]
        layers: dict[str, Layer]
        layers = {name: MaterializedLayer(tasks, annotations={**ambient, "resources": needs}
                                          if needs else ambient or None)
                  for name, (needs, tasks) in zip(names, self.layers)}
        below = set(base.layers) if base is not None else set()
        dependencies = {name: set(names[k - 1:k]) if k else below for k, name in enumerate(names)}
        if base is not None:
            layers, dependencies = {**base.layers, **layers}, {**base.dependencies, **dependencies}
        graph = HighLevelGraph(layers, dependencies)

        def wrap(ref):
            return Delayed(ref.key, graph, layer=names[self.layer_of[ref.key]])

        return {o: (wrap(v), {i: wrap(g) for i, g in grads.items()})
                for o, (v, grads) in results.items()}
