"""The pullback protocol: what every backward half of a forward pass offers, whoever made it
(JAX's vjp, the user's rule, a stage's nodes together, a sweep's chunk), so that Dask sizes and
moves every one the same way, registered once (:func:`daskdag.transport.protocol.travels`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np

from daskdag.transport.protocol import travels


@dataclass(frozen=True)
class Batching:
    """When pulling several cotangents back at once, stacked under ``jax.vmap``, pays for a
    pullback: from ``least`` cotangents, each of at most ``most_elements`` elements."""

    least: int
    most_elements: int | None = None

    def worth(self, cts: list) -> bool:
        """``cts``: per output, a cotangent per exposed value (flat tuples, or None)."""
        if len(cts) < self.least:
            return False
        return self.most_elements is None or max(
            sum(int(np.size(leaf)) for c in per_output if c is not None for leaf in c)
            for per_output in cts) <= self.most_elements


# A compiled program's batched trace is cached, so batching gains from 2 cotangents on. vmap of
# an eager pullback traces it anew each call: it pays only for many small cotangents.
COMPILED = Batching(2)
EAGER = Batching(8, 2 ** 15)


@travels(lambda pb: pb.residual_nbytes())
class Pullback(abc.ABC):
    """The backward half of a forward pass at one point.

    Call: ``pullback(ct, inputs, dropped=None)``. ``ct``: the cotangent of what the forward
    pass returned, as flat tuples of leaves (a stage's pullback takes one per exposed node,
    ``None`` where none flows); ``inputs``: the forward pass's inputs, which the backward task
    holds anyway; ``dropped()``, asked between two nodes, stops it. Returns one cotangent per
    input, ``None`` for those held constant. Dask counts it as :meth:`residual_nbytes`.
    """

    #: When several cotangents are best pulled back at once: :data:`COMPILED` (a program
    #: ``jax.vmap`` batches once), :data:`EAGER` (JAX's vjp of plain code, traced anew each
    #: call), None: never (the user's code, or the vjp of a jitted function, which ``vmap``
    #: recompiles on every call).
    batching: Batching | None = None
    #: JAX can trace it (``jax.vmap`` over a Jacobian's rows); the user's own NumPy code cannot.
    traceable: bool = True

    @abc.abstractmethod
    def __call__(self, ct: Any, inputs: Sequence[Any], dropped: Callable[[], bool] | None = None
                 ) -> tuple:
        ...

    def rows(self, cts: Any, inputs: Sequence[Any], dropped: Callable[[], bool] | None = None
             ) -> tuple:
        """The pullback of each row of ``cts`` (each leaf stacked over rows, a Jacobian's):
        under ``jax.vmap`` (a pullback that cannot be vmapped raises, and is pulled back row by
        row instead); a compiled program's, by a program of its own, compiled once."""
        return jax.vmap(lambda ct: self(ct, inputs, dropped))(cts)

    def materialize(self, inputs: Sequence[Any]) -> "Pullback":
        """The pullback a backward task calls, once per cotangent, on these ``inputs``: itself;
        a pullback that keeps no residuals (``remat``, :mod:`daskdag.rules.remat`) recomputes
        them here, once for the task, and they go when the task ends."""
        return self

    @abc.abstractmethod
    def residual_nbytes(self) -> int:
        """Bytes that moving it ships: its residuals, less what the backward task holds."""
