"""The pullback protocol: what every backward half of a forward pass offers, whoever made it,
so that Dask sizes and moves each the same way."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from daskdag.transport.protocol import travels


@dataclass(frozen=True)
class Batching:
    """When pulling several cotangents back at once under ``jax.vmap`` pays: from ``least``
    cotangents, each of at most ``most_elements`` elements."""

    least: int
    most_elements: int | None = None

    def worth(self, cts: list) -> bool:
        """``cts``: per output, a cotangent per exposed value (flat tuples, or None)."""
        if len(cts) < self.least:
            return False
        return self.most_elements is None or max(
            sum(int(np.size(leaf)) for c in per_output if c is not None for leaf in c)
            for per_output in cts) <= self.most_elements


# A compiled program's batched trace is cached; vmap of an eager pullback traces it anew.
COMPILED = Batching(2)
EAGER = Batching(8, 2 ** 15)


@travels(lambda pb: pb.residual_nbytes())
class Pullback(abc.ABC):
    """The backward half of a forward pass at one point.

    Call: ``pullback(ct, inputs, dropped=None)``. ``ct``: the cotangent of what the forward
    pass returned, flat tuples of leaves (a stage's: one per exposed node, ``None`` where none
    flows); ``inputs``: the forward pass's, which the backward task holds anyway;
    ``dropped()``, asked between two nodes, stops it. Returns one cotangent per input, ``None``
    for those held constant.
    """

    #: When several cotangents are best pulled back at once; None: never (the user's code, or
    #: the vjp of a jitted function, which ``vmap`` recompiles on every call).
    batching: Batching | None = None
    #: JAX can trace it (``jax.vmap`` over a Jacobian's rows).
    traceable: bool = True

    @abc.abstractmethod
    def __call__(self, ct: Any, inputs: Sequence[Any], dropped: Callable[[], bool] | None = None
                 ) -> tuple:
        ...

    def rows(self, cts: Any, inputs: Sequence[Any], dropped: Callable[[], bool] | None = None
             ) -> tuple:
        """The pullback of each row of ``cts`` (each leaf stacked over a Jacobian's rows), under
        ``jax.vmap``; one that cannot be vmapped raises, and is pulled back row by row."""
        return jax.vmap(lambda ct: self(ct, inputs, dropped))(cts)

    def materialize(self, inputs: Sequence[Any]) -> Pullback:
        """The pullback a backward task calls on these ``inputs``: itself, or for one that keeps
        no residuals (``remat``), one that recomputed them, once for the task."""
        return self

    @abc.abstractmethod
    def residual_nbytes(self) -> int:
        """Bytes that moving it ships: its residuals, less what the backward task holds."""
