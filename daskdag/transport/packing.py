"""What travels to a cluster: the user's functions and input values, packed so that neither the
scheduler nor the workers need to import the user's code, under tokens that change whenever
their contents do.

``pack(obj)`` pickles ``obj`` with cloudpickle, but:

- everything defined outside installed packages (the user's script, a module beside it, an
  editable checkout) is pickled by value: functions with the current values of the globals and
  closure cells they use; classes are imported on the receiving side when they can be (so
  pytree registrations and ``isinstance`` hold), else rebuilt from their pickled value.
  Installed packages (jax, numpy, equinox, daskdag itself) travel by reference.
- arrays travel out of band, as Dask's zero-copy frames; JAX arrays come back as JAX arrays.
- ``jax.custom_vjp`` functions, which JAX cannot pickle, are rebuilt from their parts.

The token hashes the pickled bytes and every array's content: NumPy arrays are hashed on every
pack, since they can change in place; JAX arrays, which cannot, once per array object (Dask's
token, cached in :mod:`daskdag.transport.protocol`). So an in-place change to anything a function
closes over changes its token, and no process reuses a stale copy.

The receiving side unpickles a :class:`Packed` lazily, on first use: the scheduler, which
unpickles task graphs, only ever sees bytes. A process keeps the last functions it received
(:data:`RECEIVED_FUNCTIONS`) and hands out the same one for the same token, so ``jax.jit``
compiles once per worker, not once per call.
"""

from __future__ import annotations

import copyreg
import hashlib
import importlib
import io
import pickle
import sys
import threading
import types
import weakref
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable

import cloudpickle
import cloudpickle.cloudpickle as _cloudpickle
import jax
import numpy as np
from dask.base import tokenize

from daskdag import config
from daskdag.caches import ByObject, register
from daskdag.errors import DAGError
from daskdag.transport.fingerprints import fingerprint, is_user_module
from daskdag.transport.weak import Weak, held

RECEIVED_FUNCTIONS = 256  # the most functions a process keeps for reuse, oldest out first

_UNSET = object()
_lock = threading.RLock()  # cloudpickle's by-value registry is process-wide: one pack at a time
_received: OrderedDict[str, "Function"] = OrderedDict()
_current: dict[int, "_Current"] = {}  # id of a user's function -> it, as it is now (current)


class Packed:
    """A value as it travels: pickled bytes plus out-of-band arrays, and their content token.

    ``load()`` gives the value: the original object in the process that packed it, an
    unpickled copy elsewhere. ``token`` may be given as ``None`` (``pack(hashed=False)``):
    it is then computed where it is first asked for, if ever.
    """

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
            self._value = _Unpickler(io.BytesIO(self.skeleton), self.arrays).load()
        return self._value

    def __reduce__(self):
        return type(self), (self._token, self.skeleton, _travelling(self.arrays))

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
            with _lock:
                _received[self.token] = self
                while len(_received) > RECEIVED_FUNCTIONS:
                    _received.popitem(last=False)
        return fn

    def __reduce__(self):
        return _receive_function, (self.token, self.skeleton, _travelling(self.arrays))


def _receive_function(token, skeleton, arrays) -> Function:
    """The function this process keeps for ``token``, else a new one from what travelled."""
    with _lock:
        hit = _received.get(token)
        if hit is not None:
            _received.move_to_end(token)
            return hit
    return Function(token, skeleton, arrays)


def pack(obj, as_function: bool = False, hashed: bool = True, tokens: dict | None = None) -> Packed:
    """``obj`` packed for travel (see the module's docstring); raises what pickling raised.

    ``hashed=False`` leaves the content token to be computed when first asked for: for values
    that travel under keys of their own (a sweep's scattered items), which are never asked, so
    their arrays are not hashed (most of the cost of packing them). ``tokens``: array tokens by
    ``id`` already computed in this call (see :func:`ship`), added to."""
    arrays: list = []
    buffer = io.BytesIO()
    with _lock, _user_modules_by_value():
        _Pickler(buffer, arrays).dump(obj)
    skeleton = buffer.getvalue()
    token = _content_token(skeleton, arrays, {} if tokens is None else tokens) if hashed else None
    return (Function if as_function else Packed)(token, skeleton, arrays, obj)


def _content_token(skeleton: bytes, arrays: list, tokens: dict | None = None) -> str:
    tokens = {} if tokens is None else tokens
    for a in arrays:
        if id(a) not in tokens:
            tokens[id(a)] = _array_token(a)
    return tokenize(skeleton, [tokens[id(a)] for a in arrays])


def unpack(value):
    """The value of what :func:`pack_for` made: the task that produces an input from what
    travelled."""
    return value.load() if isinstance(value, Packed) else value


def pack_for(what: str, obj, remote: bool, as_function: bool = False, hashed: bool = True,
             tokens: dict | None = None):
    """:func:`pack` of ``obj``. Where pickling fails: on a cluster (``remote``) a
    :class:`~daskdag.DAGError` naming ``what``; locally, where nothing travels, ``obj`` itself."""
    try:
        return pack(obj, as_function, hashed, tokens)
    except Exception as e:
        if remote:
            raise DAGError(f"{what} cannot be sent to the cluster: pickling it failed with "
                           f"{type(e).__name__}: {e}") from e
        return obj


def ship(plan, remote: bool, travel: bool = True, prints: dict | None = None):
    """``plan`` with the function of every node it runs packed (:func:`pack_function`), each
    distinct function once, and each distinct array they hold hashed once (an array several
    functions close over: a node's forward and backward rules, nodes sharing weights). The
    arrays live through the call, so their ids name them. ``travel=False`` (an eager call in
    this process): only the functions of ``jit=True`` nodes, whose compiled programs are cached
    by their content (:func:`current`); the others are called as they are. ``prints``: the
    functions' fingerprints already taken in this call, by ``id`` (added to)."""
    packed: dict[int, object] = {}
    tokens: dict[int, str] = {}
    prints = {} if prints is None else prints
    nodes = dict(plan.spec.nodes)
    for n in plan.needed:
        fn = nodes[n].fn
        if not (travel or nodes[n].jit):
            continue
        if id(fn) not in packed:
            packed[id(fn)] = pack_function(f"node {n!r}: its function", fn, remote, tokens,
                                           prints)
        nodes[n] = replace(nodes[n], fn=packed[id(fn)])
    return replace(plan, spec=replace(plan.spec, nodes=nodes))


PACKED_FUNCTIONS = 4096  # the most packed functions a process remembers (see pack_function)
_packed_functions: ByObject = ByObject("packed functions", PACKED_FUNCTIONS)


def _clear_received() -> None:
    with _lock:
        _received.clear()
        _current.clear()


register("functions received and current", _clear_received)


def pack_function(what: str, fn, remote: bool, tokens: dict | None = None,
                  prints: dict | None = None):
    """``fn`` packed as a :class:`Function` (:func:`pack_for`), without pickling it again while
    its :class:`~daskdag.transport.fingerprints.Fingerprint` is the same as when it was last
    packed: what it closes over and the globals it uses are read again and compared, NumPy
    arrays by content, and anything changed packs it anew. A function whose fingerprint cannot
    be taken is packed on every call, and so is every function while ``dask.config``'s
    ``daskdag.prepared-calls`` is 0. ``prints``: fingerprints taken already in this call, by
    ``id`` (this one is added when it is not there)."""
    prints = {} if prints is None else prints
    if id(fn) not in prints:
        prints[id(fn)] = fingerprint(fn)
    fp, target = prints[id(fn)], held(fn)
    if config.get("prepared-calls") <= 0:  # (nothing prepared is kept: packed anew too)
        fp = None
    hit = _packed_functions.get(target)
    if fp is not None and hit is not None and hit[0] == fp:
        token, skeleton, arrays = hit[2]
        return Function(token, skeleton, arrays, fn)
    packed = pack_for(what, target, remote, as_function=True, tokens=tokens)
    if not isinstance(packed, Function):
        return fn
    token = packed.token
    if hit is not None and hit[1] == token and fp is not None:
        # Changed where pickling does not look (an attribute of a module of the user's that
        # the function reads): a token of its own, so no program compiled before serves it.
        token = tokenize(token, fp.digest())
    if fp is not None:  # (a copy that holds no function: see ByObject)
        _packed_functions.put(target, (fp, packed.token, (token, packed.skeleton, packed.arrays)))
    # (held as given: weakly, by a preparation, see daskdag.transport.weak)
    return Function(token, packed.skeleton, packed.arrays, fn)


def unwrap(fn):
    """The plain function behind a possibly packed one."""
    return fn.load() if isinstance(fn, Function) else fn


def current(fn):
    """``fn`` (maybe packed) as the one object this process uses for its content, for the caches
    keyed by a function's identity: ``jax.jit``'s, and the compiled programs of fused stages
    and vmap nodes. A function this process received already is one (the function it keeps
    for its token). In the process that packed it, it is the user's own function, whose
    identity outlives an in-place change to an array it closes over: there it is wrapped in a
    :class:`_Current` for its latest content, so that a changed function is traced anew
    instead of running a program compiled with its old values. (Only the latest: a function
    whose closure changes before every call is compiled for every call, and no program
    compiled for an older content outlives the change.)"""
    if not isinstance(fn, Function):
        return fn
    loaded = fn.load()
    with _lock:
        if _received.get(fn.token) is fn:
            return loaded
        loaded = held(loaded)  # (the function itself: every preparation's hold on it shares it)
        hit = _current.get(id(loaded))
        if hit is None or hit.fn is not loaded or hit.token != fn.token:
            hit = _current[id(loaded)] = _Current(loaded, fn.token)
        return hit


class _Current:
    """A function of this process's user, as it is for one content token (see :func:`current`);
    held weakly where it can be, so that caching it keeps nothing alive."""

    __slots__ = ("_ref", "token", "__weakref__")

    def __init__(self, fn, token: str):
        self.token = token
        try:
            key = id(fn)
            self._ref: Callable[[], Any] = weakref.ref(fn, lambda _: _forget_current(key, self))
        except TypeError:  # not weakly referenceable: held (and kept alive) as it is
            self._ref = lambda: fn

    @property
    def fn(self):
        return self._ref()

    def __call__(self, *args, **kwargs):
        return self._ref()(*args, **kwargs)


def _forget_current(key: int, stale: _Current) -> None:
    with _lock:
        if _current.get(key) is stale:
            del _current[key]


# -- pickling -------------------------------------------------------------------------------------

class _Pickler(cloudpickle.Pickler):
    dispatch_table = cloudpickle.Pickler.dispatch_table.new_child(
        {jax.custom_vjp: lambda f: (_custom_vjp, (f.fun, f.nondiff_argnums, f.fwd, f.bwd,
                                                  f.symbolic_zeros, f.optimize_remat))})

    def __init__(self, file, arrays: list, root=None):
        super().__init__(file, protocol=5)
        self.arrays, self.root = arrays, root

    def persistent_id(self, obj):
        if _is_array(obj):
            self.arrays.append(obj)
            return len(self.arrays) - 1
        return None

    def reducer_override(self, obj):
        if isinstance(obj, type) and obj is not self.root and is_user_module(obj.__module__) \
                and "<locals>" not in obj.__qualname__:
            arrays: list[Any]
            buffer, arrays = io.BytesIO(), []
            _Pickler(buffer, arrays, root=obj).dump(obj)  # its value, in case the import fails
            return _import_or_load, (obj.__module__, obj.__qualname__,
                                     Packed("", buffer.getvalue(), arrays))
        return super().reducer_override(obj)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, arrays: list):
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, index):
        return self.arrays[index]


def _is_array(obj) -> bool:
    if isinstance(obj, np.ndarray):
        return type(obj) is np.ndarray and not obj.dtype.hasobject
    return isinstance(obj, jax.Array) and not isinstance(obj, jax.core.Tracer)


def _array_token(a) -> str:
    return tokenize(a)  # NumPy: hashes the data; JAX: Dask's token, cached per array object


class _JaxArray:
    """A JAX array on its way: NumPy frames in transit, a JAX array again on arrival."""

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return _to_jax, (np.asarray(self.value),)


def _to_jax(a):
    return jax.numpy.asarray(a)


def rows(a, start: int, stop: int):
    """Rows ``start:stop`` of the array ``a``, to be packed: a JAX array's are a view of its
    NumPy value (slicing the JAX array itself dispatches a copy, ~7 ms for 4 MB on CPU, and
    packing copies it out again), a JAX array again on arrival."""
    if isinstance(a, jax.Array):
        return _JaxArray(np.asarray(a)[start:stop])
    return a[start:stop]


def _travelling(arrays: list) -> list:
    # NumPy arrays pickle as out-of-band frames in Dask's protocol; JAX arrays go as NumPy.
    return [_JaxArray(a) if isinstance(a, jax.Array) else a for a in arrays]


_rebuilt: dict[tuple[str, str, str], type] = {}  # classes this process rebuilt by value


def _import_or_load(module: str, qualname: str, by_value: Packed):
    """A class of the user's: imported where its module is importable, else rebuilt by value,
    once per process and version of the class."""
    if not getattr(sys.modules.get(module), "__daskdag_stand_in__", False):
        try:
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            return obj
        except (ImportError, AttributeError):
            pass
    key = (module, qualname, hashlib.sha1(by_value.skeleton).hexdigest())
    with _lock:
        cls = _rebuilt.get(key)
        if cls is None:
            cls = by_value.load()
            if type(cls).__module__.partition(".")[0] == "equinox":
                # cloudpickle sets a class's annotations after its metaclass ran, and
                # equinox's metaclass makes the fields from them: the copy would have none.
                raise ImportError(
                    f"{module}.{qualname} is an equinox Module of your own, and {module!r} "
                    f"cannot be imported here; equinox classes cannot be rebuilt by value: "
                    f"install that module on the cluster, or send it with "
                    f"client.upload_file('{module.replace('.', '/')}.py')")
            _rebuilt[key] = cls
            _keep_rebuilt(cls, (module, qualname, by_value))
    return cls


def _stand_in(module: str, qualname: str, cls) -> None:
    """Put a rebuilt class where pickle looks a class up by reference, in a stand-in module.

    Dask pickles the classes of results it reports (``Future.type``): by reference from here,
    the client, which has the real module, gets its own class back, instead of cloudpickle's
    copy, which would reset the methods of the client's class under its pytree registration.
    (Classes of ``__main__`` and nested ones always travel by value: nothing to do there.)
    """
    if module == "__main__" or "." in qualname:
        return
    stand_in = sys.modules.get(module)
    if stand_in is None:
        stand_in = sys.modules[module] = types.ModuleType(module)
        setattr(stand_in, "__daskdag_stand_in__", True)
    if getattr(stand_in, "__daskdag_stand_in__", False):
        setattr(stand_in, qualname, cls)


def _keep_rebuilt(cls, origin: tuple) -> None:
    """Make a class rebuilt by value behave as its original when its instances travel on.

    Its instances pickle with a reference to ``origin`` (so a receiving process rebuilds the
    class once, as here), not with cloudpickle's copy of the class, whose arrival would reset
    the class's methods under its pytree registration; and a class that
    ``jax.tree_util.register_pytree_node_class`` registered (a decorator does not run again
    here) is registered again, looking its methods up at each use.
    """
    def reduce_ex(obj, protocol):
        rv = object.__reduce_ex__(obj, protocol)
        if type(obj) is not cls:  # a subclass: not ours to redirect
            return rv
        ref = _ClassRef(*origin)
        if rv[0] is cls:
            return (ref, *rv[1:])
        # pickle insists that its first arg be the class itself (copyreg.__newobj__: not in typeshed)
        if rv[0] is copyreg.__newobj__:  # type: ignore[attr-defined]
            return (_new, (ref, *rv[1][1:]), *rv[2:])
        return rv

    cls.__reduce_ex__ = reduce_ex
    _stand_in(origin[0], origin[1], cls)
    if hasattr(cls, "tree_flatten") and hasattr(cls, "tree_unflatten"):
        try:
            jax.tree_util.register_pytree_node(cls, lambda obj: obj.tree_flatten(),
                                               lambda aux, children: cls.tree_unflatten(aux, children))
        except ValueError:  # registered already
            pass


def _new(cls, *args):
    return cls.__new__(cls, *args)


class _ClassRef:
    def __init__(self, module, qualname, by_value):
        self.origin = (module, qualname, by_value)

    def __reduce__(self):
        return _import_or_load, self.origin


def _custom_vjp(fun, nondiff_argnums, fwd, bwd, symbolic_zeros, optimize_remat):
    f = jax.custom_vjp(fun, nondiff_argnums=nondiff_argnums)
    f.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros, optimize_remat=optimize_remat)
    return f


# -- whose code travels by value ------------------------------------------------------------------

class _user_modules_by_value:
    """Register the user's imported modules with cloudpickle's by-value registry for one pack,
    then restore it (the registry is process-wide; the caller holds ``_lock``). Meanwhile,
    cloudpickle's look for the submodules a function reaches through a package it uses
    (``jnp`` for ``jax.numpy``) is answered from what it found before, as long as no module came
    or went: it walks all of ``sys.modules`` for each such package of each function, most of
    what pickling a function costs in a process that imported a lot (jax, torch)."""

    _scanned: tuple = (None, [])  # (state of sys.modules, the user's modules) when scanned
    _submodules: dict = {}  # (code, ids of its packages) -> its submodules, for that state

    def __enter__(self):
        # The scan walks all of sys.modules: redo it only when modules came or went since (an
        # import appends to sys.modules, so its size or its last entry changes).
        state = (len(sys.modules), next(reversed(sys.modules)))
        seen, found = _user_modules_by_value._scanned
        if seen != state:
            found = [m for name, m in list(sys.modules.items())
                     if name != "__main__" and m is not None and is_user_module(name)]
            _user_modules_by_value._scanned = (state, found)
            _user_modules_by_value._submodules = {}
        registered = cloudpickle.list_registry_pickle_by_value()
        self.added = [m for m in found if m.__name__ not in registered
                      and sys.modules.get(m.__name__) is m]
        for m in self.added:
            cloudpickle.register_pickle_by_value(m)
        self.find: Any = getattr(_cloudpickle, "_find_imported_submodules", None)
        if self.find is not None:
            _cloudpickle._find_imported_submodules = self._remembered
        return self

    def _remembered(self, code, top_level_dependencies):
        deps = list(top_level_dependencies)
        key = (code, tuple(id(d) for d in deps if isinstance(d, types.ModuleType)))
        memo = _user_modules_by_value._submodules
        if key not in memo:
            memo[key] = self.find(code, deps)
        return list(memo[key])

    def __exit__(self, *exc):
        if self.find is not None:
            _cloudpickle._find_imported_submodules = self.find
        for m in self.added:
            cloudpickle.unregister_pickle_by_value(m)
