"""A node outside JAX as the user gives it: its function and its own derivative rules, which
:mod:`daskdag.rules.custom` runs and checks."""

from __future__ import annotations

from collections.abc import Callable

from daskdag.model.leaves import as_numpy
from daskdag.transport.packing import unwrap


class Custom:
    """One node's functions: ``fn`` (or ``fwd``) and its rules ``vjp``, ``bwd``, ``jvp``, as
    :class:`~daskdag.Node` documents them. Called, it returns the node's value."""

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
