"""The sparsity patterns of a DAG's Jacobians, composed from each node's own pattern: from its
jaxpr (sound everywhere), or for a node that cannot be traced, probed (its Jacobian at the point
and at :data:`PROBES` random points near it, united: as sound as the probes are typical).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import jax
import numpy as np

from daskdag.errors import DAGError, node_errors
from daskdag.model.leaves import UNKNOWN, Traced, abstract, abstract_values, is_differentiable
from daskdag.model.plan import Plan
from daskdag.rules.vjp import basis, has_rules, linearizer
from daskdag.rules.sparsity import differentiable, jaxpr_pattern

if TYPE_CHECKING:
    import scipy.sparse as sp

PROBES = 2  # random points near the point, besides it, where a node is probed


def detect(plan: Plan, values: dict, probed: list | None = None,
           traces: dict[str, Traced] | None = None) -> dict[str, sp.csr_array]:
    """``{output: pattern}``, a boolean ``csr_array`` (its elements, every wrt name's), over
    differentiable leaves in order, each flattened in C order. ``probed`` gets the nodes whose
    pattern was probed (it holds at this point only)."""
    import scipy.sparse as sp
    spec = plan.spec
    avals = shapes(plan, values, traces)
    concrete: dict = {}
    if any(avals[n] is UNKNOWN for n in (*plan.needed, *plan.wrt)):
        concrete = _forward(plan, values)
        avals = {**avals, **{n: abstract(v) for n, v in concrete.items()}}
    starts = np.cumsum([0, *(size(avals[n]) for n in plan.wrt)]).tolist()
    width = starts[-1]
    depends = {name: sp.eye_array(b - a, width, k=a, dtype=np.int64, format="csr")
               for name, a, b in zip(plan.wrt, starts, starts[1:])}  # (a block of the identity)
    for n in plan.needed:
        node = spec.nodes[n]
        total = sp.csr_array((size(avals[n]), width), dtype=np.int64)
        active = tuple(d in depends for d in node.deps)
        if any(active):
            for pattern, d in zip(_node_pattern(n, node, avals, concrete, values, active,
                                                probed), node.deps):
                if pattern is not None:
                    total = total + pattern.astype(np.int64) @ depends[d]
        if n in depends:  # a wrt node: its own block too
            total = total + depends[n]
        if n in plan.active or n in depends:
            depends[n] = (total > 0).astype(np.int64)
    return {o: (depends[o] > 0).tocsr() if o in depends else
            sp.csr_array((size(avals[o]), width), dtype=bool) for o in plan.outputs}


def shapes(plan: Plan, values: dict, traces: dict[str, Traced] | None = None,
           only: Collection[str] | None = None) -> dict:
    """The inputs' and needed nodes' shapes (:data:`UNKNOWN` for the user's own code), traced
    into ``traces``; ``only``: these nodes and those they depend on."""
    wanted = plan.spec.ancestors(only) if only is not None else None
    names = [n for n in plan.needed if wanted is None or n in wanted]
    return abstract_values(plan.spec, names, {i: abstract(v) for i, v in values.items()},
                           lambda node: _untraced if has_rules(node) else node.callable(), traces)


def _untraced(*args):
    raise TypeError("a node of your own code is not traced")  # (its shapes are UNKNOWN)


def size(aval) -> int:
    """The elements of a value's differentiable leaves (a concrete value's, or its shapes')."""
    return sum(int(np.prod(np.shape(a))) for a in jax.tree.leaves(aval) if differentiable(a))


def _node_pattern(name, node, avals, concrete, values, active, probed: list | None) -> list:
    """Per dep, the node's own pattern: from its jaxpr, else probed (and added to ``probed``)."""
    deps = [avals[d] for d in node.deps]
    if not has_rules(node) and not any(a is UNKNOWN for a in deps):
        found = jaxpr_pattern(node.callable(), deps, active)
        if found is not None:
            return found
    if probed is not None:
        probed.append(name)
    args = [concrete[d] if d in concrete else values[d] for d in node.deps]
    return _probe(name, node, args, active)


def _forward(plan: Plan, values: dict) -> dict:
    """Every needed node's value, run here in order."""
    out = dict(values)
    for n in plan.needed:
        node = plan.spec.nodes[n]
        with node_errors(n, "forward"):
            out[n] = node.callable()(*(out[d] for d in node.deps))
    return {n: out[n] for n in plan.needed}


def _probe(name, node, args, active) -> list:
    """The node's Jacobian by its own rule, at ``args`` and near them; its nonzeros, united."""
    import scipy.sparse as sp
    rng = np.random.default_rng(0)
    found = None
    for k in range(PROBES + 1):
        point = args if k == 0 else [_near(a, rng) if on else a for a, on in zip(args, active)]
        blocks = _jacobian(name, node, point, active)
        found = blocks if found is None else [None if f is None else f + b
                                              for f, b in zip(found, blocks)]
    return [None if f is None else sp.csr_array(f != 0) for f in found]  # type: ignore[union-attr]


def _near(value, rng):
    """``value`` with each differentiable leaf moved a little, at random."""
    def move(leaf):
        if not is_differentiable(leaf):
            return leaf
        a = np.asarray(leaf)
        return (a + 1e-2 * (np.abs(a) + 1) * rng.standard_normal(a.shape)).astype(a.dtype)
    return jax.tree.map(move, value)


def _jacobian(name, node, args, active) -> list:
    """Per dep, the node's Jacobian (dense, NumPy) by its own rule: row by row of its output."""
    with node_errors(name, "forward"):
        primal, pullback = linearizer(node)(args, active)
    if primal is None:
        raise DAGError(f"node {name!r} returned None")
    rows, n = basis(name, primal), size(primal)
    with node_errors(name, "backward"):
        per_row = [pullback(tuple(leaf[r] for leaf in rows), args) for r in range(n)]

    def block(j: int) -> np.ndarray:
        return np.array([np.concatenate([np.ravel(np.asarray(c)) for c in row[j]])
                         if row[j] is not None and len(row[j]) else np.zeros(size(args[j]))
                         for row in per_row]).reshape(n, size(args[j]))
    return [block(j) if on else None for j, on in enumerate(active)]
