"""The public entry point: :func:`compute_grads`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dask
import distributed
import jax
import jax.numpy as jnp

from . import cluster
from .errors import DAGError
from .graph import build
from .plan import make_plan
from .spec import parse


@dataclass(frozen=True)
class Result:
    """One output's ``value`` and ``grad``.

    ``grad`` is shaped like ``x`` when the DAG has one free input, else a dict ``{input: grad}``
    over the differentiated inputs.
    """

    value: Any
    grad: Any


def compute_grads(dag: Mapping, x, outputs: str | Sequence[str], *, wrt: Sequence[str] | None = None,
                  cotangents: Mapping[str, Any] | None = None, client=None):
    """Values and gradients of ``outputs`` of ``dag``, each node computed once.

    dag:        ``{name: (fn, [deps])}`` or ``{name: daskdag.Node(fn, deps, jit=...)}``; a dep that
                is no node's name is a free input.
    x:          the free input's value (any pytree of arrays) when there is one, else a mapping
                ``{input_name: value}``.
    outputs:    node names; a single name returns a single :class:`Result`.
    wrt:        input names to differentiate; default every given input with floating leaves.
    cotangents: ``{output: ct}`` seeds for outputs that are not real scalars (scalars get 1).
    client:     a ``distributed.Client``; default the active one, else Dask's threaded scheduler.

    Returns ``{output: Result(value, grad)}``. Raises :class:`~daskdag.DAGError` for a malformed
    call and :class:`~daskdag.NodeError` when a node raises.
    """
    spec, plan, graph = build_graph(dag, x, outputs, wrt=wrt, cotangents=cotangents)
    client = client if client is not None else _active_client()
    if client is not None:
        cluster.check(client, plan)
    (computed,) = dask.compute(graph, scheduler=client)
    single = len(spec.inputs) == 1
    results = {o: Result(v, g[spec.inputs[0]] if single else g) for o, (v, g) in computed.items()}
    return results[outputs] if isinstance(outputs, str) else results


def build_graph(dag, x, outputs, *, wrt=None, cotangents=None):
    """Validate a call; return its spec, plan and ``{output: (value, {input: grad})}`` as
    ``dask.delayed`` objects."""
    spec = parse(dag)
    names = _outputs(spec, outputs)
    values = _input_values(spec, x, names)
    wrt = _wrt(spec, values, wrt)
    cotangents = dict(cotangents or {})
    for o in cotangents:
        if o not in names:
            raise DAGError(f"cotangents given for {o!r}, which is not a requested output {list(names)}")
    plan = make_plan(spec, names, wrt)
    return spec, plan, build(plan, values, cotangents)


def _active_client():
    """The ``distributed`` client in use, if any (none is ever started here)."""
    try:
        return distributed.default_client()
    except ValueError:
        return None


def _outputs(spec, outputs) -> tuple[str, ...]:
    names = (outputs,) if isinstance(outputs, str) else tuple(outputs)
    if not names:
        raise DAGError("no outputs requested")
    for o in names:
        if o not in spec.nodes:
            kind = "a free input, not a node" if o in spec.inputs else "not a node of the DAG"
            raise DAGError(f"output {o!r} is {kind}; nodes: {sorted(spec.nodes)}")
    return tuple(dict.fromkeys(names))


def _input_values(spec, x, outputs) -> dict[str, Any]:
    """``{input: value}`` for the inputs given, checking that every needed one is."""
    if len(spec.inputs) == 1:
        return {spec.inputs[0]: x}
    if not isinstance(x, Mapping):
        raise DAGError(f"the DAG has {len(spec.inputs)} free inputs {list(spec.inputs)}: "
                       f"pass x as a dict {{input_name: value}}, got {type(x).__name__}")
    for k in x:
        if k not in spec.inputs:
            raise DAGError(f"x gives a value for {k!r}, which is not a free input of the DAG "
                           f"{list(spec.inputs)}")
    needed = spec.ancestors(outputs)
    for i in spec.inputs:
        if i in needed and i not in x:
            users = [n for n, node in spec.nodes.items() if i in node.deps]
            raise DAGError(f"no value for input {i!r} (used by {users}); x has {list(x)}")
    return dict(x)


def _wrt(spec, values, wrt) -> tuple[str, ...]:
    if wrt is None:
        wrt = tuple(i for i, v in values.items() if _floating(v))
        if not wrt:
            raise DAGError(f"no input to differentiate: none of {list(values)} has only "
                           f"floating-point leaves")
        return wrt
    wrt = (wrt,) if isinstance(wrt, str) else tuple(wrt)
    for i in wrt:
        if i not in values:
            raise DAGError(f"wrt names {i!r}, which is not a given free input {list(values)}")
        if not _floating(values[i]):
            raise DAGError(f"wrt names input {i!r}, whose leaves are not all floating point")
    if len(spec.inputs) == 1 and not wrt:
        raise DAGError(f"wrt is empty: nothing to differentiate")
    return tuple(dict.fromkeys(wrt))


def _floating(value) -> bool:
    return all(jnp.issubdtype(jnp.result_type(leaf), jnp.floating) for leaf in jax.tree.leaves(value))
