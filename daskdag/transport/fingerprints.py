"""A function's fingerprint: what its behaviour depends on, as packing sees it
(:mod:`daskdag.transport.packing`), read again and compared far faster than pickling it again.

It is the walk of :mod:`daskdag.transport.walk` (its rules: what is reached, and how), recorded
as facts: values (numbers, strings, NumPy arrays' content) and identities (JAX arrays, code,
modules, installed code, each kept referenced so that its id cannot be reused while the
fingerprint lives). Two fingerprints of one function are equal when nothing that packing would
see has changed. An object the walk cannot read (a lock, a generator) makes the function
*unwatchable*: :func:`fingerprint` returns ``None`` and callers must not reuse anything derived
from the function's content.
"""

from __future__ import annotations

from typing import Any, Callable

from daskdag.transport.walk import (CHECK_GLOBALS, DYNAMIC_ATTRIBUTES, Unwatchable, Walk,
                                    attributes, names)
from daskdag.transport.weak import Weak

__all__ = ["DYNAMIC_ATTRIBUTES", "Fingerprint", "attributes", "fingerprint", "names"]


class Fingerprint:
    """What a function's behaviour depends on, at one moment. ``facts`` are compared; ``refs``
    keep alive every object whose identity is a fact."""

    __slots__ = ("facts", "refs", "_check")

    def __init__(self, facts: list, refs: list, check: Callable[[Any], bool] | None = None):
        self.facts, self.refs, self._check = facts, refs, check

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fingerprint) and self.facts == other.facts

    def holds(self, obj: Any) -> bool:
        """Whether ``obj`` (the function this was taken of) would have this fingerprint now: by
        the check compiled when it was taken, else by taking a new one."""
        root = obj.target if isinstance(obj, Weak) else obj
        if self._check is not None:
            try:
                return self._check(root)
            except Exception:  # (what changed broke a read: a different shape of object)
                return False
        return fingerprint(obj) == self

    __hash__ = None  # type: ignore[assignment]  # (equal by content; never a key)


def fingerprint(obj: Any, checked: bool = False) -> Fingerprint | None:
    """``obj``'s fingerprint now, or ``None`` when some object it holds cannot be read. It
    keeps alive what it holds by identity, but not ``obj`` itself: its holder knows it.
    ``checked``: compile the check :meth:`Fingerprint.holds` runs (worth it only for a
    fingerprint checked many times)."""
    walk = _Fingerprinting(obj.target if isinstance(obj, Weak) else obj, checked)
    try:
        walk.walk()
    except (Unwatchable, RecursionError):
        return None
    return Fingerprint(walk.facts, walk.refs, walk.compiled())


class _Fingerprinting(Walk):
    """The walk, recording what it does not go into by identity; with ``checked``, it compiles
    what it wrote of how it reached each object into a check of the same facts: each object
    read again from the root, and compared with what the walk found."""

    LIMIT = 200_000  # facts; beyond it, the function is unwatchable
    __slots__ = ("refs",)

    def __init__(self, root, checked: bool = False):
        super().__init__(root, checked)
        self.refs: list = []  # what facts name by identity: kept with them

    def leaf(self, obj, at: str) -> None:
        if obj is self.root:
            self.facts.append("root")
            self.test(f"{at} is root")
            return
        self.facts.append(id(obj))
        held = id(obj) not in self.weakly  # (one held weakly goes with what holds it)
        if held:
            self.refs.append(obj)
        if self.lines is not None:
            self.test(f"{at} is {self.const(obj)}" if held else f"id({at}) == {id(obj)}")

    opened = leaf

    def compiled(self) -> Callable[[Any], bool] | None:
        if self.lines is None:
            return None
        source = "def check(root):\n" + "".join(f"    {line}\n" for line in self.lines) + \
            "    return True\n"
        namespace = {"K": self.consts, "__name__": __name__, **CHECK_GLOBALS}
        exec(compile(source, "<daskdag fingerprint check>", "exec"), namespace)
        check: Callable[[Any], bool] = namespace["check"]  # type: ignore[assignment]
        return check
