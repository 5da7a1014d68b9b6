"""What travels to a cluster: the user's functions and input values, packed so that neither the
scheduler nor the workers need to import the user's code, under tokens that change whenever
their contents do.

``pack(obj)`` pickles ``obj`` with :class:`~daskdag.transport.pickler.Pickler`: the user's code
by value (installed packages by reference), arrays out of band as Dask's zero-copy frames.
The token hashes the bytes and every array's content (NumPy arrays on every pack, since they
change in place; JAX arrays once per object). A :class:`Packed` is unpickled lazily, on first
use: the scheduler only sees bytes. A process keeps the last functions it received
(:data:`RECEIVED_FUNCTIONS`) and hands out the same one for a token, so ``jax.jit`` compiles
once per worker, not once per call.
"""

from __future__ import annotations

from dask.base import tokenize

import daskdag.config as config
from daskdag.caches import ByObject, Cache
from daskdag.errors import DAGError
from daskdag.transport.fingerprints import fingerprint
from daskdag.transport.pickler import dumps, loads, travelling
from daskdag.transport.weak import Weak, held, ref

RECEIVED_FUNCTIONS = 256  # the most functions a process keeps for reuse, oldest out first
# token -> the Function this process keeps for it
_received: Cache[Function] = Cache("functions received", RECEIVED_FUNCTIONS)

_UNSET = object()


class Packed:
    """A value as it travels: pickled bytes plus out-of-band arrays, and their content token
    (``None``: computed when first asked for). ``load()`` gives the original object in the
    process that packed it, an unpickled copy elsewhere."""

    __slots__ = ("_token", "skeleton", "arrays", "_value")

    def __init__(self, token: str | None, skeleton: bytes, arrays: list, value=_UNSET):
        self._token, self.skeleton, self.arrays, self._value = token, skeleton, arrays, value

    @property
    def token(self) -> str:
        if self._token is None:
            self._token = _content_token(self.skeleton, self.arrays)
        return self._token

    def load(self):
        if self._value is _UNSET or (isinstance(self._value, Weak) and self._value.target is None):
            # (held weakly by a preparation, and gone: a lazy call's graph outlives its DAG)
            self._value = loads(self.skeleton, self.arrays)
        return self._value

    def __reduce__(self):
        return type(self), (self._token, self.skeleton, travelling(self.arrays))

    def __dask_tokenize__(self):
        return type(self).__name__, self.token


class Function(Packed):
    """A packed node function: call it as the function itself."""

    __slots__ = ()

    def __call__(self, *args, **kwargs):
        return self.load()(*args, **kwargs)

    def load(self):
        new = self._value is _UNSET
        fn = super().load()
        if new:  # a process that received it: reuse it for the same token from now on
            _received.put(self.token, self)
        return fn

    def __reduce__(self):
        return _receive_function, (self.token, self.skeleton, travelling(self.arrays))


def _receive_function(token, skeleton, arrays) -> Function:
    """The function this process keeps for ``token``, else a new one from what travelled."""
    hit = _received.get(token)
    return Function(token, skeleton, arrays) if hit is None else hit


def pack(obj, as_function: bool = False, hashed: bool = True, tokens: dict | None = None) -> Packed:
    """``obj`` packed for travel (see the module's docstring); raises what pickling raised.

    ``hashed=False`` leaves the token to be computed when first asked for (values that travel
    under keys of their own, whose arrays then need no hashing). ``tokens``: array tokens by
    ``id`` already computed in this call, added to."""
    skeleton, arrays = dumps(obj)  # (the user's code by value: this pickler's alone)
    token = _content_token(skeleton, arrays, {} if tokens is None else tokens) if hashed else None
    return (Function if as_function else Packed)(token, skeleton, arrays, obj)


def _content_token(skeleton: bytes, arrays: list, tokens: dict | None = None) -> str:
    tokens = {} if tokens is None else tokens
    for a in arrays:
        if id(a) not in tokens:
            tokens[id(a)] = tokenize(a)  # (NumPy: its data; JAX: Dask's, kept per array)
    return tokenize(skeleton, [tokens[id(a)] for a in arrays])


def unpack(value):
    """The value of what :func:`pack_for` made: the task that produces an input from what
    travelled."""
    return value.load() if isinstance(value, Packed) else value


def pack_for(what: str, obj, strict: bool, as_function: bool = False, hashed: bool = True,
             tokens: dict | None = None):
    """:func:`pack` of ``obj``. Where pickling fails: ``strict`` (it must leave this process,
    :data:`~daskdag.transport.transports.CLUSTER`) a :class:`~daskdag.DAGError` naming
    ``what``; else ``obj`` itself, which a scheduler in this process can still run."""
    try:
        return pack(obj, as_function, hashed, tokens)
    except Exception as e:
        if strict:
            raise DAGError(f"{what} cannot be sent to the cluster: pickling it failed with "
                           f"{type(e).__name__}: {e}") from e
        return obj


PACKED_FUNCTIONS = 4096  # the most packed functions a process remembers (see pack_function)
_packed_functions: ByObject = ByObject("packed functions", PACKED_FUNCTIONS)
# a user's function -> it, as it is now (current)
_current: ByObject[_Current] = ByObject("functions as they are now", PACKED_FUNCTIONS)


def pack_function(what: str, fn, strict: bool, tokens: dict | None = None,
                  prints: dict | None = None):
    """``fn`` packed as a :class:`Function` (:func:`pack_for`), not pickled again while the
    :class:`~daskdag.transport.fingerprints.Fingerprint` it had when last packed still holds
    (pickling sends all that it reads, so the token changes with it). A function whose
    fingerprint cannot be taken is packed on every call, and so is every function while
    ``daskdag.prepared-calls`` is 0. ``prints``: fingerprints taken already in this call, by
    ``id`` (one taken here is added)."""
    target = held(fn)
    keeping = config.get("prepared-calls") > 0  # (0: nothing prepared is kept: packed anew too)
    hit = _packed_functions.get(target) if keeping else None
    if hit is None or not hit[0].holds(target):
        prints = {} if prints is None else prints
        if id(fn) not in prints:
            prints[id(fn)] = fingerprint(fn, checked=keeping)
        fp = prints[id(fn)] if keeping else None
        packed = pack_for(what, target, strict, as_function=True, tokens=tokens)
        if not isinstance(packed, Function):
            return fn
        hit = (fp, (packed.token, packed.skeleton, packed.arrays))
        if fp is not None:  # (a copy that holds no function: see ByObject)
            _packed_functions.put(target, hit)
    # (held as given: weakly, by a preparation, see daskdag.transport.weak)
    token, skeleton, arrays = hit[1]
    return Function(token, skeleton, arrays, fn)


def unwrap(fn):
    """The plain function behind a possibly packed one."""
    return fn.load() if isinstance(fn, Function) else fn


def current(fn):
    """``fn`` (maybe packed) as the one object this process uses for its content, for the caches
    keyed by a function's identity (``jax.jit``'s, compiled stages). A function this process
    received is one already. In the process that packed it, the user's own function outlives an
    in-place change to an array it closes over: it is wrapped in a :class:`_Current` for its
    latest content (only the latest), so that a changed function is traced anew."""
    if not isinstance(fn, Function):
        return fn
    loaded = fn.load()
    if _received.get(fn.token) is fn:
        return loaded
    loaded = held(loaded)  # (the function itself: every preparation's hold on it shares it)
    hit = _current.get(loaded)
    if hit is None or hit.token != fn.token:
        hit = _current.put(loaded, _Current(loaded, fn.token))
    return hit


class _Current:
    """A function of this process's user, as it is for one content token (see :func:`current`);
    held weakly where it can be, so that caching it keeps nothing alive."""

    __slots__ = ("_ref", "token", "__weakref__")

    def __init__(self, fn, token: str):
        self._ref, self.token = ref(fn), token

    @property
    def fn(self):
        return self._ref()

    def __call__(self, *args, **kwargs):
        return self._ref()(*args, **kwargs)
