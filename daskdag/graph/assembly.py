"""What every builder assembles a call's Dask graph from: task keys, :class:`Intake` (how a graph
takes in its values) and :class:`TaskGraph`. A key (``fwd:B+C-<token>``) is a function of its
whole task, its prefix names the stage (so Dask learns each stage's duration), and it is read
back only through :func:`kind_of` and :func:`token_of`."""

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

from daskdag.graph.tasks import identity
from daskdag.transport.packing import unpack
from daskdag.transport.scope import JaxSettings, within
from daskdag.transport.transports import Transport

# A packed value of at most this many bytes travels inside each task that takes it (so tasks
# whose inputs are all small are roots the scheduler spreads); a larger one is a task of its own.
INLINE_BYTES = 64 * 1024


def key(kind: str, label: str, token: str) -> str:
    """A task key: ``fwd:B+C-<token>``. Dask's prefix of it is ``fwd:B+C``, unless a node name
    holds a ``-`` before a word that is not all letters (node ``x-1``: ``fwd:x``)."""
    return f"{kind}:{label}-{token}"


def kind_of(task_key) -> str:
    """The kind of a daskdag key (``fwd``, ``bwd``, ``val``, ``grad``, ...), else ``""``."""
    head = str(task_key).partition("-")[0]
    return head.partition(":")[0] if ":" in head else ""


class Inline:
    """A value (or nested task) ``arg`` that tasks take inline; ``token`` names it in keys."""

    __slots__ = ("arg", "token")

    def __init__(self, arg, token: str | None):
        self.arg, self.token = arg, token


def ident(ref) -> str | None:
    """What identifies a task's argument in its key: a task's key, or an inline value's token."""
    return ref.token if isinstance(ref, Inline) else ref.key


class Keeper(Protocol):
    """Where a durable call keeps its stages' results, picklable; ``token``: held by its keys."""

    token: str

    def load(self, entry: str, inputs: tuple) -> tuple[bool, Any, str]:
        """``(found, result, digest of inputs)`` kept under ``entry`` for these ``inputs``."""
        ...

    def save(self, entry: str, digest: str, result: Any) -> Any:
        """``result`` kept under ``entry``; returns it as :meth:`load` reads it back."""
        ...


def kept(keeper: Keeper, entry: str, inputs_at: int, fn, *args):
    """``fn(*args)`` as ``keeper`` reads it back (so a resumed call's is the same to the bit)."""
    found, result, digest = keeper.load(entry, args[inputs_at:])
    if found:
        return result
    return keeper.save(entry, digest, fn(*args))


class Intake:
    """How one call's graph takes in its inputs and nodes, and its keys' tokens, as its
    ``transport`` says. A packed value larger than :data:`INLINE_BYTES` is a task of its own:
    kept on the cluster by ``place(key, fn, payload, needs) -> Future``, or a task of ``graph``."""

    def __init__(self, graph: "TaskGraph", transport: Transport, place=None,
                 keep: Keeper | None = None):
        self.graph, self.transport, self.place, self.keep = graph, transport, place, keep
        self.call = None if transport.packs else uuid.uuid4().hex

    def key(self, kind: str, label: str, *content) -> str:
        """A key for a task that ``content`` identifies (else the call, where nothing packs)."""
        if self.call:
            return key(kind, label, self.call)
        return key(kind, label, tokenize(*content, self.graph.settings,
                                         *([self.keep.token] if self.keep else [])))

    def stage(self, task_key: str, needs: dict | None, fn, inputs_at: int, *args,
              root: bool = False) -> TaskRef:
        """A stage's forward task ``fn(*args)``, through :func:`kept` for a durable call."""
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
        """A value packed, for a task that unpacks it itself (kept as by :meth:`value`)."""
        packed = self.transport.pack(what, value)
        if sizeof(packed) <= INLINE_BYTES:
            return packed
        return self.kept(kind, name, tokenize(packed), unpack, packed)

    def node(self, name: str, node):
        """A node (its function packed where values are) as its stage's forward task takes it."""
        if not self.transport.packs:
            return Inline(node, None)
        return self._carried("node", name, node, node, identity, node, node.needs)

    def _carried(self, kind: str, name: str, content, inline, fn, payload, needs=None):
        """``inline`` when ``payload`` is small, else ``fn(payload)`` as a task of its own."""
        token = tokenize(content)
        if sizeof(payload) <= INLINE_BYTES:
            return Inline(inline, token)
        return self.kept(kind, name, token, fn, payload, needs)

    def kept(self, kind: str, name: str, token: str, fn, payload, needs=None):
        """``fn(payload)`` as a task of its own: placed on the cluster, else in the graph."""
        k = key(kind, name, token)
        if self.place is not None:
            return self.place(k, fn, payload, needs)
        return self.graph.task(k, dict(needs or {}), fn, payload, computes=False)


def _contained(arg):
    """``arg``, where a tuple or list holds a nested task, as a ``List`` (Dask evaluates it)."""
    if type(arg) in (tuple, list):
        items = [_contained(a) for a in arg]
        if any(isinstance(a, GraphNode) for a in items):
            return List(*items)
    return arg


def token_of(task_key: str) -> str:
    """The token of a daskdag key (:func:`key`): what follows its last ``-``."""
    return task_key.rpartition("-")[2]


def is_root(stage, spec) -> bool:
    """A stage that takes only the call's inputs and needs no resources: a root of the graph."""
    return not stage.needs and not any(d in spec.nodes for d in stage.deps)


def runs(task) -> Any:
    """The function a task (or ``OneTask``) runs, unwrapped from ``within``; else None."""
    fn = getattr(task, "func", None) or getattr(task, "fn", None)
    return task.args[1] if fn is within else fn


class TaskGraph:
    """Tasks in order, as a chain of layers of tasks that need the same resources, computing
    under JAX ``settings`` (default: this thread's)."""

    def __init__(self, settings: JaxSettings | None = None):
        self.settings = JaxSettings.current() if settings is None else settings
        self.layers: list[tuple[dict | None, dict]] = []  # (resources, {key: task})
        self.layer_of: dict = {}  # key -> index of its layer

    def task(self, key: str, needs: dict | None, fn, *args, root: bool = False,
             computes: bool = True) -> TaskRef:
        """``fn(*args)`` under the graph's ``settings`` (unless it only unpacks: ``computes``
        false); ``root``: see :func:`is_root`."""
        args = tuple(_contained(a.arg if isinstance(a, Inline) else a) for a in args)
        if computes:
            fn, args = within, (self.settings, fn, *args)
        # Marked as Dask marks the tasks that read an array's chunks: distributed queues them
        # and hands each to the next free worker thread, whatever its duration estimates.
        return self._add(key, needs, Task(key, fn, *args, _data_producer=root))

    def nested(self, fn, *args) -> Task:
        """``fn(*args)`` as a task run inside the task that takes it, as :meth:`task` runs it."""
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
        """``results`` with every reference made a ``Delayed``, the layers named by ``token``
        (else a hash of the keys) and joined to ``base``, a graph these tasks take values from."""
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
