"""How JAX values and daskdag's objects meet Dask, registered once, with Dask's own tables.

- tokens: content hashes for deterministic task keys, once per array or function object;
- sizes: the bytes a JAX array or a pullback holds, so the scheduler keeps backward tasks
  beside their residuals and counts worker memory right;
- frames: a :class:`~daskdag.pullback.Pullback` crosses processes as its exported program
  plus one zero-copy frame per residual array (a sweep chunk's
  :class:`~daskdag.chunked.ItemPullbacks` pickle as a list of them);
- nodes: a :class:`~daskdag.spec.Node` received by a process is the first one it received
  with the same token, so its function keeps its identity from call to call, and with it
  ``jax.jit``'s compilations (a ``jit=True`` node recompiled on every call on a cluster);
- pickling ``jax.custom_vjp`` functions, which JAX cannot yet do, so nodes built on them
  (typically wrapping NumPy or SciPy code) can be sent to workers.
"""

from __future__ import annotations

import copyreg
import weakref
from collections import OrderedDict

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
from dask.base import normalize_token, tokenize
from dask.sizeof import sizeof
from distributed.protocol import dask_deserialize, dask_serialize, deserialize, serialize

from .chunked import ItemPullbacks
from .pullback import Pullback
from .spec import Node

# -- tokens ---------------------------------------------------------------------------------------

_tokens: dict[int, tuple[weakref.ref, str]] = {}  # id(obj) -> (weakref to obj, its token)


def cached_token(obj, compute=tokenize) -> str:
    """``compute(obj)`` (a Dask token), computed once per live object.

    For immutable JAX arrays, and for node functions (which Dask itself treats as pure), the
    token cannot change while the object lives, so repeated calls with the same weights and
    functions hash nothing again. An entry leaves with its object.
    """
    hit = _tokens.get(id(obj))
    if hit is not None and hit[0]() is obj:
        return hit[1]
    token = compute(obj)
    try:
        _tokens[id(obj)] = (weakref.ref(obj, lambda _, key=id(obj): _tokens.pop(key, None)), token)
    except TypeError:  # not weak-referenceable: nothing to cache against
        pass
    return token


@normalize_token.register(jax.Array)
def _normalize_jax_array(a):
    # Dask's fallback pickles a JAX array twice to hash it; its NumPy view hashes in one pass.
    return "jax.Array", cached_token(a, lambda a: tokenize(np.asarray(a)))


# -- sizes ----------------------------------------------------------------------------------------

@sizeof.register(jax.Array)
def _sizeof_jax_array(a) -> int:
    return int(a.nbytes)


@sizeof.register(Pullback)
@sizeof.register(ItemPullbacks)
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


# -- nodes ------------------------------------------------------------------------------------------

RECEIVED_NODES = 256  # the most nodes a process keeps for reuse, least recently received first out
_received: OrderedDict[str, Node] = OrderedDict()


def _reduce_node(node: Node):
    token = tokenize(cached_token(node.fn), node.deps, node.jit, node.vmap, node.device,
                     node.resources)
    return _receive_node, (token, node.fn, node.deps, node.jit, node.vmap, node.device,
                           node.resources)


def _receive_node(token: str, *fields) -> Node:
    """The node this process first received with ``token``, else a new one from ``fields``.

    The token is Dask's content hash of the function (closed-over or bound arrays included), so
    a hit is the same function; the copy just unpickled is dropped.
    """
    node = _received.get(token)
    if node is None:
        node = _received[token] = Node(*fields)
        if len(_received) > RECEIVED_NODES:
            _received.popitem(last=False)
    _received.move_to_end(token)
    return node


copyreg.pickle(Node, _reduce_node)


# -- custom_vjp functions ---------------------------------------------------------------------------

def _custom_vjp(fun, nondiff_argnums, fwd, bwd, symbolic_zeros, optimize_remat):
    f = jax.custom_vjp(fun, nondiff_argnums=nondiff_argnums)
    f.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros, optimize_remat=optimize_remat)
    return f


def _reduce_custom_vjp(f):
    return _custom_vjp, (f.fun, f.nondiff_argnums, f.fwd, f.bwd, f.symbolic_zeros, f.optimize_remat)


copyreg.pickle(jax.custom_vjp, _reduce_custom_vjp)
