"""How what daskdag keeps between calls holds the user's functions: weakly, so that a compiled
call (:mod:`daskdag.running.programs`) goes when the user lets its functions go. Its nodes hold
each as a :class:`Weak`, which calls it, pickles as it, and tells whoever asked when it goes.
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable


class Weak:
    """A user's function held weakly where it can be (a builtin is held as it is: it lives as
    long as its module anyway). Called, it calls the function."""

    __slots__ = ("_ref", "_gone", "__weakref__")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._gone: list[Callable[[], None]] = []
        self._ref = ref(fn, self._died)

    @property
    def target(self) -> Any:
        """The function itself (None once it is gone)."""
        return self._ref()

    def on_gone(self, call: Callable[[], None]) -> None:
        """Call ``call()`` when the function goes."""
        self._gone.append(call)

    def _died(self, _: Any) -> None:
        for call in self._gone:
            call()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._ref()
        if fn is None:  # (its preparation goes with it: no call reaches here)
            raise ReferenceError("a node's function is gone")
        return fn(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # (its name, its docstring... for messages)
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(self._ref(), name)

    def __reduce__(self) -> tuple:
        return _itself, (self._ref(),)

    def __repr__(self) -> str:
        return f"Weak({self._ref()!r})"


def ref(obj: Any, gone: Callable[[Any], None] | None = None) -> Callable[[], Any]:
    """A weak reference to ``obj`` (``gone`` called with it when ``obj`` goes), or where ``obj``
    takes none (a builtin), a call that returns it."""
    try:
        return weakref.ref(obj, gone)
    except TypeError:
        return partial(_itself, obj)


def held(fn: Any) -> Any:
    """The function a :class:`Weak` holds, or ``fn`` itself."""
    return fn.target if isinstance(fn, Weak) else fn


def _itself(obj: Any) -> Any:
    return obj
