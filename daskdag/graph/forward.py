"""Forward mode: values and Jacobian-vector products of a DAG's outputs, as one Dask graph.

In:  a :class:`~daskdag.model.plan.Plan` whose ``wrt`` are the inputs that carry tangents (so
     ``plan.active`` are the nodes a tangent reaches), the input values and their tangents.
Out: ``{output: (value, tangent)}`` of ``Delayed`` objects sharing one graph
     (:func:`build`), run by :func:`daskdag.running.compute.compute`.

Tangents are flat, as cotangents are (:mod:`daskdag.rules.pullback`): a value's tangent is a tuple
with one array per differentiable leaf (floating-point or complex arrays, Python floats), in
``jax.tree.leaves`` order; the other leaves are held constant and carry none. Only the outputs'
tangents are given their structure back (:func:`output_tangent`).

The graph mirrors the forward graph of :mod:`daskdag.graph.build`, stage by stage
(:func:`daskdag.graph.stages.make_stages`):

- a stage with no node that a tangent reaches runs :func:`daskdag.graph.tasks.forward` as there:
  ``fwd-B+C-<token>`` (and ``val-C-<token>``);
- every other stage runs :func:`forward` once: ``jvp-B+C-<token>`` computes its exposed
  values and their tangents in one pass; ``val-C-<token>`` and ``tan-C-<token>`` take them
  apart. A chain of eager nodes runs node by node, each under its kind's JVP rule
  (:mod:`daskdag.rules.registry`, by default ``jax.jvp``, leaf by leaf); a fused stage runs as one jitted
  program of the jvp of its fused function.
- ``tan-x-<token>`` holds input x's tangent, ``tangent-D-<token>`` output D's tangent in D's
  structure.

With ``directions=K`` every tangent carries a leading axis of K directions: each node's JVP
rule runs once under ``jax.vmap`` over that axis (the primals are not batched, so a node's
function still runs once), or, where a rule cannot be vmapped (non-JAX code in it), once per
direction.
"""

from __future__ import annotations

import weakref
from functools import partial

import jax
import jax.numpy as jnp

from daskdag.caches import ByObject
from daskdag.graph import tasks
from daskdag.graph.compiled import rebuild, split
from daskdag.graph.run import fused_function
from daskdag.errors import node_errors
from daskdag.graph.assembly import Intake, Keeper, TaskGraph, ident, is_root, key, token_of
from daskdag.model.plan import Plan
from daskdag.cancel import check
from daskdag.model.leaves import differentiable_leaves, on_differentiable
from daskdag.rules.jvp import directions, jvp_leaves
from daskdag.rules.registry import jvp_rule
from daskdag.graph.stages import Stage, make_stages
from daskdag.transport.transports import Transport

TANGENT = "tangent"  # the one "gradient" each output of the graph carries


# -- a stage ---------------------------------------------------------------------------------------

def forward(stage: Stage, stop, k: int | None, chunk: int | None, *args):
    """The task of a stage that a tangent reaches: ``args`` are the stage's ``Node`` s, the
    values of its deps, then their tangents (None where a dep carries none). Returns
    ``(exposed values, their tangents)``, a tangent None where the node carries none. ``k``:
    the number of directions, or None for one unbatched tangent; ``chunk``: at most that many
    directions per call (:func:`~daskdag.rules.jvp.directions`). ``stop``: as for
    :func:`daskdag.graph.tasks.forward`."""
    n, d = len(stage.nodes), len(stage.deps)
    nodes, deps, dep_tangents = args[:n], args[n:n + d], args[n + d:]
    if stage.fused:
        return _fused(stage, nodes, deps, dep_tangents, k, chunk)
    dropped = tasks.dropped_of(stage, stop)
    values: list = []
    tangents: list = []
    for j, (name, node, active) in enumerate(zip(stage.nodes, nodes, stage.active)):
        if values:
            check(dropped, name)
        inputs = stage.inputs(j, deps, values)
        tins: list | tuple
        tins = stage.inputs(j, dep_tangents, tangents)
        on = tuple(a and t is not None for a, t in zip(active, tins))
        tins = tuple(t if o else None for t, o in zip(tins, on))
        with node_errors(name, "forward"):
            if not any(on):
                primal, tangent = node.callable()(*inputs), None
            elif k is None:
                primal, tangent = jvp_rule(node)(inputs, tins, on)
            else:
                primal, tangent = directions(jvp_rule(node), inputs, tins, on, k, chunk)
            if primal is None:  # None is an empty pytree to JAX: it would fail later
                raise TypeError("its function returned None; a node must return its value, a JAX "
                                "array or a pytree of arrays (is a `return` missing?)")
        values.append(primal)
        tangents.append(None if tangent is None else tuple(tangent))
    return (tuple(values[j] for j in stage.exposed), tuple(tangents[j] for j in stage.exposed))


_programs: ByObject = ByObject("compiled jvp programs of fused stages", 1024)  # Fused -> program


def _fused(stage: Stage, nodes, deps, dep_tangents, k, chunk):
    """A fused stage's jvp as one jitted program of its :class:`~daskdag.graph.run.Fused`
    function, compiled once per function (while it lives), shapes and held constants."""
    fused = fused_function(stage, nodes).fn  # the same object while the functions live
    active = tuple(a and t is not None for a, t in zip(stage.dep_active(), dep_tangents))
    tins = tuple(t if a else None for t, a in zip(dep_tangents, active))
    parts = split(deps, active)
    with node_errors(stage.name, "forward"):
        if parts is None:  # a constant jit cannot hold: run it eagerly
            values, tangent = _jvp_of(fused, deps, tins, active, k, chunk)
        else:
            (treedef, consts), traced = parts
            values, tangent = _program(fused)((treedef, consts, active, k, chunk), traced, tins)
    it = iter(tangent)
    return values, tuple(tuple(next(it) for _ in differentiable_leaves(v)) for v in values)


def _jvp_of(fn, args, tangents, active, k, chunk=None):
    rule = partial(jvp_leaves, fn)
    return (rule(args, tangents, active) if k is None else
            directions(rule, args, tangents, active, k, chunk))


def _program(fused):
    program = _programs.get(fused)
    if program is None:
        ref = weakref.ref(fused)  # (the cache keeps no Fused alive)

        def run(static, dynamic, tangents):
            treedef, consts, active, k, chunk = static
            return _jvp_of(ref(), rebuild(treedef, consts, dynamic), tangents, active, k, chunk)

        program = _programs.put(fused, jax.jit(run, static_argnums=0))
    return program


def pick_tangent(out, k: int):
    """The ``k``-th exposed tangent from :func:`forward`'s result."""
    return out[1][k]


def output_tangent(value, flat, k: int | None):
    """An output's tangent in its structure: ``flat`` (a flat tuple, or None where no tangent
    reaches it: zeros) on its differentiable leaves, ``None`` on the others; with ``k``
    directions, each leaf has a leading axis of ``k``."""
    if flat is None:
        lead = () if k is None else (k,)
        flat = [jnp.zeros((*lead, *jnp.shape(leaf)), jnp.result_type(leaf))
                for leaf in differentiable_leaves(value)]
    return on_differentiable(value, flat)


# -- the graph -------------------------------------------------------------------------------------

def build(plan: Plan, values: dict, tangents: dict, transport: Transport, k: int | None = None,
          place=None, stop=None, chunk: int | None = None, stages=None,
          keep: Keeper | None = None) -> dict:
    """The graph of one call: ``{output: (value, {TANGENT: tangent})}`` of ``Delayed``.
    ``tangents``: ``{input: flat tangent}`` for the plan's ``wrt`` (:func:`input_tangents`);
    ``k``: the number of directions, or None; ``chunk``: at most that many per call.
    ``values``, ``transport``, ``place``, ``stop``, ``stages`` and ``keep`` as for
    :func:`daskdag.graph.build.build`."""
    spec, g = plan.spec, TaskGraph()
    intake = Intake(g, transport, place, keep)
    needed = spec.ancestors(plan.outputs)
    val = {i: intake.value("input", i, f"input {i!r}", v) for i, v in values.items() if i in needed}
    tan = {i: intake.value("tan", i, f"the tangent of input {i!r}", tangents[i])
           for i in plan.wrt if i in needed}

    for s in make_stages(plan) if stages is None else stages:
        sent = [intake.node(n, spec.nodes[n]) for n in s.nodes]
        deps = [ident(val[d]) for d in s.deps]
        if not s.has_pullback:  # no tangent reaches it: the forward task of the gradient graph
            fwd = intake.stage(intake.key("fwd", s.name, s, [ident(n) for n in sent], deps, None,
                                          None), dict(s.needs), tasks.forward, 2 + len(sent), s,
                               stop, *sent, *(val[d] for d in s.deps), root=is_root(s, spec))
        else:
            dep_tangents = [tan.get(d) for d in s.deps]
            k_jvp = intake.key("jvp", s.name, s, [ident(n) for n in sent], deps,
                               [None if t is None else ident(t) for t in dep_tangents], k, chunk)
            fwd = intake.stage(k_jvp, dict(s.needs), forward, 4 + len(sent), s, stop, k, chunk,
                               *sent, *(val[d] for d in s.deps), *dep_tangents,
                               root=is_root(s, spec))
        token = token_of(str(fwd.key))
        for e, n in enumerate(s.outputs):
            val[n] = fwd if s.value_only else g.task(key("val", n, token), dict(s.needs),
                                                     tasks.pick, fwd, s.has_pullback, e)
            if n in plan.active:
                tan[n] = g.task(key("tan", n, token), dict(s.needs), pick_tangent, fwd, e)

    results = {}
    for o in plan.outputs:
        name = intake.key("tangent", o, val[o].key, tan[o].key if o in tan else None, k)
        results[o] = (val[o], {TANGENT: g.task(name, None, output_tangent, val[o], tan.get(o), k)})
    return g.delayed(results, intake.call)
