"""How JAX values and daskdag's objects meet Dask, registered once, with Dask's own tables.

- tokens: a JAX array's content hash, computed once per array (they are immutable);
- sizes: the bytes a JAX array, a pullback, a packed value or a node holds, so the scheduler
  keeps backward tasks beside their residuals and counts worker memory right;
- frames: a :class:`~daskdag.rules.pullback.Pullback` crosses processes as its exported program
  plus one zero-copy frame per residual array (a stage's
  :class:`~daskdag.graph.stages.StagePullback` and a sweep chunk's
  :class:`~daskdag.sweeps.chunked.ItemPullbacks` pickle as lists of them).

How the user's functions and inputs travel (by value, under content tokens) is
:mod:`daskdag.transport.packing`'s.
"""

from __future__ import annotations

import weakref

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
from dask.base import normalize_token, tokenize
from dask.sizeof import sizeof
from distributed.protocol import dask_deserialize, dask_serialize, deserialize, serialize

from daskdag.sweeps.chunked import ItemPullbacks
from daskdag.rules.pullback import Pullback
from daskdag.transport.packing import Packed
from daskdag.model.spec import Node
from daskdag.graph.stages import FusedPullback, StagePullback

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
    _jax_tokens[id(a)] = (weakref.ref(a, lambda _, key=id(a): _jax_tokens.pop(key, None)), token)
    return "jax.Array", token


# -- sizes ----------------------------------------------------------------------------------------

@sizeof.register(jax.Array)
def _sizeof_jax_array(a) -> int:
    return int(a.nbytes)


@sizeof.register(Packed)
def _sizeof_packed(p) -> int:
    return len(p.skeleton) + sum(int(a.nbytes) for a in p.arrays)


@sizeof.register(Node)
def _sizeof_node(node) -> int:
    return sizeof(node.fn)


@sizeof.register(Pullback)
@sizeof.register(ItemPullbacks)
@sizeof.register(StagePullback)
@sizeof.register(FusedPullback)
def _sizeof_pullback(pb) -> int:
    return pb.residual_nbytes()


# -- frames ---------------------------------------------------------------------------------------

@dask_serialize.register(jax.Array)
def _serialize_jax_array(a):
    # As NumPy's zero-copy frames: distributed's fallback pickles JAX arrays, 3x slower.
    return serialize(np.asarray(a))


@dask_deserialize.register(jax.Array)
def _deserialize_jax_array(header, frames):
    return jnp.asarray(deserialize(header, frames))


@dask_serialize.register(Pullback)
def _serialize_pullback(pb: Pullback):
    form = pb.portable()
    consts, program = form.pop("consts", []), form.pop("program", None)
    frames = [cloudpickle.dumps(form), program or b""]
    headers = []
    for a in consts:
        if a is None:  # one of the node's inputs: the backward task has it
            headers.append(None)
            continue
        h, f = serialize(a)
        h["n_frames"] = len(f)
        headers.append(h)
        frames.extend(f)
    return {"consts": headers, "has_program": program is not None}, frames


@dask_deserialize.register(Pullback)
def _deserialize_pullback(header, frames) -> Pullback:
    form = cloudpickle.loads(frames[0])
    if header["has_program"]:
        form["program"] = frames[1]
        consts, at = [], 2
        for h in header["consts"]:
            if h is None:
                consts.append(None)
                continue
            consts.append(deserialize(h, frames[at:at + h["n_frames"]]))
            at += h["n_frames"]
        form["consts"] = consts
    return Pullback.from_portable(form)
