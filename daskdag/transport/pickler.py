"""How packed values are pickled (:mod:`daskdag.transport.packing` packs with it): cloudpickle,
with arrays out of band, the user's classes imported where they arrive or rebuilt from their
value, ``jax.custom_vjp`` functions rebuilt from their parts, and the user's modules pickled by
value for the length of one pack.

It is the one place daskdag reaches into cloudpickle: :class:`user_modules_by_value` answers
cloudpickle's private ``_find_imported_submodules`` from its last scan while no module came or
went. Without it packing still works, only slower; ``tests/test_internal_fingerprints.py``
fails when a cloudpickle release drops it, so that the loss is not silent.
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
from typing import Any

import cloudpickle
import cloudpickle.cloudpickle as _cloudpickle
import jax
import numpy as np
from dask.base import tokenize

from daskdag.transport.fingerprints import is_user_module


class Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, arrays out of band (into ``arrays``), the user's classes with
    their value beside their reference (:func:`import_or_load`), ``jax.custom_vjp`` by its
    parts."""

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
            Pickler(buffer, arrays, root=obj).dump(obj)  # its value, in case the import fails
            return import_or_load, (obj.__module__, obj.__qualname__,
                                    ByValue(buffer.getvalue(), arrays))
        return super().reducer_override(obj)


class Unpickler(pickle.Unpickler):
    """The other half of :class:`Pickler`: arrays from ``arrays``."""

    def __init__(self, file, arrays: list):
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, index):
        return self.arrays[index]


def _is_array(obj) -> bool:  # (what travels out of band)
    if isinstance(obj, np.ndarray):
        return type(obj) is np.ndarray and not obj.dtype.hasobject
    return isinstance(obj, jax.Array) and not isinstance(obj, jax.core.Tracer)


def array_token(a) -> str:
    return tokenize(a)  # NumPy: hashes the data; JAX: Dask's token, cached per array object


class JaxArray:
    """A JAX array on its way: NumPy frames in transit, a JAX array again on arrival."""

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return _to_jax, (np.asarray(self.value),)


def _to_jax(a):
    return jax.numpy.asarray(a)


def travelling(arrays: list) -> list:
    # NumPy arrays pickle as out-of-band frames in Dask's protocol; JAX arrays go as NumPy.
    return [JaxArray(a) if isinstance(a, jax.Array) else a for a in arrays]


_rebuilt: dict[tuple[str, str, str], type] = {}  # classes this process rebuilt by value
_rebuilding = threading.RLock()


class ByValue:
    """A class of the user's, pickled by value beside its reference, in case its module cannot
    be imported where it arrives."""

    __slots__ = ("skeleton", "arrays")

    def __init__(self, skeleton: bytes, arrays: list):
        self.skeleton, self.arrays = skeleton, arrays

    def load(self):
        return Unpickler(io.BytesIO(self.skeleton), self.arrays).load()

    def __reduce__(self):
        return ByValue, (self.skeleton, travelling(self.arrays))


def import_or_load(module: str, qualname: str, by_value: ByValue):
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
    with _rebuilding:
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
        return import_or_load, self.origin


def _custom_vjp(fun, nondiff_argnums, fwd, bwd, symbolic_zeros, optimize_remat):
    f = jax.custom_vjp(fun, nondiff_argnums=nondiff_argnums)
    f.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros, optimize_remat=optimize_remat)
    return f


# -- whose code travels by value ------------------------------------------------------------------

class user_modules_by_value:
    """Register the user's imported modules with cloudpickle's by-value registry for one pack,
    then restore it (the registry is process-wide: the caller packs one value at a time). Meanwhile,
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
        seen, found = user_modules_by_value._scanned
        # (a module replaced under its name keeps the size and order of sys.modules)
        if seen != state or any(sys.modules.get(m.__name__) is not m for m in found):
            found = [m for name, m in list(sys.modules.items())
                     if name != "__main__" and m is not None and is_user_module(name)]
            user_modules_by_value._scanned = (state, found)
            user_modules_by_value._submodules = {}
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
        memo = user_modules_by_value._submodules
        if key not in memo:
            memo[key] = self.find(code, deps)
        return list(memo[key])

    def __exit__(self, *exc):
        if self.find is not None:
            _cloudpickle._find_imported_submodules = self.find
        for m in self.added:
            cloudpickle.unregister_pickle_by_value(m)
