"""Rematerialization (``Node(..., remat=True)``, ``daskdag.remat``): a node's forward task keeps
no residuals; its backward task runs the node's forward pass again, under the node's own rule
(:func:`daskdag.rules.registry.linearizer`), and pulls the cotangents back at once, as
:func:`jax.checkpoint` does. The backward task holds the node's inputs anyway, so a
:class:`RematPullback` holds only the node and its active deps: Dask counts it as nothing.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

from daskdag.model.spec import Node
from daskdag.rules.pullback import Pullback
from daskdag.rules.registry import linearizer


def rule(node: Node) -> Callable:
    """``f(args, active) -> (primal, pullback)`` for ``node`` as a forward task runs it: its own
    rule (:func:`~daskdag.rules.registry.linearizer`), or for a ``remat`` node :func:`forward`,
    which keeps no residuals."""
    return partial(forward, node) if node.remat else linearizer(node)


def forward(node: Node, inputs: Sequence[Any], active: tuple[bool, ...]):
    """``(primal, RematPullback)``: the node's value, computed as it is when nothing is
    differentiated (no vjp, so no residuals even for a moment), and its pullback."""
    return node.callable()(*inputs), RematPullback(node, tuple(active))


class RematPullback(Pullback):
    """The backward half of a ``remat`` node: its node and ``active``, no residuals.
    :meth:`materialize` redoes the forward pass on the backward task's inputs and returns the
    node's ordinary pullback, used for all the task's cotangents; calling it does both."""

    batching = None  # (not until materialized: then its node's pullback's)
    traceable = False

    def __init__(self, node: Node, active: tuple[bool, ...]):
        self.node, self.active = node, active

    def materialize(self, inputs: Sequence[Any]) -> Pullback:
        return linearizer(self.node)(list(inputs), self.active)[1]

    def __call__(self, ct: tuple, inputs: Sequence[Any], dropped=None) -> tuple:
        return self.materialize(inputs)(ct, inputs, dropped)

    def residual_nbytes(self) -> int:
        return 0  # (its node's function is the graph's, whatever it closes over)

    def __reduce__(self):
        return RematPullback, (self.node, self.active)
