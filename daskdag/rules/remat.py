"""Rematerialization (``Node(..., remat=True)``): a node's forward task keeps no residuals; its
backward task runs the forward pass again under the node's rule and pulls the cotangents back
at once, as :func:`jax.checkpoint` does."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from daskdag.model.spec import Node
from daskdag.rules.pullback import Pullback
from daskdag.rules.registry import linearizer


def rule(node: Node) -> Callable:
    """``f(args, active) -> (primal, pullback)`` for ``node`` as a forward task runs it: its
    linearizer, or for a ``remat`` node :func:`forward`."""
    return partial(forward, node) if node.remat else linearizer(node)


def forward(node: Node, inputs: Sequence[Any], active: tuple[bool, ...]):
    """``(primal, RematPullback)``: the node's value computed undifferentiated (no residuals
    even for a moment), and its pullback."""
    return node.callable()(*inputs), RematPullback(node, tuple(active))


class RematPullback(Pullback):
    """The backward half of a ``remat`` node: no residuals (the backward task holds the inputs).
    :meth:`materialize` redoes the forward pass and returns the node's ordinary pullback."""

    batching = None  # (until materialized)
    traceable = False

    def __init__(self, node: Node, active: tuple[bool, ...]):
        self.node, self.active = node, active

    def materialize(self, inputs: Sequence[Any]) -> Pullback:
        return linearizer(self.node)(list(inputs), self.active)[1]

    def __call__(self, ct: tuple, inputs: Sequence[Any], dropped=None) -> tuple:
        return self.materialize(inputs)(ct, inputs, dropped)

    def residual_nbytes(self) -> int:
        return 0

    def __reduce__(self):
        return RematPullback, (self.node, self.active)
