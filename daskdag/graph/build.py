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
tasks), not through ``dask.delayed`` calls: each of those merges the graphs of its arguments,
which made building quadratic in the number of nodes (2 s for a 1,000-node chain).
"""

from __future__ import annotations

import hashlib
import uuid

import dask
from dask.base import tokenize
from dask.delayed import Delayed
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.sizeof import sizeof
from dask.task_spec import Task, TaskRef

from daskdag.graph import tasks
from daskdag.model.plan import Plan
from daskdag.graph.run import itself
from daskdag.graph.stages import abbreviate, make_stages
from daskdag.transport.packing import pack_for, unpack
from daskdag import config

# A packed input or node of at most this many bytes travels inside each task that takes it, as
# Dask's own graphs carry small arguments: a task whose inputs are all small then depends on no
# other task, and the scheduler spreads such tasks over the workers (it places a task with
# dependencies beside them). A larger one is a task of its own, sent once.
INLINE_BYTES = 64 * 1024


def key(kind: str, label: str, token: str) -> str:
    """A task key: ``fwd:B+C-<token>``. Dask's prefix of it (``dask.utils.key_split``) is
    ``fwd:B+C``, everything before the token, whatever the node names hold (a prefix stops at
    the first later ``-``-separated word that is not all letters: ``fwd-n9`` would be ``fwd``)."""
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
    given, else a task of the graph (``graph``, a :class:`_Graph`)."""

    def __init__(self, graph: "_Graph", travel: bool, remote: bool = False, place=None):
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
        """A node (its function packed by :func:`~daskdag.transport.packing.ship` when travelling) as
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
          place=None, stop=None, rows=None, travel: bool = True) -> dict[str, tuple[Delayed, dict[str, Delayed]]]:
    """The graph of one call; ``batched``: outputs carry a leading item axis (a sweep's chunk);
    ``remote``: it goes to a cluster, so everything in it must pickle (see :mod:`.shipping`);
    ``travel`` and ``place``: see :class:`Carry`.

    The plan's node functions are packed already where they travel
    (:func:`daskdag.transport.packing.ship`). ``stop``: for a local call, a
    ``daskdag.cancel.Stop`` whose setting (by :func:`daskdag.running.compute.compute`, on Ctrl-C) stops
    running stages at their next node. ``rows``: a :class:`daskdag.graph.tasks.Rows` for a Jacobian
    (each output starts from the rows of the identity over its elements, and its "gradients" are
    the Jacobian's rows, see :mod:`daskdag.graph.tasks`), else ``None``.
    """
    spec, g = plan.spec, _Graph()
    carry = Carry(g, travel, remote, place)
    val = {i: carry.value("input", i, f"input {i!r}", v) for i, v in values.items()}
    stages = make_stages(plan)
    stage_of = {n: s for s in stages for n in s.nodes}

    # Which outputs' gradients pass through each stage. A stage where they all start (its
    # cotangents are its own outputs' seeds, none comes from a later stage) is closed: its
    # forward task runs the backward pass too (tasks.forward_backward), a fused one as one
    # program; its residuals never leave it. (dask.config daskdag.close-stages: False keeps
    # them apart.)
    close = config.get("close-stages")
    paths = {o: set(plan.backward[o]) for o in plan.outputs}
    through = {s: tuple(o for o in plan.outputs if paths[o] & set(s.outputs)) for s in stages}
    seeds = {o: tasks.Seed(o, cotangents.get(o), batched) if rows is None else tasks.Basis(o)
             for o in plan.outputs}
    closed = {s: tuple(tuple(seeds[o] if n == o else None for n in s.outputs) for o in through[s])
              for s in stages if close and through[s] and all(
                  n == o or n not in paths[o] or not _feeding(plan.consumers(n, o), stage_of, s)
                  for o in through[s] for n in s.outputs)}

    # Forward: each stage once (its nodes under jax.vjp where they depend on a differentiated
    # input); val tasks take its values apart from its pullback, so later stages never fetch
    # residuals.
    linearized, bwd = {}, {}  # stage -> its forward task, (values, pullback); its backward task
    for s in stages:
        sent = [carry.node(n, spec.nodes[n]) for n in s.nodes]
        # (A Jacobian's rows change only what a closed stage's task computes: the others are the
        # same forward tasks as for gradients, shared when both are computed together.)
        tok = carry.key("fwd", s.name, s, [ident(n) for n in sent], [ident(val[d]) for d in s.deps],
                        closed.get(s), rows if s in closed else None)
        token = tok.rpartition("-")[2]
        run = (tasks.forward,) if s not in closed else (tasks.forward_backward, closed[s], rows)
        fwd = g.task(tok, dict(s.needs), run[0], s, stop, *run[1:], *sent, *(val[d] for d in s.deps),
                     root=is_root(s, spec))
        if s in closed:
            bwd[s] = g.task(key("bwd", f"{s.name}[{abbreviate(through[s])}]", token),
                            dict(s.needs), tasks.cotangents_of, fwd)
        elif s.linearized:
            linearized[s] = fwd
        for k, n in enumerate(s.outputs):
            if s.bare:
                val[n] = fwd
            elif travel or n in plan.outputs:  # (on a cluster, consumers never fetch residuals)
                val[n] = g.task(key("val", n, token), dict(s.needs), tasks.pick, fwd, s.linearized, k)
            else:  # here, nothing travels: a consumer picks the value out itself, a task less
                val[n] = Inline(Task(None, tasks.pick, fwd, s.linearized, k), None)

    # Backward: one task per stage, for every output whose gradient passes through it (their
    # cotangents pulled back together, see tasks.backward). The cotangent of an exposed node is
    # the sum of its consumer stages' shares, or the output's seed.
    for s in reversed(stages):
        if not through[s] or s in closed:
            continue
        flows, sources = [], {}
        for o in through[s]:
            per_output = []
            for n in s.outputs:
                if n == o:
                    per_output.append(seeds[o])
                elif n in paths[o]:
                    picks = _shares(n, plan.consumers(n, o), o, stage_of, through, bwd, sources,
                                    within=s)
                    per_output.append(tasks.Shares(picks) if picks else None)
                else:
                    per_output.append(None)
            flows.append(tuple(per_output))
        k = carry.key("bwd", f"{s.name}[{abbreviate(through[s])}]", linearized[s].key, flows,
                      list(sources), rows)
        bwd[s] = g.task(k, dict(s.needs), tasks.backward, s, stop, tuple(flows), rows,
                        linearized[s], *(val[d] for d in s.deps), *map(TaskRef, sources))

    results = {}
    for o in plan.outputs:
        grads = {}
        output = None if rows is None else val[o]  # (a Jacobian's zeros need its rows)
        for i in plan.wrt:  # inputs, and nodes (the output itself starts from its seed)
            sources = {}
            picks = _shares(i, plan.consumers(i, o), o, stage_of, through, bwd, sources)
            own = seeds[o] if i == o else None
            k = carry.key("grad", f"{o}[{i}]", ident(val[i]), list(sources), picks, own, rows)
            grads[i] = g.task(k, None, tasks.gradient, tuple((k, p) for _, k, p in picks), val[i],
                              output, own, *map(TaskRef, sources))
        results[o] = (val[o], grads)
    return g.delayed(results, carry.call)


def is_root(stage, spec) -> bool:
    """A stage that takes only the call's inputs (no other stage's values) and needs no
    resources: a root of the graph, which any worker can run as soon as the call starts."""
    return not stage.needs and not any(d in spec.nodes for d in stage.deps)


def _shares(name, uses, output, stage_of, through, bwd, sources: dict, within=None) -> tuple:
    """Where ``name``'s cotangent for ``output`` comes from: ``(source, output index,
    position)`` for each stage that consumes it (``uses``: its consuming nodes), other than its
    own stage ``within``. ``sources`` maps the keys of those stages' backward tasks, in the
    order they are the task's arguments, to ``source``, their index; new ones are added."""
    picks = []
    for s in _feeding(uses, stage_of, within):
        source = sources.setdefault(bwd[s].key, len(sources))
        picks.append((source, through[s].index(output), s.deps.index(name)))
    return tuple(picks)


def _feeding(uses, stage_of, within=None) -> list:
    """The stages of the consuming nodes in ``uses``, each once, other than ``within``: those
    that pull a share of the cotangent back."""
    return [s for s in dict.fromkeys(stage_of[c] for c, _ in uses) if s is not within]


class _Graph:
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
