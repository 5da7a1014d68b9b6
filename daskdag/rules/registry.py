"""One registry of differentiation rules by the type of a node's function: how such a node runs
under vjp and jvp (the user's own rules, a sweep's chunk of items). A type not registered is JAX
code, run by :mod:`daskdag.rules.vjp` and :mod:`daskdag.rules.jvp`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from daskdag.model.spec import Node
from daskdag.rules import jvp as jax_jvp, vjp as jax_vjp
from daskdag.transport.packing import unwrap
from daskdag.transport.weak import held


@dataclass(frozen=True)
class Rules:
    """How nodes of one kind are differentiated. ``linearize(fn, node, args, active) ->
    (primal, pullback)``; ``push(fn, node, args, tangents, active) -> (primal, tangent)``;
    ``fn``: the node's function unpacked; ``active``: per dep, whether it is differentiated."""

    linearize: Callable | None = None
    push: Callable | None = None
    #: For a function that maps one element's node over a batch (a sweep's chunk):
    #: ``element(fn) -> (node, in_axes)``, per dep its batch axis (0) or None;
    #: ``batch(fn, in_axes, vectorized)``, a function of one element made to run over the batch
    #: the same way (``vectorized``: under ``jax.vmap``, else element by element).
    element: Callable | None = None
    batch: Callable | None = None


RULES: dict[type, Rules] = {}


def register(kind: type, **rules: Callable) -> None:
    """The rules (:class:`Rules`' fields) for functions of type ``kind`` and its subclasses."""
    RULES[kind] = Rules(**rules)


def function_of(node: Node):
    """``node``'s function itself: unpacked, and not as a preparation holds it (weakly)."""
    return held(unwrap(node.fn))


def rules_of(node: Node) -> Rules | None:
    """The rules registered for the kind of ``node``'s function, else None (JAX code)."""
    for kind in type(function_of(node)).__mro__:
        if kind in RULES:
            return RULES[kind]
    return None


def linearizer(node: Node) -> Callable:
    """``f(args, active) -> (primal, pullback)`` for ``node``."""
    rules = rules_of(node)
    if rules is None or rules.linearize is None:
        return partial(jax_vjp.linearize, node)
    return partial(rules.linearize, function_of(node), node)


def jvp_rule(node: Node) -> Callable:
    """``f(args, tangents, active) -> (primal, tangent)`` for ``node``."""
    rules = rules_of(node)
    if rules is None or rules.push is None:
        return partial(jax_jvp.jvp, node)
    return partial(rules.push, function_of(node), node)


def has_rules(node: Node) -> bool:
    """Its function is of a registered kind (not plain JAX code)."""
    return rules_of(node) is not None


def element_of(node: Node) -> tuple[Node, tuple | None]:
    """``(the node one element runs, per dep its batch axis)`` for a node that maps one over a
    batch (:attr:`Rules.element`); else ``(node, None)``."""
    rules = rules_of(node)
    if rules is None or rules.element is None:
        return node, None
    return rules.element(function_of(node))
