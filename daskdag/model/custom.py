"""A node outside JAX, as the user gives it: its function and its own derivative rules
(``Node(fn, deps, vjp=...)``, ``Node(fwd=..., bwd=..., deps=...)``, ``jvp=...``). How they are
run and checked is :mod:`daskdag.rules.custom`'s."""

from __future__ import annotations

from typing import Callable

from daskdag.model.leaves import as_numpy
from daskdag.transport.packing import unwrap


class Custom:
    """The user's functions of one node: ``fn`` (or ``fwd``), and its derivative rules. Called,
    it returns the node's value; :mod:`daskdag.rules.custom` differentiates it."""

    def __init__(self, fn: Callable | None = None, vjp: Callable | None = None,
                 fwd: Callable | None = None, bwd: Callable | None = None,
                 jvp: Callable | None = None):
        self.fn, self.vjp, self.fwd, self.bwd, self.jvp = fn, vjp, fwd, bwd, jvp

    @property
    def reverse(self) -> bool:
        """It has a VJP: it can be differentiated in reverse mode."""
        return self.vjp is not None or self.bwd is not None

    def __call__(self, *args):
        args = as_numpy(args)
        return self.fn(*args) if self.fn is not None else self.fwd(*args)[0]  # type: ignore[misc]

    def __reduce__(self):
        return Custom, (self.fn, self.vjp, self.fwd, self.bwd, self.jvp)


def is_custom(fn) -> bool:
    """``fn`` (maybe packed) is a :class:`Custom` function."""
    return isinstance(unwrap(fn), Custom)
