"""Worker set-up, as worker plugins that travel by value: daskdag's serializers in every worker
(:class:`Serializers`), and glibc's malloc tuned back for JAX work in workers started by a
nanny (:class:`TuneMalloc`, opt-in).

A worker that has run none of daskdag's tasks must still take in a JAX array another worker
sends as zero-copy frames: :class:`Serializers` registers daskdag's serializers in every worker,
those that join later too; in a worker without daskdag it does nothing, so that it still starts.

distributed's nanny starts each worker with ``MALLOC_TRIM_THRESHOLD_=65536``, which also turns
off glibc's adaptive mmap threshold for good: every temporary above 128 KiB is mmapped and its
pages faulted in afresh each time, so eager JAX nodes over arrays of a few hundred KB run much
slower in a worker than in a plain process. :class:`TuneMalloc` sets, with ``mallopt``, the
thresholds the adaptive rule reaches at most on 64-bit glibc: mmap 32 MiB
(``DEFAULT_MMAP_THRESHOLD_MAX``) and trim twice that, so large temporaries come from the heap
and are reused, as in a plain process (``benchmarks/tools/worker_malloc.py`` measures it).

It is registered (:func:`daskdag.running.cluster.check`) only where ``daskdag.tune-workers`` is
true: it changes the malloc of every worker of the user's cluster, so the user opts in. The
other route is the workers' environment, ``distributed.nanny.pre-spawn-environ``
(docs/guides/clusters.md, "Worker malloc").
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys

import cloudpickle

NAME = "daskdag-tune-malloc"
SERIALIZERS = "daskdag-serializers"

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2 ** 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the adaptive rule's limit
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # the adaptive rule keeps trim at twice the mmap threshold

# The plugins travel by value, needing only the standard library and distributed on the worker:
# a worker joining later with another daskdag, or none, must still unpickle them and start (the
# version check then names it). So this module holds nothing else.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def __getattr__(name: str):
    # Each plugin class is made when first asked for (a cluster call registers it): its base
    # class is distributed's, whose import a call on threads never pays.
    if name not in _made:
        make = {"TuneMalloc": _tune_malloc_class, "Serializers": _serializers_class}.get(name)
        if make is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        _made[name] = make()
    return _made[name]


_made: dict[str, type] = {}


def _tune_malloc_class() -> type:
    from distributed import WorkerPlugin

    class TuneMalloc(WorkerPlugin):
        """Raise glibc's mmap and trim thresholds in a worker whose environment set
        ``MALLOC_TRIM_THRESHOLD_`` (as distributed's nanny does). After ``setup``, ``applied``
        is ``{"M_MMAP_THRESHOLD": bytes, "M_TRIM_THRESHOLD": bytes}`` or ``None``, and
        ``reason`` says why. It never raises: an untuned worker only runs slower."""

        idempotent = True  # the scheduler keeps the first registration; later clients add nothing
        name = NAME

        def __init__(self):
            self.applied: dict[str, int] | None = None
            self.reason = "not set up"

        def setup(self, worker=None):
            try:
                self.applied, self.reason = _tune()
            except Exception as e:  # e.g. a libc without mallopt
                self.applied, self.reason = None, f"failed: {type(e).__name__}: {e}"

    TuneMalloc.__qualname__ = "TuneMalloc"
    return TuneMalloc


def _serializers_class() -> type:
    from distributed import WorkerPlugin

    class Serializers(WorkerPlugin):
        """Register daskdag's serializers in the worker, if it has daskdag; after ``setup``,
        ``registered`` says whether it did."""

        idempotent = True
        name = SERIALIZERS

        def __init__(self):
            self.registered = False

        def setup(self, worker=None):
            try:  # (by name: this travels by value, to workers with or without daskdag)
                importlib.import_module("daskdag.transport.protocol").with_distributed()
            except ImportError:  # nothing of daskdag's can run in this worker
                return
            self.registered = True

    Serializers.__qualname__ = "Serializers"
    return Serializers


def _tune() -> tuple[dict[str, int] | None, str]:
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        libc = None
    if not libc or not libc.startswith("glibc"):
        return None, "not glibc"
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        return None, "MALLOC_TRIM_THRESHOLD_ unset: glibc's adaptive threshold is in effect"
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None, "MALLOC_MMAP_THRESHOLD_ set: left as the environment chose"
    # Only raise the trim threshold: a larger one in the environment was chosen on purpose.
    trim = max(TRIM_THRESHOLD, _int(os.environ["MALLOC_TRIM_THRESHOLD_"]))
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied: dict[str, int] = {}
    for name, option, value in (("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                                ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, trim)):
        if mallopt(option, value) != 1:
            return applied or None, f"mallopt({name}, {value}) failed"
        applied[name] = value
    return applied, "set"


def _int(text: str) -> int:
    try:
        return min(int(text), 2 ** 31 - 1)  # mallopt takes a C int
    except ValueError:
        return 0
