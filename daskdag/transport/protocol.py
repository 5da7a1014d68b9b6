"""How JAX values and daskdag's objects meet Dask, registered with Dask's own tables, in one
place.

- tokens: a JAX array's content hash, computed once per array (they are immutable);
- sizes and frames: a JAX array as NumPy's zero-copy frames; a packed value
  (:mod:`daskdag.transport.packing`) by its bytes; and each family of daskdag's own objects
  that travel (pullbacks, :mod:`daskdag.rules.pullback`; nodes), registered once per family
  with :func:`travels`: sized as the family says, pickled with their arrays out of band.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from dask.base import normalize_token, tokenize
from dask.sizeof import sizeof
from distributed.protocol import dask_deserialize, dask_serialize, deserialize, serialize

from daskdag.transport.packing import Packed

# -- tokens ---------------------------------------------------------------------------------------

_jax_tokens: dict[int, tuple[weakref.ref, str]] = {}  # id(array) -> (weakref to it, its token)


@normalize_token.register(jax.Array)
def _normalize_jax_array(a):
    """A JAX array's token, hashed once per array: JAX arrays are immutable, so repeated calls
    with the same weights hash nothing again (NumPy arrays, which can change in place, are
    hashed every time by Dask itself). An entry leaves with its array."""
    hit = _jax_tokens.get(id(a))
    if hit is not None and hit[0]() is a:
        return "jax.Array", hit[1]
    token = tokenize(np.asarray(a))  # Dask's fallback would pickle the array, twice
    key = id(a)
    _jax_tokens[key] = (weakref.ref(a, lambda _: _jax_tokens.pop(key, None)), token)
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

@sizeof.register(jax.Array)
def _sizeof_jax_array(a) -> int:
    return int(a.nbytes)


@sizeof.register(Packed)
def _sizeof_packed(p) -> int:
    return len(p.skeleton) + sum(int(a.nbytes) for a in p.arrays)


# -- frames ---------------------------------------------------------------------------------------

@dask_serialize.register(jax.Array)
def _serialize_jax_array(a):
    # As NumPy's zero-copy frames: distributed's fallback pickles JAX arrays, 3x slower.
    return serialize(np.asarray(a))


@dask_deserialize.register(jax.Array)
def _deserialize_jax_array(header, frames):
    return jnp.asarray(deserialize(header, frames))


def travels(size: Callable[[Any], int]):
    """Register a family of daskdag's objects (a base class: its subclasses too) with Dask:
    ``size(obj)`` is what the scheduler counts it as (for placing tasks beside it and for
    worker memory); it crosses processes pickled (its ``__reduce__``), its arrays as
    zero-copy frames (distributed's pickle family)."""
    def register(family: type) -> type:
        sizeof.register(family)(lambda obj: int(size(obj)))
        dask_serialize.register(family)(_dumps)
        dask_deserialize.register(family)(_loads)
        return family

    return register


def _dumps(obj) -> tuple[dict, list]:
    header, frames = serialize(obj, serializers=("pickle",), on_error="raise")
    return {"pickled": header}, frames


def _loads(header: dict, frames: list):
    return deserialize(header["pickled"], frames)
