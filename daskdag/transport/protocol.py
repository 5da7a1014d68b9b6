"""How JAX values and daskdag's objects meet Dask, registered with Dask's own tables, in one
place: tokens (a JAX array's hashed once per array), sizes and frames (a JAX array as NumPy's
zero-copy frames; a packed value by its bytes; each family of daskdag's objects that travel,
registered once with :func:`travels`).

``distributed``'s serializers are registered only once ``distributed`` is in use
(:func:`with_distributed`), so that a call on threads never imports it.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any, Callable

import jax
import numpy as np
from dask.base import normalize_token, tokenize
from dask.sizeof import sizeof

from daskdag.caches import ByObject
from daskdag.transport.packing import Packed
from daskdag.transport.scope import as_jax_array, lossless

# -- tokens ---------------------------------------------------------------------------------------

JAX_TOKENS = 65_536  # the most JAX arrays whose tokens a process keeps
_jax_tokens: ByObject[str] = ByObject("JAX arrays' tokens", JAX_TOKENS)  # an array -> its token


@normalize_token.register(jax.Array)
def _normalize_jax_array(a):
    """A JAX array's token, hashed once per array (JAX arrays are immutable); an entry leaves
    with its array."""
    token = _jax_tokens.get(a)
    if token is None:  # (Dask's fallback would pickle the array, twice)
        token = _jax_tokens.put(a, tokenize(np.asarray(a)))
    return "jax.Array", token


def token_kept(fixed: Callable[[Any], bool] = lambda obj: True):
    """Register a frozen dataclass with Dask's ``tokenize``: its fields' token, computed once
    per object and kept on it, for the objects ``fixed(obj)`` says cannot change (their
    fields hold nothing mutable); others are tokenized afresh each time."""
    def register(cls: type) -> type:
        names = [f.name for f in dataclasses.fields(cls)]

        @normalize_token.register(cls)
        def _normalize(obj):
            token = obj.__dict__.get("_token")
            if token is None:
                token = tokenize(*(getattr(obj, n) for n in names))
                if fixed(obj):
                    object.__setattr__(obj, "_token", token)
            return cls.__name__, token

        return cls

    return register


# -- sizes ----------------------------------------------------------------------------------------

sizeof.register(jax.Array)(lambda a: int(a.nbytes))
sizeof.register(Packed)(lambda p: len(p.skeleton) + sum(int(a.nbytes) for a in p.arrays))


# -- frames ---------------------------------------------------------------------------------------

_families: list[type] = []  # those registered with travels, for distributed's serializers
_registered: list[type] = []  # those distributed's serializers know
_lock = threading.Lock()


def with_distributed() -> None:
    """Register JAX arrays and the families of :func:`travels` with ``distributed``'s
    serializers (once each; ``distributed`` is imported by now or is imported here)."""
    if len(_registered) == len(_families) + 1:
        return
    from distributed.protocol import dask_deserialize, dask_serialize
    with _lock:
        for family, dumps, loads in [(jax.Array, _serialize_jax_array, _deserialize_jax_array),
                                     *((f, _dumps, _loads) for f in _families)]:
            if family not in _registered:
                dask_serialize.register(family)(dumps)
                dask_deserialize.register(family)(loads)
                _registered.append(family)


def _serialize_jax_array(a):
    # As NumPy's zero-copy frames: distributed's fallback would pickle JAX arrays.
    from distributed.protocol import serialize
    return serialize(np.asarray(a))


def _deserialize_jax_array(header, frames):
    from distributed.protocol import deserialize
    return as_jax_array(deserialize(header, frames))


def travels(size: Callable[[Any], int]):
    """Register a family of daskdag's objects (a base class: its subclasses too) with Dask:
    ``size(obj)`` is what the scheduler counts it as; it crosses processes pickled (its
    ``__reduce__``), its arrays as zero-copy frames, each with its own dtype
    (:func:`~daskdag.transport.scope.lossless`). Every daskdag object that a task returns and
    that holds JAX arrays is of a family."""
    def register(family: type) -> type:
        sizeof.register(family)(lambda obj: int(size(obj)))
        _families.append(family)
        if "distributed.protocol" in sys.modules:  # (in a worker, or a client made already)
            with_distributed()
        return family

    return register


def tree_size(obj) -> int:
    """What a pytree of arrays is, to the scheduler: the sum of its leaves' sizes (as
    :func:`travels` takes it)."""
    return sum(sizeof(leaf) for leaf in jax.tree.leaves(obj))


def _dumps(obj) -> tuple[dict, list]:
    from distributed.protocol import serialize
    header, frames = serialize(obj, serializers=("pickle",), on_error="raise")
    return {"pickled": header}, frames


def _loads(header: dict, frames: list):
    from distributed.protocol import deserialize
    with lossless():
        return deserialize(header["pickled"], frames)


if "distributed.protocol" in sys.modules:
    with_distributed()
