"""Backward programs that can leave their process: exported once, compiled once per process.

A pullback at a concrete point is a linear JAX function of its cotangent whose closed-over arrays
are the residuals. ``export`` turns its jaxpr into portable bytes (``jax.export``), the residuals
becoming explicit arguments; ``load`` compiles such bytes once per process and content key, so a
sweep over same-shaped items compiles each backward program once per worker.

A program is exported for every platform at once (:func:`platforms`), so that it runs wherever it
lands (a store read on another machine, a worker of another kind): one module whose few
platform-specific operations branch on the platform it is compiled for.
"""

from __future__ import annotations

import sys
import hashlib
import threading
from typing import Callable

import jax
import jaxlib
from jax import export as jax_export

from daskdag.caches import Cache
from daskdag.errors import ClusterError

# The platforms JAX itself lowers for (``jax.export``'s built-in ones).
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

_lock = threading.Lock()  # (one export or compilation of a key at a time, and the counts)
_exported: Cache[bytes] = Cache("exported backward programs", 4096)  # key -> serialized program
_compiled: Cache[Callable] = Cache("loaded backward programs", 4096)  # key -> compiled program
_stats = {"exported": 0, "compiled": 0, "cache_hits": 0}


def versions() -> dict[str, str]:
    """The packages an exported program's meaning depends on."""
    from daskdag import __version__
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "daskdag": __version__}


def check_versions(sender: dict[str, str]) -> None:
    """Raise :class:`~daskdag.ClusterError` when a program was made under other versions."""
    here = versions()
    if sender != here:
        raise ClusterError(f"{_this_process()} has {here}, but a backward program it received "
                           f"was exported under {sender}: install the same versions everywhere")


def _this_process() -> str:
    try:  # (distributed not imported, or get_worker's ValueError: not a worker)
        return f"worker {sys.modules['distributed'].get_worker().address}"
    except (KeyError, ValueError):
        return "this process"


def platforms() -> tuple[str, ...]:
    """The platforms a program is exported for: :data:`PLATFORMS`, and this process's own where
    it is another (a PJRT plugin's)."""
    here = jax_export.default_export_platform()
    return PLATFORMS if here in PLATFORMS else (*PLATFORMS, here)


def export(closed_jaxpr, ct_avals) -> tuple[str, bytes]:
    """``(key, bytes)`` of a program computing ``closed_jaxpr(*ct, *consts)``, for every one of
    :func:`platforms` that JAX can lower it for (this process's own at least, else the lowering
    error is raised).

    The key is a hash of the jaxpr's text, its argument types, the platforms and the package
    versions, so equal programs from different items (or workers) share one key and one
    compilation.
    """
    const_avals = [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in closed_jaxpr.consts]
    wanted = platforms()
    key = hashlib.sha256(repr((str(closed_jaxpr.jaxpr), ct_avals, const_avals, wanted,
                               sorted(versions().items()))).encode()).hexdigest()
    data = _exported.get(key)
    if data is not None:
        return key, data
    jaxpr, n_ct = closed_jaxpr.jaxpr, len(ct_avals)

    def backward_program(*args):
        return jax.core.eval_jaxpr(jaxpr, args[n_ct:], *args[:n_ct])

    def exported_for(these):
        return jax_export.export(jax.jit(backward_program), platforms=these)(
            *ct_avals, *const_avals)

    try:
        exported = exported_for(wanted)
    except Exception:  # a lowering rule missing for some platform: those that have theirs
        lowered = []
        for platform in wanted:
            try:
                exported_for((platform,))
                lowered.append(platform)
            except Exception:
                if platform == jax_export.default_export_platform():
                    raise
        exported = exported_for(tuple(lowered))
    data = bytes(exported.serialize())
    _exported.put(key, data)
    with _lock:
        _stats["exported"] += 1
    return key, data


def load(key: str, data: bytes) -> Callable:
    """The compiled program for ``key``: deserialized and compiled on first use in this process."""
    with _lock:
        program = _compiled.get(key)
        if program is not None:
            _stats["cache_hits"] += 1
            return program
        exported = jax_export.deserialize(bytearray(data))
        here = jax_export.default_export_platform()
        if here not in exported.platforms:
            raise ClusterError(
                f"{_this_process()} runs JAX on '{here}', but a backward program it received "
                f"was exported for {exported.platforms} only (those JAX could lower it for where "
                f"it was made): run its node's backward on one of those")
        # (compiled at its first call, for the device its arguments are on: a node placed on
        # another device than the default runs its received backward there)
        program = jax.jit(exported.call)
        _compiled.put(key, program)
        _stats["compiled"] += 1
        return program


def stats() -> dict[str, int]:
    """Counts in this process: programs exported, compiled, and loads served from the cache."""
    with _lock:
        return dict(_stats)
