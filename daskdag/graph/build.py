"""Wire a :class:`~daskdag.model.plan.Plan` into one Dask graph of forward and backward tasks.

In:  a plan, the input values, the user's cotangents.
Out: ``{output: (value, {input: grad})}`` of ``dask.delayed.Delayed`` objects sharing one graph.

Tasks are per stage (:mod:`daskdag.graph.stages`: nodes run as one task). Keys are readable, and their
prefix (:func:`key`) names the stage, so that Dask learns how long each stage takes (it learns per
prefix, ``dask.utils.key_split``): ``fwd:B+C-<token>`` runs the stage of nodes B and C (plus
``val:C-<token>`` taking C's value apart from the stage's pullback, so later stages never fetch
residuals), ``bwd:B+C[D+E]-<token>`` its backward pass for outputs D and E (an output's own
stage starts from its seed cotangent; for a stage where every cotangent starts, a closed one,
the forward task runs the backward pass too and ``bwd:`` just takes its cotangents),
``grad:D[x]-<token>`` input x's gradient for D (for a Jacobian, its rows), or a node's, for a
node named in ``wrt``. Outputs share forward keys, so every node runs once per call.

What the graph takes from outside, its inputs and nodes, comes in through a :class:`Carry`: as
they are for an eager call in this process (one token for all its keys: nothing is pickled or
hashed), or packed under content tokens for a cluster or a lazy call, so that repeated and
concurrent calls on one cluster share their keys. Each key is a function of its whole task: the
same key never names two tasks that differ (distributed's "different `run_spec`").

The tasks go straight into one :class:`~dask.highlevelgraph.HighLevelGraph` (``dask.task_spec``
tasks), never through ``dask.delayed`` calls: each of those merges the graphs of its arguments,
so building that way is quadratic in the number of nodes.
"""

from __future__ import annotations

import hashlib
import uuid

import dask
from dask.base import tokenize
from dask.delayed import Delayed
from dask.highlevelgraph import HighLevelGraph, Layer, MaterializedLayer
from dask.sizeof import sizeof
from dask.task_spec import Task, TaskRef

from daskdag.graph import tasks
from daskdag.model.plan import Plan
from daskdag.graph.run import itself
from daskdag.graph.stages import abbreviate, make_stages
from daskdag.rules.seeds import basis_size
from daskdag.transport.packing import pack_for, unpack
from daskdag import config

# A packed input or node of at most this many bytes travels inside each task that takes it, as
# Dask's own graphs carry small arguments: a task whose inputs are all small then depends on no
# other task, and the scheduler spreads such tasks over the workers (it places a task with
# dependencies beside them). A larger one is a task of its own, sent once.
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


class Carry:
    """How one call's graph takes in what it does not compute, its inputs and nodes, and the
    tokens of its keys.

    ``travel=False``: an eager call in this process. Values go in as they are, and every key
    carries one token of the call (Dask's local schedulers keep nothing between calls, so keys
    need only be unique within one): nothing is pickled or hashed for it.

    ``travel=True``: a call for a cluster, or a lazy one (which may go anywhere). Values are
    packed (:func:`~daskdag.transport.packing.pack_for`; ``remote``: pickling must work) and keys are
    content tokens. A value of at most :data:`INLINE_BYTES` goes inline, a nested task
    unpacking it, in each task that takes it; a larger one is a task of its own: kept on the
    cluster by ``place(key, fn, payload, needs) -> Future`` (:mod:`daskdag.running.resident`) when
    given, else a task of the graph (``graph``, a :class:`TaskGraph`)."""

    def __init__(self, graph: "TaskGraph", travel: bool, remote: bool = False, place=None):
        self.graph, self.travel, self.remote, self.place = graph, travel, remote, place
        self.call = None if travel else uuid.uuid4().hex

    def key(self, kind: str, label: str, *content) -> str:
        """A key for a task that ``content`` identifies (with ``travel``; else the call does)."""
        return key(kind, label, self.call or tokenize(*content))

    def value(self, kind: str, name: str, what: str, value):
        """An input value (or a tangent) as tasks take it: an :class:`Inline` or a reference.
        ``what`` names it in an error. A ``TaskRef`` is a value already on the cluster."""
        if isinstance(value, TaskRef):
            return value
        if not self.travel:
            return Inline(value, None)
        packed = pack_for(what, value, self.remote)
        return self._carried(kind, name, packed, Task(None, unpack, packed), unpack, packed)

    def node(self, name: str, node):
        """A node (its function packed by :func:`~daskdag.model.plan.ship` when travelling) as
        the forward task of its stage takes it."""
        if not self.travel:
            return Inline(node, None)
        return self._carried("node", name, node, node, itself, node, node.needs)

    def _carried(self, kind: str, name: str, content, inline, fn, payload, needs=None):
        """``fn(payload)`` inline (as ``inline``) when small, else a task of its own, keyed by the
        token of ``content``."""
        token = tokenize(content)
        if sizeof(payload) <= INLINE_BYTES:
            return Inline(inline, token)
        k = key(kind, name, token)
        if self.place is not None:
            return self.place(k, fn, payload, needs)
        return self.graph.task(k, dict(needs or {}), fn, payload)


def build(plan: Plan, values: dict, cotangents: dict, batched: bool = False, remote: bool = False,
          place=None, stop=None, rows=None, travel: bool = True, stages=None
          ) -> dict[str, tuple[Delayed, dict[str, Delayed]]]:
    """The graph of one call; ``batched``: outputs carry a leading item axis (a sweep's chunk);
    ``remote``: it goes to a cluster, so everything in it must pickle (:mod:`daskdag.transport.packing`);
    ``travel`` and ``place``: see :class:`Carry`.

    The plan's node functions are packed already where they travel
    (:func:`daskdag.model.plan.ship`). ``stop``: for a local call, a
    ``daskdag.cancel.Stop`` whose setting (by :func:`daskdag.running.compute.compute`, on Ctrl-C) stops
    running stages at their next node. ``rows``: a :class:`daskdag.graph.tasks.Rows` for a Jacobian
    (each output starts from the rows of the identity over its elements, and its "gradients" are
    the Jacobian's rows, see :mod:`daskdag.graph.tasks`), else ``None``. ``stages``: the plan's
    stages (:func:`~daskdag.graph.stages.make_stages`), when a prepared call made them already.
    """
    wiring = _Wiring(plan, Carry(TaskGraph(), travel, remote, place), stop, rows, stages)
    wiring.seeds = {o: tasks.Seed(o, cotangents.get(o), batched) if rows is None else
                    tasks.Basis(o, rows.colours_of(o))
                    for o in plan.outputs}
    wiring.val = {i: wiring.carry.value("input", i, f"input {i!r}", v) for i, v in values.items()}
    wiring.close_stages()
    if not batched:
        wiring.densify_stages(values)
    wiring.forward()
    wiring.backward()
    return wiring.carry.graph.delayed(wiring.gradients(), wiring.carry.call)


class _Wiring:
    """The tasks of one call, made stage by stage: :meth:`forward` in topological order,
    :meth:`backward` in reverse (autograd's backward pass, where a node's ``outgrads`` are the
    shares its consumer stages' backward tasks pull back), :meth:`gradients` last. ``val``:
    name -> the task (or inline value) of each input and exposed node; ``bwd``: stage -> its
    backward task; ``through``: stage -> the outputs whose gradients pass through it."""

    def __init__(self, plan: Plan, carry: Carry, stop, rows, stages=None):
        self.plan, self.carry, self.g, self.stop, self.rows = plan, carry, carry.graph, stop, rows
        self.stages = make_stages(plan) if stages is None else stages
        self.stage_of = {n: s for s in self.stages for n in s.nodes}
        self.paths = {o: set(plan.backward[o]) for o in plan.outputs}
        self.through = {s: tuple(o for o in plan.outputs if self.paths[o] & set(s.outputs))
                        for s in self.stages}
        self.seeds: dict = {}
        self.val: dict = {}
        self.closed: dict = {}
        self.forward_task: dict = {}
        self.bwd: dict = {}
        self.dense: set = set()  # stages whose backward pass travels as their Jacobian
        self.sources: dict = {}  # ident -> a backward task, or its nested task (dense stages)

    def close_stages(self) -> None:
        """A stage whose gradients all start at its own outputs (none comes from a later stage)
        is closed: its forward task runs the backward pass too (tasks.forward_backward), a
        fused one as one program; its residuals never leave it (``daskdag.close-stages``)."""
        if not config.get("close-stages"):
            return
        plan, through = self.plan, self.through
        for s in self.stages:
            if through[s] and all(n == o or n not in self.paths[o] or not _feeding(
                    plan.consumers(n, o), self.stage_of, s) for o in through[s] for n in s.outputs):
                self.closed[s] = tuple(tuple(self.seeds[o] if n == o else None for n in s.outputs)
                                       for o in through[s])

    def densify_stages(self, values: dict) -> None:
        """On a cluster, the open stages whose backward pass travels as their dense Jacobian
        (:mod:`daskdag.graph.dense`) and runs inside the tasks that take their cotangents: those
        (no ``remat`` node among them) whose differentiated deps are the call's inputs, at most
        ``daskdag.dense-inputs`` elements in all. A closed stage all of whose deps are inputs
        or nodes of such stages hands its cotangents over inside those tasks too."""
        most = config.get("dense-inputs")
        if not (self.carry.remote and most):
            return
        nodes = self.plan.spec.nodes
        for s in self.stages:
            if not s.has_pullback or s in self.closed or not self.through[s] or any(
                    nodes[n].remat for n in s.nodes):
                continue
            active = [d for d, on in zip(s.deps, s.dep_active()) if on]
            if all(d in values and not isinstance(values[d], TaskRef) for d in active) and sum(
                    basis_size(values[d]) for d in active) <= most:
                self.dense.add(s)

    def forward(self) -> None:
        """Each stage once (its nodes under jax.vjp where they depend on a differentiated
        input); ``val`` tasks take its values apart from its pullback, so that later stages
        never fetch residuals."""
        spec, carry, val, rows = self.plan.spec, self.carry, self.val, self.rows
        for s in self.stages:
            sent = [carry.node(n, spec.nodes[n]) for n in s.nodes]
            closed = self.closed.get(s)
            # (A Jacobian's rows change only what a closed stage's task computes: the others
            # are the same forward tasks as for gradients, shared when both run together.)
            dense = s in self.dense
            k = carry.key("fwd", s.name, s, [ident(n) for n in sent], [ident(val[d]) for d in s.deps],
                          closed, rows if closed else None, *(["dense"] if dense else []))
            run = ((tasks.forward_dense if dense else tasks.forward,) if closed is None else
                   (tasks.forward_backward, closed, rows))
            fwd = self.g.task(k, dict(s.needs), run[0], s, self.stop, *run[1:], *sent,
                              *(val[d] for d in s.deps), root=is_root(s, spec))
            if closed is not None:
                label = self._label(s)
                if self.dense and all(self.stage_of[d] in self.dense for d in s.deps
                                      if d in self.stage_of):
                    self._source(s, Inline(nested(tasks.cotangents_of, fwd), f"{label}-{token_of(k)}"))
                else:
                    self._source(s, self.g.task(key("bwd", label, token_of(k)), dict(s.needs),
                                                tasks.cotangents_of, fwd))
            elif s.has_pullback:
                self.forward_task[s] = fwd
            self._values(s, fwd, token_of(k))

    def _values(self, s, fwd, token: str) -> None:
        for e, n in enumerate(s.outputs):
            if s.bare:
                self.val[n] = fwd
            elif n in self.plan.outputs or (self.carry.travel and s not in self.dense):
                # (consumers never fetch residuals)
                self.val[n] = self.g.task(key("val", n, token), dict(s.needs), tasks.pick, fwd,
                                          s.has_pullback, e)
            else:  # nothing travels, or what does is small: a consumer picks the value itself
                self.val[n] = Inline(nested(tasks.pick, fwd, s.has_pullback, e), f"{token}.{e}")

    def backward(self) -> None:
        """One task per stage, for every output whose gradient passes through it (their
        cotangents pulled back together, tasks.backward): each exposed node's cotangent is its
        output's seed, or the sum of its consumer stages' shares (:class:`tasks.Shares`)."""
        for s in reversed(self.stages):
            if not self.through[s] or s in self.closed:
                continue
            sources: dict
            flows, sources = [], {}
            for o in self.through[s]:
                flows.append(tuple(self._flow(s, n, o, sources) for n in s.outputs))
            k = self.carry.key("bwd", self._label(s), self.forward_task[s].key, flows, list(sources),
                               self.rows)
            args = (s, self.stop, tuple(flows), self.rows, self.forward_task[s],
                    *(self.val[d] for d in s.deps), *(self.sources[src] for src in sources))
            if s in self.dense:  # (run inside each task that takes its cotangents)
                self._source(s, Inline(nested(tasks.backward, *args), token_of(k)))
            else:
                self._source(s, self.g.task(k, dict(s.needs), tasks.backward, *args))

    def _source(self, s, bwd) -> None:
        """``bwd``, stage ``s``'s backward task (or the nested task that stands for it), as the
        source its consumers take their shares from."""
        self.bwd[s] = bwd
        self.sources[ident(bwd)] = bwd

    def _flow(self, s, n: str, o: str, sources: dict):
        """Where output ``o``'s cotangent at node ``n`` of stage ``s`` comes from, or None."""
        if n == o:
            return self.seeds[o]
        if n not in self.paths[o]:
            return None
        picks = self._shares(n, o, sources, within=s)
        return tasks.Shares(picks) if picks else None

    def gradients(self) -> dict:
        """``{output: (value, {name: grad})}``: each wrt name's gradient, the sum of the shares
        its consumer stages pulled back (for the output itself, its seed too)."""
        results = {}
        for o in self.plan.outputs:
            grads = {}
            output = None if self.rows is None else self.val[o]  # (a Jacobian's zeros need rows)
            for i in self.plan.wrt:  # inputs, and nodes (the output itself starts from its seed)
                sources: dict = {}
                picks = self._shares(i, o, sources)
                own = self.seeds[o] if i == o else None
                k = self.carry.key("grad", f"{o}[{i}]", ident(self.val[i]), list(sources), picks,
                                   own, self.rows)
                grads[i] = self.g.task(k, None, tasks.gradient, tuple((k, p) for _, k, p in picks),
                                       self.val[i], output, self.seeds[o] if self.rows else None,
                                       own, *(self.sources[src] for src in sources))
            results[o] = (self.val[o], grads)
        return results

    def _shares(self, name: str, output: str, sources: dict, within=None) -> tuple:
        """Where ``name``'s cotangent for ``output`` comes from: ``(source, output index,
        position)`` for each stage that consumes it, other than its own stage ``within``.
        ``sources`` maps the idents of those stages' backward tasks, in the order they are the
        task's arguments, to ``source``, their index; new ones are added."""
        picks = []
        for s in _feeding(self.plan.consumers(name, output), self.stage_of, within):
            source = sources.setdefault(ident(self.bwd[s]), len(sources))
            picks.append((source, self.through[s].index(output), s.deps.index(name)))
        return tuple(picks)

    def _label(self, s) -> str:
        return f"{s.name}[{abbreviate(self.through[s])}]"


def nested(fn, *args) -> Task:
    """``fn(*args)`` as a task run inside the task that takes it (:class:`Inline` s unwrapped)."""
    return Task(None, fn, *(a.arg if isinstance(a, Inline) else a for a in args))


def token_of(task_key: str) -> str:
    """The token of a daskdag key (:func:`key`): what follows its last ``-``."""
    return task_key.rpartition("-")[2]


def is_root(stage, spec) -> bool:
    """A stage that takes only the call's inputs (no other stage's values) and needs no
    resources: a root of the graph, which any worker can run as soon as the call starts."""
    return not stage.needs and not any(d in spec.nodes for d in stage.deps)


def _feeding(uses, stage_of, within=None) -> list:
    """The stages of the consuming nodes in ``uses``, each once, other than ``within``: those
    that pull a share of the cotangent back."""
    return [s for s in dict.fromkeys(stage_of[c] for c, _ in uses) if s is not within]


class TaskGraph:
    """Tasks in the order they are made, each after its dependencies, as layers of consecutive
    tasks that need the same resources: a layer's annotation places its tasks on distributed's
    workers. So the layers form a chain, each depending on the one before."""

    def __init__(self):
        self.layers: list[tuple[dict | None, dict]] = []  # (resources, {key: task})
        self.layer_of: dict = {}  # key -> index of its layer

    def task(self, key: str, needs: dict | None, fn, *args, root: bool = False) -> TaskRef:
        """``fn(*args)``, where any :class:`TaskRef` among ``args`` is replaced by its value, and
        an :class:`Inline` by what it carries. ``root``: a task that computes from the call's
        inputs alone (:func:`is_root`)."""
        args = tuple(a.arg if isinstance(a, Inline) else a for a in args)
        # Marked as Dask marks the tasks that read its arrays' chunks (dask.array.from_array):
        # distributed then queues such tasks and hands each to the next worker with a free
        # thread, whatever the estimates of their durations, so independent branches spread
        # evenly from the first call on (it places other tasks by estimates, learned per
        # prefix, which a first call's compilations throw off).
        return self._add(key, needs, Task(key, fn, *args, _data_producer=root))

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
