"""What every task of a call carries to wherever it runs and sets up there for its duration
(:func:`within`): the caller's JAX settings that change a result (:class:`JaxSettings`), and
malloc tuned for JAX's work where the process's environment held it back
(:func:`daskdag.transport.malloc.tuned`).

JAX reads ``jax_enable_x64``, ``jax_default_matmul_precision`` and the others of
:data:`SETTINGS` per thread: a context manager of the calling thread (``jax.enable_x64(True)``)
is seen neither by Dask's worker threads nor by another process, and a worker process has the
settings its own environment gave it. So a call takes the caller's values as its graph is made
(:meth:`JaxSettings.current`, in the calling thread), every task sets them in the thread that
runs it, as JAX's own context managers do, and the thread's own are back once it returns: the
same dtypes and numbers on threads, processes and any cluster, whatever else that worker runs.
A value keeps its dtype in transit (:func:`as_jax_array`, :func:`lossless`), so a float64
array reaches a task that computes in float64 unchanged, in a worker that does not.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Any

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np

from daskdag.errors import DAGError
from daskdag.transport import malloc

#: JAX's settings that change what a computation returns (dtypes, values, random numbers) or
#: whether it raises, each with the context manager of ``jax`` that sets it in one thread.
SETTINGS = {
    "jax_enable_x64": "enable_x64",
    "jax_default_matmul_precision": "default_matmul_precision",
    "jax_numpy_dtype_promotion": "numpy_dtype_promotion",
    "jax_numpy_rank_promotion": "numpy_rank_promotion",
    "jax_default_prng_impl": "default_prng_impl",
    "jax_threefry_partitionable": "threefry_partitionable",
    "jax_softmax_custom_jvp": "softmax_custom_jvp",
    "jax_debug_nans": "debug_nans",
    "jax_debug_infs": "debug_infs",
}


#: JAX's settings as it holds them: each a ``State``, whose ``value`` is the calling thread's and
#: which, called with a value, is the context manager that sets it in one thread (None where
#: this JAX lacks it).
_STATES = tuple(getattr(jax, manager, None) for manager in SETTINGS.values())
ABSENT = "absent"  # the value of a setting that the JAX making a call lacks
_NOTHING = contextlib.nullcontext()


def _values() -> tuple:
    """The calling thread's values of :data:`SETTINGS`."""
    return tuple([ABSENT if s is None else s.value for s in _STATES])


@dataclass(frozen=True)
class JaxSettings:
    """The values of :data:`SETTINGS` that a call computes under, in their order."""

    values: tuple

    @staticmethod
    def current() -> "JaxSettings":
        """The calling thread's values."""
        return JaxSettings(_values())

    def hold(self) -> bool:
        """Whether the calling thread's values are these."""
        return _values() == self.values

    def check(self) -> tuple[list[str], dict]:
        """:meth:`hold` as lines of a compiled check, and the names they read
        (:func:`~daskdag.transport.fingerprints.holding`)."""
        lines, names = [], {}
        for k, (state, value) in enumerate(zip(_STATES, self.values)):
            if state is None:  # (this JAX lacks it: it cannot change)
                continue
            names[f"d_s{k}"], names[f"d_v{k}"] = state, value
            lines.append(f"if d_s{k}.value != d_v{k}: return False")
        return lines, names

    def as_dict(self) -> dict[str, Any]:
        """``{name: value}``, plain (an enumeration's value as its own)."""
        return {name: value.value if isinstance(value, enum.Enum) else value
                for name, value in zip(SETTINGS, self.values)}

    def applied(self):
        """A context manager: these settings in the calling thread while its block runs (those
        that differ from the thread's), the thread's own again after. Raises
        :class:`~daskdag.DAGError` naming a setting that this process's JAX lacks."""
        if _values() == self.values:
            return _NOTHING  # (the common case, asked first)
        differ = [(state, value, k) for k, (state, value) in enumerate(zip(_STATES, self.values))
                  if value != ABSENT and (state is None or state.value != value)]
        return _setting(differ) if differ else _NOTHING

    def __dask_tokenize__(self):
        return "JaxSettings", self.values


@contextlib.contextmanager
def _setting(differ: list):
    with contextlib.ExitStack() as stack:
        for state, value, k in differ:
            if state is None:
                name, manager = list(SETTINGS.items())[k]
                raise DAGError(f"JAX setting {name!r} ({value!r} where the call was made) cannot "
                               f"be set in this process: its JAX ({jax.__version__}) has no "
                               f"jax.{manager}")
            stack.enter_context(state(value))
        yield


def within(settings: JaxSettings, fn, *args):
    """``fn(*args)`` under ``settings`` (:meth:`JaxSettings.applied`) and, where this process's
    environment holds malloc back, :func:`daskdag.transport.malloc.tuned`: the wrapper of every
    task of a call."""
    with malloc.tuned(), settings.applied():
        return fn(*args)


def lossless():
    """A context manager: JAX arrays unpickled in its block keep their dtype, whatever this
    thread's ``jax_enable_x64`` (JAX's own unpickling puts them on a device as this thread's
    settings allow)."""
    return jax.enable_x64(True)


def loads(data: bytes):
    """``cloudpickle.loads`` of ``data`` under :func:`lossless`: how Dask's multiprocessing
    scheduler takes in a call's tasks and results."""
    with lossless():
        return cloudpickle.loads(data)


def as_jax_array(a) -> jax.Array:
    """``a`` (a NumPy array arriving from another process) as a JAX array of its own dtype,
    whatever this thread's ``jax_enable_x64``: a value keeps its dtype in transit, and the task
    that takes it computes under its call's settings."""
    with lossless():
        return jnp.asarray(np.asarray(a))
