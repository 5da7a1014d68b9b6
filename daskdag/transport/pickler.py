"""How packed values are pickled (:mod:`daskdag.transport.packing`): cloudpickle, arrays out of
band, ``jax.custom_vjp`` rebuilt from its parts, and by value the user's code, by the rule of
:mod:`daskdag.transport.whose`: functions and classes found under no installed module's name
(the user's classes are imported where they arrive, else rebuilt from their value), the user's
modules (``__main__`` only as far as the walk of :mod:`daskdag.transport.walk` reads it).

Only this pickler decides so (:meth:`Pickler.reducer_override`): nothing process-wide changes,
as ``cloudpickle.register_pickle_by_value`` would for other threads' pickling. It reaches into
cloudpickle's private names (:data:`PRIVATE`, checked by ``tests/test_internal_shipping.py``).
"""

from __future__ import annotations

import copyreg
import hashlib
import importlib
import io
import itertools
import pickle
import sys
import threading
import types
import typing

import cloudpickle
import cloudpickle.cloudpickle as _cloudpickle
import jax
import numpy as np

from daskdag.transport.scope import as_jax_array
from daskdag.transport.walk import read
from daskdag.transport.whose import by_reference, users, users_module


class Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, arrays out of band (into ``arrays``), the user's classes with
    their value beside their reference (:func:`import_or_load`)."""

    dispatch_table = cloudpickle.Pickler.dispatch_table.new_child(
        {jax.custom_vjp: lambda f: (_custom_vjp, (f.fun, f.nondiff_argnums, f.fwd, f.bwd,
                                                  f.symbolic_zeros, f.optimize_remat))})

    def __init__(self, file, arrays: list, root=None):
        super().__init__(file, protocol=5)
        self.arrays, self.root, self.dumped = arrays, root, None
        _Submodules.check()

    def dump(self, obj):
        self.dumped = obj
        return super().dump(obj)

    def persistent_id(self, obj):  # (out of band: NumPy arrays of no objects, JAX's not traced)
        if ((type(obj) is np.ndarray and not obj.dtype.hasobject)
                or (isinstance(obj, jax.Array) and not isinstance(obj, jax.core.Tracer))):
            self.arrays.append(obj)
            return len(self.arrays) - 1
        return None

    def reducer_override(self, obj):
        if isinstance(obj, type) and obj is not self.root and users_module(obj.__module__) \
                and "<locals>" not in obj.__qualname__:
            # (its value, in case the import fails)
            return import_or_load, (obj.__module__, obj.__qualname__, ByValue(*dumps(obj, obj)))
        # The user's code by value, for this pickler only; the rest as cloudpickle decides.
        if isinstance(obj, types.FunctionType) and not by_reference(obj):
            return (_cloudpickle._make_function, self._function_getnewargs(obj),
                    _function_state(obj), None, None, _cloudpickle._function_setstate)
        if isinstance(obj, type) and users(obj):
            return _cloudpickle._dynamic_class_reduce(obj)
        if isinstance(obj, types.ModuleType) and users_module(obj.__name__):
            return _module_by_value(obj, self.dumped)
        if isinstance(obj, typing.TypeVar) and users(obj):
            return _cloudpickle._make_typevar, _cloudpickle._decompose_typevar(obj)
        return super().reducer_override(obj)


def dumps(obj, root=None) -> tuple[bytes, list]:
    """``obj`` pickled by :class:`Pickler` (``root``: a class of the user's pickled by value,
    not by reference): its bytes, and its arrays out of band."""
    arrays: list = []
    buffer = io.BytesIO()
    Pickler(buffer, arrays, root).dump(obj)
    return buffer.getvalue(), arrays


def loads(skeleton: bytes, arrays: list):
    """What :func:`dumps` pickled."""
    return _Unpickler(io.BytesIO(skeleton), arrays).load()


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, arrays: list):
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, index):
        return self.arrays[index]


class JaxArray:
    """A JAX array on its way: NumPy frames in transit, a JAX array again on arrival."""

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return as_jax_array, (np.asarray(self.value),)


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
        return loads(self.skeleton, self.arrays)

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


def _keep_rebuilt(cls, origin: tuple) -> None:
    """Make a class rebuilt by value behave as its original: its instances pickle with a
    reference to ``origin``, pickle finds it by reference in a stand-in module (so that the class
    of a result Dask reports reaches the client as its own class), and a pytree class (its
    decorator does not run here) is registered again."""
    def reduce_ex(obj, protocol):
        rv = object.__reduce_ex__(obj, protocol)
        if type(obj) is not cls:  # a subclass: not ours to redirect
            return rv
        ref = _ClassRef(*origin)
        if rv[0] is cls:
            return (ref, *rv[1:])
        # pickle insists that its first arg be the class itself (__newobj__: not in typeshed)
        if rv[0] is copyreg.__newobj__:  # type: ignore[attr-defined]
            return (_new, (ref, *rv[1][1:]), *rv[2:])
        return rv

    cls.__reduce_ex__ = reduce_ex
    module, qualname = origin[:2]
    if module != "__main__" and "." not in qualname:
        stand_in = sys.modules.get(module)
        if stand_in is None:
            stand_in = sys.modules[module] = types.ModuleType(module)
            setattr(stand_in, "__daskdag_stand_in__", True)
        if getattr(stand_in, "__daskdag_stand_in__", False):
            setattr(stand_in, qualname, cls)
    if hasattr(cls, "tree_flatten") and hasattr(cls, "tree_unflatten"):
        try:
            jax.tree_util.register_pytree_node(cls, lambda obj: obj.tree_flatten(),
                                               lambda aux, kids: cls.tree_unflatten(aux, kids))
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


class _Submodules:
    """cloudpickle's ``_find_imported_submodules`` (it scans ``sys.modules``), answered from
    what it found before while no module came or went."""

    state: tuple = (None, None)  # (size of sys.modules, its last name) when memo was started
    memo: dict = {}  # (code, ids of its packages) -> its submodules

    @classmethod
    def check(cls) -> None:
        # An import appends to sys.modules, so its size or its last entry changes.
        state = (len(sys.modules), next(reversed(sys.modules)))
        if state != cls.state:
            cls.state, cls.memo = state, {}

    @classmethod
    def of(cls, code, top_level_dependencies) -> list:
        deps = list(top_level_dependencies)
        key = (code, tuple(id(d) for d in deps if isinstance(d, types.ModuleType)))
        hit = cls.memo.get(key)
        # (a module replaced under its name keeps the size and order of sys.modules)
        if hit is None or any(sys.modules.get(m.__name__) is not m for m in hit):
            hit = cls.memo[key] = _cloudpickle._find_imported_submodules(code, deps)
        return list(hit)


def _function_state(func) -> tuple[dict, dict]:
    """cloudpickle's ``_function_getstate``, its submodules from :class:`_Submodules`."""
    slotstate = {
        "__name__": "".join(func.__name__),  # ("".join: as cloudpickle, against interning)
        "__qualname__": "".join(func.__qualname__),
        "__annotations__": func.__annotations__,
        "__kwdefaults__": func.__kwdefaults__,
        "__defaults__": func.__defaults__,
        "__module__": func.__module__,
        "__doc__": func.__doc__,
        "__closure__": func.__closure__,
    }
    names = _cloudpickle._extract_code_globals(func.__code__)
    f_globals = {k: func.__globals__[k] for k in names if k in func.__globals__}
    closure_values = (() if func.__closure__ is None else
                      [_cloudpickle._get_cell_contents(c) for c in func.__closure__])
    slotstate["_cloudpickle_submodules"] = _Submodules.of(
        func.__code__, itertools.chain(f_globals.values(), closure_values))
    slotstate["__globals__"] = f_globals
    state = {"".join(k): v for k, v in func.__dict__.items()}
    return state, slotstate


def _module_by_value(module: types.ModuleType, dumped) -> tuple:
    """A module of the user's by value: all of it, but ``__main__`` (the script's namespace may
    hold what cannot travel: a client, a lock) only the attributes that the code reached from
    ``dumped`` may read, as a fingerprint reads them (:func:`~daskdag.transport.walk.read`)."""
    state = module.__dict__.copy()
    if module.__name__ == "__main__":
        names = read(dumped, module)
        if names is None:  # (not walked: as cloudpickle, imported where it arrives)
            return _cloudpickle.subimport, ("__main__",)
        state = {k: state[k] for k in sorted(names) if k in state}
    state.pop("__builtins__", None)  # (as cloudpickle: it may hold what cannot be pickled)
    return _cloudpickle.dynamic_subimport, (module.__name__, state)


# cloudpickle's private names this module uses (tests/test_internal_shipping.py checks them)
PRIVATE = ("_find_imported_submodules", "_extract_code_globals", "_get_cell_contents",
           "_make_function", "_function_setstate", "_dynamic_class_reduce", "dynamic_subimport",
           "subimport", "_make_typevar", "_decompose_typevar", "_is_registered_pickle_by_value")
