"""Wire a :class:`~daskdag.plan.Plan` into one Dask graph of forward and backward tasks.

In:  a plan, the input values, the user's cotangents.
Out: ``{output: (value, {input: grad})}`` of ``dask.delayed.Delayed`` objects sharing one graph.

Keys are readable and deterministic: ``fwd-B-<token>`` (plus ``val-B``/``pb-B`` splitting the
primal from the pullback, so downstream forward tasks never fetch residuals), ``bwd-D-B-<token>``
for node B's backward pass towards output D, ``grad-D-x-<token>``. Outputs share forward keys, so
every node runs once per call; tokens hash functions and inputs, so repeated calls on one
cluster share them too.

The tasks go straight into one :class:`~dask.highlevelgraph.HighLevelGraph` (``dask.task_spec``
tasks), not through ``dask.delayed`` calls: each of those merges the graphs of its arguments,
which made building quadratic in the number of nodes (2 s for a 1,000-node chain).
"""

from __future__ import annotations

from operator import getitem

import dask
from dask.base import tokenize
from dask.delayed import Delayed
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.task_spec import Task, TaskRef

from . import tasks
from .plan import Plan
from . import protocol  # noqa: F401  (importing it registers daskdag's types with Dask)
from .shipping import pack_for, unpack


def build(plan: Plan, values: dict, cotangents: dict, batched: bool = False, remote: bool = False,
          place=None) -> dict[str, tuple[Delayed, dict[str, Delayed]]]:
    """The graph of one call; ``batched``: outputs carry a leading item axis (a sweep's chunk);
    ``remote``: it goes to a cluster, so everything in it must pickle (see :mod:`.shipping`).

    The plan's node functions are packed already (:func:`daskdag.shipping.ship`); input values
    are packed here, and unpacked by a task of their own. ``place(key, fn, payload, needs)``,
    when given, keeps ``fn(payload)`` on the cluster under the content ``key`` (on a worker with
    the resources ``needs``) and returns its reference (:mod:`daskdag.resident`): inputs and
    nodes then travel once, not in each graph.
    """
    spec, g = plan.spec, _Graph()
    val = {}
    for i, v in values.items():
        if isinstance(v, TaskRef):  # already on the cluster (a sweep's shared input)
            val[i] = v
            continue
        v = pack_for(f"input {i!r}", v, remote)
        key = f"input-{i}-{tokenize(v)}"
        val[i] = place(key, unpack, v) if place else g.task(key, None, unpack, v)
    pb = {}

    # Forward: each needed node once; under jax.vjp when it depends on a differentiated input.
    for n in plan.needed:
        node, deps = spec.nodes[n], spec.nodes[n].deps
        active = tuple(d in plan.wrt or d in plan.active for d in deps)
        tok = tokenize(n, node.fn, node.jit, active, [val[d].key for d in deps])
        sent = place(f"node-{n}-{tokenize(node)}", _itself, node, node.needs) if place else node
        fwd = g.task(f"fwd-{n}-{tok}", node.needs, tasks.forward, n, sent, active,
                     *(val[d] for d in deps))
        if n in plan.active:
            val[n] = g.task(f"val-{n}-{tok}", node.needs, getitem, fwd, 0)
            pb[n] = g.task(f"pb-{n}-{tok}", node.needs, getitem, fwd, 1)
        else:
            val[n] = fwd

    # Backward, per output: a node's cotangent is the sum of its consumers' shares.
    results = {}
    for o in plan.outputs:
        bwd = {}
        for n in reversed(plan.backward[o]):
            if n == o:
                ct = cotangents.get(o)
                sources = [g.task(f"seed-{o}-{tokenize(val[o].key, ct)}", None,
                                  tasks.seed, o, val[o], ct, batched)]
                positions = (None,)
            else:
                sources, positions = _shares(plan.consumers(n, o), bwd)
            tok = tokenize(pb[n].key, [s.key for s in sources], positions)
            node = spec.nodes[n]
            bwd[n] = g.task(f"bwd-{o}-{n}-{tok}", node.needs, tasks.backward, n, positions,
                            len(node.deps), pb[n], *(val[d] for d in node.deps), *sources)
        grads = {}
        for i in plan.wrt:
            sources, positions = _shares(plan.consumers(i, o), bwd)
            tok = tokenize(val[i].key, [s.key for s in sources], positions)
            grads[i] = g.task(f"grad-{o}-{i}-{tok}", None, tasks.gradient, positions, val[i],
                              *sources)
        results[o] = (val[o], grads)
    return g.delayed(results)


def _itself(x):
    return x


def _shares(uses, bwd):
    """The backward tasks of a node's consumers, and the node's position among each one's deps."""
    return [bwd[c] for c, _ in uses], tuple(i for _, i in uses)


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

