"""glibc's malloc thresholds as JAX's work needs them, in a process whose environment held them
back: while one of daskdag's tasks runs there (:func:`tuned`), or for the process's whole life
(:func:`tune_for_good`, the ``daskdag-tune-malloc`` worker plugin of ``daskdag.tune-workers``).

distributed's nanny starts each worker with ``MALLOC_TRIM_THRESHOLD_=65536``, which also turns
off glibc's adaptive mmap threshold for good: every temporary above 128 KiB is mmapped, and its
pages faulted in afresh each time, so eager JAX nodes over arrays of a few hundred KB run much
slower in such a worker than in a plain process (``benchmarks/tools/worker_malloc.py``). Tuned,
the mmap threshold is the adaptive rule's limit on 64-bit glibc (``DEFAULT_MMAP_THRESHOLD_MAX``,
32 MiB) and the trim threshold twice that, so large temporaries come from the heap and are
reused, as in a plain process. :func:`tuned` sets them back to what the environment made them
once no daskdag task has run for :data:`GRACE` seconds (between a sweep's chunks, and while the
values between its tasks travel, they stay tuned), so other work on the worker keeps its own,
except alongside daskdag's.

Nothing changes in a process without ``MALLOC_TRIM_THRESHOLD_`` (glibc's adaptive rule is in
effect), with ``MALLOC_MMAP_THRESHOLD_`` (the environment chose; :func:`tune_for_good` sets it
to what it applied, so that the environment says what malloc does, to this process and those it
starts), or on another libc.

Standard library only, and it travels by value with the worker plugin, which must unpickle in a
worker whose daskdag lacks this module; its state is in the environment for that reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
from typing import Callable

import cloudpickle

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2 ** 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the adaptive rule's limit
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # the adaptive rule keeps trim at twice the mmap threshold
FIXED_MMAP_THRESHOLD = 128 * 1024  # DEFAULT_MMAP_THRESHOLD_MIN: glibc's, once trim is set
OPTIONS = {"M_MMAP_THRESHOLD": M_MMAP_THRESHOLD, "M_TRIM_THRESHOLD": M_TRIM_THRESHOLD}

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def thresholds() -> tuple[dict[str, int] | None, dict[str, int] | None, str]:
    """``(the thresholds JAX's work needs, the environment's, why)``: ``(None, None, why)``
    where this process's malloc is left as it is."""
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        libc = None
    if not libc or not libc.startswith("glibc"):
        return None, None, "not glibc"
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        return None, None, "MALLOC_TRIM_THRESHOLD_ unset: glibc's adaptive threshold is in effect"
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None, None, "MALLOC_MMAP_THRESHOLD_ set: left as the environment chose"
    own = _int(os.environ["MALLOC_TRIM_THRESHOLD_"])
    # Only raise the trim threshold: a larger one in the environment was chosen on purpose.
    return ({"M_MMAP_THRESHOLD": MMAP_THRESHOLD, "M_TRIM_THRESHOLD": max(TRIM_THRESHOLD, own)},
            {"M_MMAP_THRESHOLD": FIXED_MMAP_THRESHOLD, "M_TRIM_THRESHOLD": own}, "set")


def _int(text: str) -> int:
    try:
        return max(0, min(int(text), 2 ** 31 - 1))  # mallopt takes a C int
    except ValueError:
        return 0


def mallopt() -> Callable[[int, int], int]:
    """glibc's ``mallopt``."""
    found = ctypes.CDLL(None).mallopt
    found.argtypes, found.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return found


def apply(values: dict[str, int], setter: Callable[[int, int], int]) -> str | None:
    """``values`` set with ``setter`` (:func:`mallopt`): what failed, else None."""
    for name, value in values.items():
        if setter(OPTIONS[name], value) != 1:
            return f"mallopt({name}, {value}) failed"
    return None


def tune_for_good() -> tuple[dict[str, int] | None, str]:
    """Tune this process's malloc for the rest of its life: ``(thresholds set, or None, and
    why)``. Never raises: an untuned process only runs slower. (It holds no lock: it travels
    by value, and runs once, as its worker starts.)"""
    try:
        tuned, _, reason = thresholds()
        if tuned is None:
            return None, reason
        failed = apply(tuned, mallopt())
        if failed:
            return None, failed
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(tuned["M_MMAP_THRESHOLD"])
        return tuned, "set"
    except Exception as e:  # e.g. a libc without mallopt
        return None, f"failed: {type(e).__name__}: {e}"


#: Seconds without a daskdag task after which :func:`tuned` sets the environment's thresholds
#: back: a sweep's next chunk, and the values that travel between its tasks, come within it.
GRACE = 2.0

_lock = threading.Lock()
# the tasks in tuned() now; the environment's thresholds to set back (None: nothing to set
# back); glibc's mallopt; when the last task ended; the timer that sets them back
_state: dict = {"running": 0, "own": None, "mallopt": None, "idle_since": 0.0, "timer": None}


_NOTHING = contextlib.nullcontext()
# Whether this process's environment set MALLOC_TRIM_THRESHOLD_, as glibc read it at its start.
_HELD_BACK = "MALLOC_TRIM_THRESHOLD_" in os.environ


def tuned():
    """A context manager: its block runs with malloc tuned (the module's docstring); the
    environment's thresholds are back once no task has been in such a block for :data:`GRACE`
    seconds. A failing ``mallopt`` leaves them as they are."""
    return _tuned() if _HELD_BACK else _NOTHING


@contextlib.contextmanager
def _tuned():
    with _lock:
        _state["running"] += 1
        if _state["running"] == 1 and _state["own"] is None:
            try:
                wanted, own, _ = thresholds()
                if wanted is not None and _state["mallopt"] is None:
                    _state["mallopt"] = mallopt()
                _state["own"] = own if wanted is not None and apply(
                    wanted, _state["mallopt"]) is None else None
            except Exception:
                _state["own"] = None
    try:
        yield
    finally:
        with _lock:
            _state["running"] -= 1
            if _state["running"] == 0 and _state["own"] is not None:
                _state["idle_since"] = time.monotonic()
                if _state["timer"] is None:
                    _later(GRACE)


def _later(seconds: float) -> None:
    timer = threading.Timer(seconds, _set_back)
    timer.daemon = True
    _state["timer"] = timer
    timer.start()


def _set_back() -> None:
    """The environment's thresholds again, once no task has run for :data:`GRACE` seconds."""
    with _lock:
        _state["timer"] = None
        if _state["running"] or _state["own"] is None:
            return  # (a task runs: the last one to end waits again)
        if "MALLOC_MMAP_THRESHOLD_" in os.environ:  # tuned for good since (tune_for_good)
            _state["own"] = None
            return
        left = _state["idle_since"] + GRACE - time.monotonic()
        if left > 0:
            _later(left)
            return
        try:
            apply(_state["own"], _state["mallopt"])
        except Exception:  # (as when tuning: the worker only runs slower)
            pass
        _state["own"] = None
