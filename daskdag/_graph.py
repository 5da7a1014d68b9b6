"""Wire a :class:`~daskdag._plan.Plan` into one Dask graph of forward and backward tasks.

In:  a plan, the input values, the user's cotangents.
Out: ``{output: (value, {input: grad})}`` of ``dask.delayed.Delayed`` objects sharing one graph.

Tasks are per stage (:mod:`daskdag._stages`: nodes run as one task). Keys are readable and
deterministic: ``fwd-B+C-<token>`` runs the stage of nodes B and C (plus ``val-C-<token>``
taking C's value apart from the stage's pullback, so later stages never fetch residuals),
``bwd-D+E-B+C-<token>`` its backward pass for outputs D and E (an output's own stage starts from
its seed cotangent; for a stage where every cotangent starts, a closed one, the forward task
runs the backward pass too and ``bwd-`` just takes its cotangents), ``grad-D-x-<token>`` input
x's gradient for D (for a Jacobian, its rows), or a node's, for a node named in ``wrt``. Outputs share forward keys, so every node runs
once per call; tokens hash functions and inputs, so repeated calls on one cluster share them
too.

The tasks go straight into one :class:`~dask.highlevelgraph.HighLevelGraph` (``dask.task_spec``
tasks), not through ``dask.delayed`` calls: each of those merges the graphs of its arguments,
which made building quadratic in the number of nodes (2 s for a 1,000-node chain).
"""

from __future__ import annotations

import dask
from dask.base import tokenize
from dask.delayed import Delayed
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.task_spec import Task, TaskRef

from . import _tasks as tasks
from ._plan import Plan
from ._stages import abbreviate, make_stages
from ._shipping import pack_for, unpack

CLOSE = "daskdag.close-stages"


def build(plan: Plan, values: dict, cotangents: dict, batched: bool = False, remote: bool = False,
          place=None, stop=None, rows=None) -> dict[str, tuple[Delayed, dict[str, Delayed]]]:
    """The graph of one call; ``batched``: outputs carry a leading item axis (a sweep's chunk);
    ``remote``: it goes to a cluster, so everything in it must pickle (see :mod:`.shipping`).

    The plan's node functions are packed already (:func:`daskdag._shipping.ship`); input values
    are packed here, and unpacked by a task of their own. ``place(key, fn, payload, needs)``,
    when given, keeps ``fn(payload)`` on the cluster under the content ``key`` (on a worker with
    the resources ``needs``) and returns its reference (:mod:`daskdag._resident`): inputs and
    nodes then travel once, not in each graph. ``stop``: for a local call, a
    ``daskdag._progress.Stop`` whose setting (by :func:`daskdag._compute.compute`, on Ctrl-C) stops
    running stages at their next node. ``rows``: a :class:`daskdag._tasks.Rows` for a Jacobian
    (each output starts from the rows of the identity, and its "gradients" are the Jacobian's
    rows, see :mod:`daskdag._tasks`), else ``None``.
    """
    spec, g = plan.spec, _Graph()
    val = {}
    for i, v in values.items():
        if isinstance(v, TaskRef):  # already on the cluster (a sweep's shared input)
            val[i] = v
            continue
        val[i] = value_task(f"input-{i}", f"input {i!r}", v, remote, place, g.task)
    stages = make_stages(plan)
    stage_of = {n: s for s in stages for n in s.nodes}

    # Which outputs' gradients pass through each stage. A stage where they all start (its
    # cotangents are its own outputs' seeds, none comes from a later stage) is closed: its
    # forward task runs the backward pass too (tasks.forward_backward), a fused one as one
    # program; its residuals never leave it. (dask.config daskdag.close-stages: False keeps
    # them apart.)
    close = dask.config.get(CLOSE, True)
    paths = {o: set(plan.backward[o]) for o in plan.outputs}
    through = {s: tuple(o for o in plan.outputs if paths[o] & set(s.outputs)) for s in stages}
    seeds = {o: ("seed", o, cotangents.get(o), batched) if rows is None else ("basis", o)
             for o in plan.outputs}
    closed = {s: tuple(tuple(seeds[o] if n == o else None for n in s.outputs) for o in through[s])
              for s in stages if close and through[s] and all(
                  n == o or n not in paths[o] or not _feeding(plan.consumers(n, o), stage_of, s)
                  for o in through[s] for n in s.outputs)}

    # Forward: each stage once (its nodes under jax.vjp where they depend on a differentiated
    # input); val- tasks take its values apart from its pullback, so later stages never fetch
    # residuals.
    linearized, bwd = {}, {}  # stage -> its forward task, (values, pullback); its backward task
    for s in stages:
        nodes = [spec.nodes[n] for n in s.nodes]
        sent = [node_ref(n, node, place) for n, node in zip(s.nodes, nodes)]
        # (A Jacobian's rows change only what a closed stage's task computes: the others are the
        # same forward tasks as for gradients, shared when both are computed together.)
        tok = tokenize(s, nodes, [val[d].key for d in s.deps], closed.get(s),
                       rows if s in closed else None)
        run = (tasks.forward,) if s not in closed else (tasks.forward_backward, closed[s], rows)
        fwd = g.task(f"fwd-{s.name}-{tok}", dict(s.needs), run[0], s, stop, *run[1:], *sent,
                     *(val[d] for d in s.deps))
        if s in closed:
            bwd[s] = g.task(f"bwd-{abbreviate(through[s])}-{s.name}-{tok}", dict(s.needs),
                            tasks.pulled, fwd)
        elif s.linearized:
            linearized[s] = fwd
        for k, n in enumerate(s.outputs):
            val[n] = fwd if s.bare else g.task(
                f"val-{n}-{tok}", dict(s.needs), tasks.pick, fwd, s.linearized, k)

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
                    per_output.append(_shares(n, plan.consumers(n, o), o, stage_of, through, bwd,
                                              sources, within=s) or None)
                else:
                    per_output.append(None)
            flows.append(tuple(per_output))
        tok = tokenize(linearized[s].key, flows, list(sources))
        bwd[s] = g.task(f"bwd-{abbreviate(through[s])}-{s.name}-{tok}", dict(s.needs),
                        tasks.backward, s, stop, tuple(flows), rows, linearized[s],
                        *(val[d] for d in s.deps), *map(TaskRef, sources))

    results = {}
    for o in plan.outputs:
        grads = {}
        output = None if rows is None else val[o]  # (a Jacobian's zeros need its rows)
        for i in plan.wrt:  # inputs, and nodes (the output itself starts from its seed)
            sources = {}
            picks = _shares(i, plan.consumers(i, o), o, stage_of, through, bwd, sources)
            own = seeds[o] if i == o else None
            tok = tokenize(val[i].key, list(sources), picks, own, rows)
            grads[i] = g.task(f"grad-{o}-{i}-{tok}", None, tasks.gradient,
                              tuple((k, p) for _, k, p in picks), val[i], output, own,
                              *map(TaskRef, sources))
        results[o] = (val[o], grads)
    return g.delayed(results)


def value_task(prefix: str, what: str, value, remote: bool, place, task):
    """A value the graph takes (an input, a tangent) as a task of its own, ``unpack`` of it
    packed (:func:`~daskdag._shipping.pack_for`, ``what`` naming it in an error), keyed
    ``{prefix}-<its content token>``: placed on the cluster (``place``, see :func:`build`) or,
    without, ``task(key, None, unpack, packed)`` (:meth:`_Graph.task`, or another graph's)."""
    packed = pack_for(what, value, remote)
    key = f"{prefix}-{tokenize(packed)}"
    return place(key, unpack, packed) if place else task(key, None, unpack, packed)


def node_ref(name: str, node, place):
    """What a task takes for ``node``: the node itself, or placed on the cluster under its
    content key (on a worker with its resources)."""
    return place(f"node-{name}-{tokenize(node)}", _itself, node, node.needs) if place else node


def _itself(x):
    return x


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

    def task(self, key: str, needs: dict | None, fn, *args) -> TaskRef:
        """``fn(*args)``, where any :class:`TaskRef` among ``args`` is replaced by its value."""
        return self._add(key, needs, Task(key, fn, *args))

    def _add(self, key, needs, task) -> TaskRef:
        needs = needs or None  # no resources, however spelled
        if not self.layers or self.layers[-1][0] != needs:
            self.layers.append((needs, {}))
        self.layers[-1][1][key] = task
        self.layer_of[key] = len(self.layers) - 1
        return TaskRef(key)

    def delayed(self, results: dict) -> dict:
        """``results`` with every reference to a task of this graph made a ``Delayed``."""
        ambient = dask.get_annotations()  # a dask.annotate around the call still applies
        token = tokenize(*(list(tasks) for _, tasks in self.layers))
        names = [f"daskdag-{k}-{token}" for k in range(len(self.layers))]
        layers = {name: MaterializedLayer(tasks, annotations={**ambient, "resources": needs}
                                          if needs else ambient or None)
                  for name, (needs, tasks) in zip(names, self.layers)}
        graph = HighLevelGraph(layers, {name: set(names[k - 1:k]) for k, name in enumerate(names)})

        def wrap(ref):
            return Delayed(ref.key, graph, layer=names[self.layer_of[ref.key]])

        return {o: (wrap(v), {i: wrap(g) for i, g in grads.items()})
                for o, (v, grads) in results.items()}

