"""A node's forward pass under ``jax.vjp``, and the :class:`Pullback` it leaves behind."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax


class Pullback:
    """The backward half of one node's ``jax.vjp`` at one point; holds the residuals.

    In:  the cotangent of the node's output (a pytree shaped like the output).
    Out: a tuple aligned with the node's deps: each differentiated dep's cotangent, ``None`` for
         the deps that were held constant.
    """

    __slots__ = ("vjp_fn", "active")

    def __init__(self, vjp_fn: Callable, active: tuple[bool, ...]):
        self.vjp_fn, self.active = vjp_fn, active

    def __call__(self, ct):
        cts = iter(self.vjp_fn(ct))
        return tuple(next(cts) if on else None for on in self.active)


def linearize(fn: Callable, args: Sequence[Any], active: tuple[bool, ...]):
    """Run ``fn(*args)`` once under ``jax.vjp``, differentiating only the ``active`` args.

    Returns ``(primal, Pullback)``. Inactive args (integer indices, constants) are closed over,
    so they get no ``float0`` cotangents and cost no backward work.
    """

    def fn_of_active(*diff):
        it = iter(diff)
        return fn(*(next(it) if on else a for a, on in zip(args, active)))

    primal, vjp_fn = jax.vjp(fn_of_active, *(a for a, on in zip(args, active) if on))
    return primal, Pullback(vjp_fn, active)
