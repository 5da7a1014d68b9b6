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

import itertools
import re
from typing import Any, Callable, Sequence

from daskdag.transport.walk import CHECK_GLOBALS, Unwatchable, Walk
from daskdag.transport.weak import Weak, held


class Fingerprint:
    """What a function's behaviour depends on, at one moment. ``facts`` are compared; ``refs``
    keep alive every object whose identity is a fact."""

    __slots__ = ("facts", "refs", "_check", "_source")

    def __init__(self, facts: list, refs: list, source: tuple[str, list[str], dict] | None):
        self.facts, self.refs = facts, refs
        self._source = source  # (its check's prefix, lines and constants by name)
        self._check: Callable[[Any], bool] | None = None  # (compiled at its first use)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fingerprint) and self.facts == other.facts

    def holds(self, obj: Any) -> bool:
        """Whether ``obj`` (the function this was taken of) would have this fingerprint now: by
        the check written when it was taken (compiled at its first use), else by taking a new
        one."""
        root = obj.target if isinstance(obj, Weak) else obj
        if self._check is None and self._source is not None:
            prefix, lines, consts = self._source
            self._check = _compiled(f"def check({prefix}root):\n", lines, consts)
        if self._check is not None:
            return self._check(root)
        return fingerprint(obj) == self

    __hash__ = None  # type: ignore[assignment]  # (equal by content; never a key)


def fingerprint(obj: Any, checked: bool = False) -> Fingerprint | None:
    """``obj``'s fingerprint now, or ``None`` when some object it holds cannot be read. It
    keeps alive what it holds by identity, but not ``obj`` itself: its holder knows it.
    ``checked``: write the check :meth:`Fingerprint.holds` runs (worth it only for a
    fingerprint checked many times)."""
    walk = _Fingerprinting(held(obj), checked, f"f{next(_checks)}_" if checked else "")
    try:
        walk.walk()
    except (Unwatchable, RecursionError):
        return None
    return Fingerprint(walk.facts, walk.refs,
                       None if walk.lines is None else (walk.prefix, walk.lines, walk.consts))


_checks = itertools.count()  # (each compiled check's names their own: :func:`holding`)
_ASSIGNED = re.compile(r"(\w+) = ")
_NAME = re.compile(r"[A-Za-z_]\w*")


def holding(watched: Sequence[tuple[Fingerprint, Any]], first: Sequence[str] = (),
            first_names: dict | None = None) -> Callable[[], bool]:
    """One check that each fingerprint of ``watched`` holds of its function (as
    :meth:`Fingerprint.holds`), compiled into one function where they have compiled checks,
    after the caller's own checks ``first``: lines that ``return False`` where theirs fails,
    which read ``first_names`` (each name starting ``d_``)."""
    lines, names = list(first), dict(first_names or {})
    for k, (print_, fn) in enumerate(watched):
        names[f"F{k}"], names[f"P{k}"] = fn, print_
        if print_._source is None:
            lines.append(f"if not P{k}.holds(F{k}): return False")
            continue
        prefix, own, consts = print_._source
        names.update(consts)
        lines.append(f"{prefix}root = F{k}._ref()" if isinstance(fn, Weak) else
                     f"{prefix}root = F{k}")
        lines.extend(own)
    return _compiled("def check():\n", lines, names)


def _compiled(head: str, lines: list[str], names: dict) -> Callable[..., bool]:
    """The check of ``lines`` (each ``return False`` where it fails), less the variables that
    no later line reads; False, not an error, where a line fails to read (what changed is a
    different shape of object)."""
    kept, read = [], set()
    for line in reversed(lines):
        assigned = _ASSIGNED.match(line)
        if assigned is None or assigned[1] in read:
            kept.append(line)
            read.update(_NAME.findall(line))
    body = ["try:", *(f"    {line}" for line in reversed(kept)), "    return True",
            "except Exception:", "    return False"]
    source = head + "".join(f"    {line}\n" for line in body)
    namespace = {"__name__": __name__, **CHECK_GLOBALS, **names}
    exec(compile(source, "<daskdag fingerprint check>", "exec"), namespace)
    return namespace["check"]


class _Fingerprinting(Walk):
    """The walk, recording what it does not go into by identity; with ``checked``, it compiles
    what it wrote of how it reached each object into a check of the same facts: each object
    read again from the root, and compared with what the walk found."""

    LIMIT = 200_000  # facts; beyond it, the function is unwatchable
    __slots__ = ("refs",)

    def __init__(self, root, checked: bool = False, prefix: str = ""):
        super().__init__(root, checked, prefix)
        self.refs: list = []  # what facts name by identity: kept with them

    def leaf(self, obj, at: str) -> None:
        if obj is self.root:
            self.facts.append("root")
            if at != f"{self.prefix}root":
                self.test(f"{at} is {self.prefix}root")
            return
        self.facts.append(id(obj))
        held = id(obj) not in self.weakly  # (one held weakly goes with what holds it)
        if held:
            self.refs.append(obj)
        if self.lines is not None:
            self.test(f"{at} is {self.const(obj)}" if held else f"id({at}) == {id(obj)}")

    opened = leaf
