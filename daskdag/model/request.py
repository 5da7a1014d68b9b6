"""The user's arguments (DAG, inputs, outputs, ``wrt``, cotangents, tangents, a sweep's
``batched`` and ``chunk_size``), checked alike for every entry point and the command line before
anything runs; else a :class:`~daskdag.DAGError` naming the input, output or node at fault."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path

from daskdag.errors import DAGError
from daskdag.model.leaves import (describe, differentiable_leaves, is_differentiable, is_numeric,
                                  zeros)
from daskdag.model.plan import Plan, make_plan
from daskdag.model.spec import Custom, Spec, parse
from daskdag.transport.packing import unwrap


@dataclass(frozen=True)
class Request:
    """A call's arguments, checked: its plan, input values and outputs' cotangents."""

    plan: Plan
    values: dict[str, Any]
    cotangents: dict[str, Any]

    @property
    def spec(self) -> Spec:
        return self.plan.spec


def prepare(dag, x, outputs, wrt=None, cotangents=None, hold=None) -> Request:
    """``compute_grads``' arguments (and others' alike) checked; ``hold`` as for
    :func:`~daskdag.model.spec.parse`."""
    spec, names, values = parsed(dag, x, outputs, hold)
    wrt = wrt_names(spec, values, wrt, candidates=values)
    plan = with_rules(make_plan(spec, names, wrt))
    return Request(plan, values, cotangents_for(names, cotangents))


def parsed(dag, x, outputs, hold=None) -> tuple[Spec, tuple[str, ...], dict[str, Any]]:
    """What every call starts from: the DAG parsed, the output names, the input values."""
    spec = parse(dag, hold)
    names = output_names(spec, outputs)
    return spec, names, input_values(spec, x, names)


def output_names(spec, outputs) -> tuple[str, ...]:
    names = (outputs,) if isinstance(outputs, str) else tuple(outputs)
    if not names:
        raise DAGError("no outputs requested")
    for o in names:
        if o not in spec.nodes:
            kind = "a free input, not a node" if o in spec.inputs else "not a node of the DAG"
            raise DAGError(f"output {o!r} is {kind}; nodes: {sorted(spec.nodes)}")
    return tuple(dict.fromkeys(names))


def input_values(spec, x, outputs) -> dict[str, Any]:
    """``{input: value}`` for the inputs given, each needed one checked there. With several free
    inputs, ``x`` is ``{input_name: value}``; with one, its value (any pytree), or a mapping with
    the input's name as a key; one that reads as given under another name is refused."""
    if len(spec.inputs) == 1:
        (name,) = spec.inputs
        if names_the_input(name, x):
            for k in x:
                if k != name:
                    raise DAGError(f"this DAG's one free input is {name!r}; x gives a value for "
                                   f"{k!r} too, which is not a free input"
                                   + (" (a node: its value is computed, not given)"
                                      if k in spec.nodes else "")
                                   + f"; a dict with the key {name!r} names the input, so to "
                                   f"give {name!r} such a dict as its value, pass "
                                   f"{{{name!r}: value}}")
        elif wrong := _misnamed(spec, name, x):
            raise DAGError(wrong)
        return given_values(spec, x)
    if not isinstance(x, Mapping):
        why = "".join(f"; {s}" for s in (_misspelt(spec, i, outputs) for i in spec.inputs) if s)
        raise DAGError(f"the DAG has {len(spec.inputs)} free inputs {list(spec.inputs)}: "
                       f"pass x as a dict {{input_name: value}}, got {type(x).__name__}{why}")
    for k in x:
        if k not in spec.inputs:
            raise DAGError(f"x gives a value for {k!r}, which is not a free input of the DAG "
                           f"{list(spec.inputs)}")
    needed = spec.ancestors(outputs)
    for i in spec.inputs:
        if i in needed and i not in x:
            users = [n for n, node in spec.nodes.items() if i in node.deps]
            why = _misspelt(spec, i, outputs, given=x)
            raise DAGError(f"no value for input {i!r} (used by {users}); x has {list(x)}"
                           + (f"; {why}" if why else ""))
    return dict(x)


def given_values(spec, x) -> dict[str, Any]:
    """``{input: value}`` as :func:`input_values` reads ``x``, without its checks."""
    if len(spec.inputs) != 1:
        return dict(x)
    (name,) = spec.inputs
    return {name: x[name] if names_the_input(name, x) else x}


def names_the_input(name: str, x) -> bool:
    """``x`` gives the one free input ``name`` as ``{name: value}``."""
    return isinstance(x, Mapping) and name in x


def _misnamed(spec, name: str, x) -> str:
    """Why ``x``, given for the one free input ``name``, reads as given under another name (a
    mapping whose keys all name nodes, or one array under a single key); else ''."""
    if not isinstance(x, Mapping) or not x or not all(isinstance(k, str) for k in x):
        return ""
    keys = list(x)
    shown = "{" + ", ".join(f"{k!r}: ..." for k in keys) + "}"
    if all(k in spec.nodes for k in keys):
        why = (f"{', '.join(map(repr, keys))} {'is a node' if len(keys) == 1 else 'are nodes'} "
               f"of the DAG, whose values are computed, not given")
    elif len(keys) == 1 and (is_numeric(x[keys[0]]) or _is_lazy_array(x[keys[0]])):
        close = difflib.get_close_matches(keys[0], [name], n=1)
        why = (f"one array under the name {keys[0]!r}, not the input's"
               + (f" (did you mean {name!r}?)" if close else ""))
    else:
        return ""
    return (f"this DAG's one free input is {name!r}; you passed {shown}: {why}. Pass the value "
            f"of {name!r} itself, or {{{name!r}: value}}; to give {name!r} this dict as its "
            f"value, pass {{{name!r}: {shown}}}")


def _misspelt(spec, name: str, outputs, given=()) -> str:
    """What to say of free input ``name`` when it looks like a misspelt node (or ``given``
    input): which nodes name it, the name meant and, for a node, that nothing uses it; else ''."""
    users = list(dict.fromkeys(n for n, _ in spec.uses.get(name, ())))
    named_by = " and ".join(f"node {u!r}" for u in users)
    nodes = difflib.get_close_matches(name, list(spec.nodes), n=1)
    if nodes:
        (meant,) = nodes
        if meant not in spec.uses and meant not in outputs:
            fate = f" As it is, node {meant!r} is unused: no node takes it as a dep"
        elif meant not in spec.ancestors(outputs):
            fate = f" As it is, node {meant!r} is used by none of the outputs {list(outputs)}"
        else:
            fate = ""
        return (f"{named_by} {'names' if len(users) == 1 else 'name'} dep {name!r}, which is no "
                f"node, so it is a free input: did you mean {meant!r}?{fate}")
    inputs = difflib.get_close_matches(name, [g for g in given if g != name], n=1)
    if inputs:
        return (f"{named_by} {'names' if len(users) == 1 else 'name'} dep {name!r}: did you "
                f"mean input {inputs[0]!r}?")
    return ""


def wrt_names(spec, values, wrt, candidates) -> tuple[str, ...]:
    """The inputs to differentiate: ``wrt`` checked, or those among ``candidates`` with a
    differentiable (floating-point) leaf."""
    if wrt is None:
        wrt = tuple(i for i, v in candidates.items() if _differentiable(v))
        if not wrt:
            raise DAGError(f"no input to differentiate: none of {list(candidates)} has a "
                           f"floating-point array leaf")
        return wrt
    wrt = (wrt,) if isinstance(wrt, str) else tuple(wrt)
    for i in wrt:
        if i in spec.nodes:  # its value's floating leaves, once it has one
            continue
        if i not in values:
            raise DAGError(f"wrt names {i!r}, which is neither a given free input "
                           f"{list(values)} nor a node")
        if not _differentiable(values[i]):
            raise DAGError(f"wrt names input {i!r}, which has no floating-point array leaf "
                           f"to differentiate")
    if len(spec.inputs) == 1 and not wrt:
        raise DAGError("wrt is empty: nothing to differentiate")
    return tuple(dict.fromkeys(wrt))


def nodes_in_wrt(spec, wrt, what: str) -> str | None:
    """Why a call that ``what`` (``"check_totals perturbs"``...) free inputs only cannot take
    ``wrt``, naming the nodes in it; None when it names none."""
    nodes = [w for w in wrt if w in spec.nodes]
    return f"wrt names node(s) {nodes}: {what} free inputs only" if nodes else None


def cotangents_for(outputs, cotangents) -> dict:
    cotangents = dict(cotangents or {})
    for o in cotangents:
        if o not in outputs:
            raise DAGError(f"cotangents given for {o!r}, which is not a requested output "
                           f"{list(outputs)}")
    return cotangents


def batched_names(values, batched) -> tuple[str, ...]:
    if batched is None:
        return tuple(values)
    batched = (batched,) if isinstance(batched, str) else tuple(batched)
    for i in batched:
        if i not in values:
            raise DAGError(f"batched names {i!r}, which is not a given free input {list(values)}")
    if not batched:
        raise DAGError("batched is empty: no input carries the items to sweep over")
    return batched


def batch_size(values, batched) -> int:
    """N, the leading axis length that every leaf of every batched input shares."""
    sizes: dict[int, Any] = {}
    for i in batched:  # array leaves carry the items; others (functions...) are shared
        for leaf in jax.tree.leaves(values[i]):
            if not (is_numeric(leaf) or _is_lazy_array(leaf)):
                continue
            if len(np.shape(leaf)) == 0:
                raise DAGError(f"batched input {i!r} has a scalar leaf: it needs a leading "
                               f"item axis")
            sizes.setdefault(int(np.shape(leaf)[0]), i)
    if len(sizes) != 1:
        raise DAGError("batched inputs disagree on the number of items: "
                       + ", ".join(f"{i!r} has {n}" for n, i in sizes.items()) if sizes else
                       f"batched inputs {list(batched)} hold no arrays")
    (size,) = sizes
    return size


def check_chunk_size(chunk_size) -> None:
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size > 0):
        raise DAGError(f"chunk_size must be a positive integer, got {chunk_size!r}")


def check_errors(errors) -> None:
    """A sweep's ``errors=``: ``'raise'`` or ``'collect'``."""
    if errors not in ("raise", "collect"):
        raise DAGError(f"errors must be 'raise' or 'collect', got {errors!r}")


def with_rules(plan, forward: bool = False):
    """``plan``, checked: a :class:`DAGError` for the first of :func:`rules_missing`."""
    missing = rules_missing(plan, forward)
    if missing:
        raise DAGError(next(iter(missing.values())))
    return plan


def rules_missing(plan, forward: bool = False) -> dict[str, str]:
    """``{node: what it lacks}``, in order, for each node of the user's own code that ``plan``
    differentiates without the rule it needs: a VJP, or with ``forward`` a JVP."""
    missing = {}
    for n in plan.needed:
        fn = unwrap(plan.spec.nodes[n].fn)
        if n not in plan.active or not isinstance(fn, Custom):
            continue
        if forward and fn.jvp is None:
            missing[n] = (f"node {n!r} carries a tangent but has no jvp= rule, which forward "
                          f"mode needs (a VJP serves reverse mode only)")
        if not forward and not fn.reverse:
            missing[n] = (f"node {n!r} is differentiated but has no VJP, only jvp=: give it "
                          f"vjp= or fwd=/bwd=, or leave out of wrt the inputs it depends on")
    return missing


def _differentiable(value) -> bool:
    """A floating-point leaf, or no leaf at all (an empty pytree's gradient is itself)."""
    return bool(differentiable_leaves(value)) or not jax.tree.leaves(value)


def input_tangents(spec, values: dict, tangents, batched: bool
                   ) -> tuple[dict[str, tuple], int | None]:
    """The user's ``tangents`` checked against the input ``values``: ``({input: flat tangent},
    k)`` for the inputs with a differentiable leaf, ``k`` the number of directions (None unless
    ``batched``). None at a differentiable leaf is a zero tangent; other leaves take only None."""
    if len(spec.inputs) == 1:  # (read as x is)
        (name,) = spec.inputs
        if names_the_input(name, tangents):
            for k in tangents:
                if k != name:
                    raise DAGError(f"this DAG's one free input is {name!r}; tangents give a "
                                   f"tangent for {k!r} too, which is not a free input")
        given = given_values(spec, tangents)
    else:
        if not isinstance(tangents, Mapping):
            raise DAGError(f"the DAG has {len(spec.inputs)} free inputs {list(spec.inputs)}: "
                           f"pass tangents as a dict {{input_name: tangent}}, got "
                           f"{type(tangents).__name__}")
        given = dict(tangents)
        for i in given:
            if i not in spec.inputs:
                raise DAGError(f"tangents give a tangent for {i!r}, which is not a free input of "
                               f"the DAG {list(spec.inputs)}")
            if i not in values:
                raise DAGError(f"tangents give a tangent for input {i!r}, but x gives it no value")
    checked = {i: _checked(i, values[i], t, batched) for i, t in given.items()}
    k = None
    if batched:
        sizes = {jnp.shape(t)[0]: i for i, pairs in checked.items() for _, t in pairs
                 if t is not None}
        if len(sizes) > 1:
            raise DAGError("batched tangents disagree on the number of directions: "
                           + ", ".join(f"input {i!r} has {n}" for n, i in sizes.items()))
        if not sizes:
            raise DAGError("batched=True, but no tangent has an array to give the number of "
                           "directions (the leading axis)")
        (k,) = sizes
    return {i: tuple(zeros(leaf, k)[0] if t is None
                     else t if _is_lazy_array(t) else jnp.asarray(t, jnp.result_type(leaf))
                     for leaf, t in pairs)
            for i, pairs in checked.items() if pairs}, k


def _checked(name: str, x, tangent, batched: bool) -> list:
    """``[(leaf, its tangent or None)]`` for the differentiable leaves of input ``x``."""
    with_paths, treedef = tree_flatten_with_path(x)
    try:
        parts = treedef.flatten_up_to(tangent)
    except (ValueError, TypeError):
        raise DAGError(f"tangent for input {name!r} is {describe(tangent)}, but the input "
                       f"is {describe(x)}") from None
    pairs = []
    for (path, leaf), t in zip(with_paths, parts):
        where = f"input {name!r}" + (f" at {keystr(path)}" if path else "")
        if not is_differentiable(leaf):
            if t is not None:
                raise DAGError(f"tangent for {where}: that leaf is {describe(leaf)}, held "
                               f"constant (not floating-point); give None there, got "
                               f"{describe(t)}")
            continue
        if t is not None and not (is_numeric(t) or _is_lazy_array(t)):  # (a pytree there)
            raise DAGError(f"tangent for input {name!r} is {describe(tangent)}, but the "
                           f"input is {describe(x)}")
        if t is not None:
            kind = jnp.result_type(t)
            if isinstance(t, bool) or not (
                    jnp.issubdtype(kind, jnp.inexact) or isinstance(t, int)):
                raise DAGError(f"tangent for {where} is {describe(t)}: it must be "
                               f"floating-point, like the input ({jnp.result_type(leaf)})")
            if jnp.issubdtype(kind, jnp.complexfloating) and not jnp.iscomplexobj(leaf):
                raise DAGError(f"tangent for {where} is complex ({kind}), but the input is real "
                               f"({jnp.result_type(leaf)})")
            shape, want = tuple(jnp.shape(t)), tuple(jnp.shape(leaf))
            if (shape[1:] if batched else shape) != want or (batched and not shape):
                raise DAGError(f"tangent for {where} has shape {shape}, but the input has shape "
                               f"{want}" + (" (with batched=True, a tangent has a leading axis "
                                            "of directions: (K, *shape))" if batched else ""))
        pairs.append((leaf, t))
    return pairs


def _is_lazy_array(leaf) -> bool:
    """A dask array: it has a shape and chunks, and no values yet."""
    return hasattr(leaf, "chunks") and isinstance(getattr(leaf, "shape", None), tuple)


def one_input(spec: Spec, names: Iterable[str]) -> bool:
    """The DAG has one free input, all that was differentiated (``names``): its gradient alone."""
    return len(spec.inputs) == 1 and list(names) == list(spec.inputs)


def alone(spec: Spec, per_name: dict) -> Any:
    """``per_name`` (``{name: ...}`` over the names differentiated) as a result gives it: the
    one free input's alone where :func:`one_input`."""
    return per_name[spec.inputs[0]] if one_input(spec, per_name) else per_name
