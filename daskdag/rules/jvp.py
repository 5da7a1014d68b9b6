"""Forward mode: JAX's own rule, a node under ``jax.jvp`` leaf by leaf, or the rule registered
for the node's kind (:func:`jvp_rule`); any rule run for several directions at once; and whether
a node's jaxpr can go through ``jax.jvp`` at all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from daskdag.cancel import Cancelled
from daskdag.model.leaves import is_numeric, partition
from daskdag.model.spec import Node
from daskdag.rules.vjp import in_brief, of_jaxpr, of_leaves, rule_for

#: The primitive ``jax.jvp`` leaves in a ``jax.custom_vjp`` function, which has no forward-mode
#: rule: it fails when it runs or compiles, not when traced.
NO_JVP = "custom_lin"


def jvp(node: Node, args: Sequence[Any], tangents: Sequence[Any], active: tuple[bool, ...]):
    """``(primal, tangent)``: ``jax.jvp`` of the node's function at ``args``, the differentiable
    leaves of the ``active`` args moving along ``tangents`` (per arg, a flat tuple), the rest
    held. The tangent is flat over the primal's differentiable leaves."""
    diff, fn_of_diff, rebuild = of_leaves(node.callable(), args, active)
    tans = [t for on, ts in zip(active, tangents) if on for t in ts]
    primal_diff, tangent, held = jax.jvp(fn_of_diff, tuple(diff), tuple(tans), has_aux=True)
    return rebuild(primal_diff, held), tuple(tangent)


def jvp_rule(node: Node) -> Callable:
    """``f(args, tangents, active) -> (primal, tangent)`` for ``node``."""
    return rule_for(node, "push", jvp)


def directions(rule: Callable, args, tangents, active, k: int, chunk: int | None = None):
    """``rule(args, tangents, active)`` for ``k`` directions at once (a leading axis of the
    tangents): under ``jax.vmap`` (else one call per direction), ``chunk`` at most per call."""
    if chunk is not None and chunk < k:
        parts = [directions(rule, args, jax.tree.map(lambda a: a[s:s + chunk], tuple(tangents)),
                            active, min(chunk, k - s)) for s in range(0, k, chunk)]
        return parts[0][0], tuple(jnp.concatenate(leaves) for leaves in zip(*(t for _, t in parts)))
    box: dict = {}

    def one(t):
        primal, tangent = rule(args, t, active)
        (numeric, box["static"]), box["combine"] = partition(primal, lambda a: not is_numeric(a))
        return numeric, tuple(tangent)

    try:
        numeric, tangent = jax.vmap(one, out_axes=(None, 0), axis_size=k)(tuple(tangents))
    except Cancelled:
        raise
    except Exception:  # not vmappable: direction by direction (a node's own error raises there)
        per = [rule(args, jax.tree.map(lambda a: a[j], tuple(tangents)), active) for j in range(k)]
        return per[0][0], tuple(jnp.stack(leaves) for leaves in zip(*(t for _, t in per)))
    return box["combine"](numeric, box["static"]), tangent


def why_no_jvp(closed, active: Sequence[bool]) -> str | None:
    """Why ``jax.jvp`` cannot go through a node's jaxpr (traced on shapes); None when it can."""
    diff, held, fn = of_jaxpr(closed, active)
    if not diff:
        return None
    try:
        pushed = jax.make_jaxpr(lambda held, diff: jax.jvp(partial(fn, held), diff, diff))(
            held, diff)
    except Exception as e:  # e.g. a pure_callback outside any custom rule
        return f"has no forward-mode rule: jax.jvp fails through it ({in_brief(e)})"
    if _holds(pushed.jaxpr, NO_JVP):
        return ("calls a jax.custom_vjp function, which has no forward-mode rule (jax.jvp "
                "cannot go through it)")
    return None


def _holds(jaxpr, primitive: str) -> bool:
    """Some equation of ``jaxpr``, or of a jaxpr inside it, applies ``primitive``."""
    return any(eqn.primitive.name == primitive or
               any(_holds(sub, primitive) for sub in jcore.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)
