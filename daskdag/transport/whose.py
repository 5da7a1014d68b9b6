"""Whose code travels by value: the one rule that pickling (:mod:`daskdag.transport.pickler`)
and the walk of fingerprints and content tokens (:mod:`daskdag.transport.walk`) follow.

A module is *installed code*, which travels by reference (the receiving side imports it), when
it is the standard library's or daskdag's own; or an installed distribution owns its top-level
package (``importlib.metadata``: ``top_level.txt``, else ``RECORD``), wherever its files are
(``site-packages``, ``PYTHONPATH``, ``pip --target``, an editable install's folder), unless a
package of that name sits, apart from the distribution's files, in the working directory or the
script's folder (the user's ``tests`` where some distribution claims ``tests``); or its file
lies under the interpreter's library folders. Everything else with a file is the *user's* code
and travels by value: ``__main__``, the user's unpackaged modules, and any module given to
``cloudpickle.register_pickle_by_value`` (asked each time: registering can come later).
"""

from __future__ import annotations

import json
import os
import site
import sys
import sysconfig
from functools import cache
from importlib import metadata
from typing import Any

import cloudpickle.cloudpickle as _cloudpickle

from daskdag.caches import Cache


def users_module(name: str) -> bool:
    """Whether module ``name`` is the user's own code, which travels by value (see the module's
    docstring), not installed code, which the receiving side imports."""
    if name == "__main__":
        return True
    module = sys.modules.get(name)
    if module is not None and _cloudpickle._is_registered_pickle_by_value(module):
        return True
    file: Any = getattr(module, "__file__", None)
    if not file:  # (built into the interpreter, or a namespace package: nothing to send)
        return False
    global _path
    if sys.path != _path:  # (a folder added or removed: who owns what may differ)
        _decided.clear()
        _path = list(sys.path)
    return _decided.setdefault((name, file), lambda: not _installed(name, file))


def by_reference(obj) -> bool:
    """Whether ``obj`` pickles by reference: installed code's function, class or other object
    found under its own module and name (``jax.numpy.sin``), which the receiving side imports.
    The user's own code and objects made inside functions travel by value."""
    module = getattr(obj, "__module__", None)
    try:
        name = obj.__qualname__
    except AttributeError:
        name = getattr(obj, "__name__", None)
    if not isinstance(module, str) or not isinstance(name, str) or "<locals>" in name \
            or users_module(module):
        return False
    found = sys.modules.get(module)
    for part in name.split("."):
        found = getattr(found, part, None)
        if found is None:
            return False
    return found is obj


def users(obj) -> bool:
    """Whether a function, class or type variable is the user's own code, pickled by value: not
    one that pickles by reference, nor one that installed code made (a class made inside one of
    its functions, found under no name)."""
    module = getattr(obj, "__module__", None)
    return not by_reference(obj) and (not isinstance(module, str) or module not in sys.modules
                                      or users_module(module))


_decided: Cache[bool] = Cache("whose modules are the user's", 4096)  # (name, file) -> decided
_path: list[str] = []  # sys.path as it was when _decided was filled


def _installed(name: str, file: str) -> bool:
    top = name.partition(".")[0]
    if top == "daskdag" or top in sys.stdlib_module_names:
        return True
    path = os.path.realpath(file)
    if path.startswith(_library_folders()):
        return True
    owners = _owned.setdefault(tuple(sys.path), _read_owners).get(top)
    if owners is None:
        return False
    if path.startswith(owners):  # (where the owning distribution put it)
        return True
    return _root(top, path) not in _users_folders()


@cache
def _library_folders() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= set(site.getsitepackages()) | {site.getusersitepackages()}
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


def _root(top: str, path: str) -> str:
    """The folder that holds top-level package or module ``top``, of which ``path`` is a
    file."""
    package = getattr(sys.modules.get(top), "__file__", None) or path
    folder = os.path.dirname(os.path.realpath(package))
    if os.path.basename(package).startswith("__init__."):
        folder = os.path.dirname(folder)
    return folder + os.sep


def _users_folders() -> tuple[str, ...]:
    """The working directory and the running script's folder: where the user's own modules
    are."""
    folders = {os.getcwd()}
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main:
        folders.add(os.path.dirname(os.path.abspath(main)))
    return tuple(os.path.realpath(f) + os.sep for f in folders)


# sys.path -> each top-level name that an installed distribution on it owns -> the folders
# where those distributions put their files
_owned: Cache[dict] = Cache("top-level packages of installed distributions", 4)


def _read_owners() -> dict[str, tuple[str, ...]]:
    owners: dict[str, set[str]] = {}
    for dist in metadata.distributions():
        try:
            folders = {os.path.realpath(str(dist.locate_file(""))) + os.sep}
            editable = _editable_folder(dist)
            if editable:
                folders.add(editable)
            for top in _tops(dist):
                owners.setdefault(top, set()).update(folders)
        except (OSError, ValueError):  # (a broken distribution's metadata: it owns nothing)
            continue
    return {top: tuple(folders) for top, folders in owners.items()}


def _tops(dist: metadata.Distribution) -> set[str]:
    """The top-level names ``dist`` installs: its ``top_level.txt`` (setuptools writes one,
    for editable installs too), else the packages and modules its ``RECORD`` lists."""
    listed = dist.read_text("top_level.txt")
    if listed:
        return {line.strip() for line in listed.splitlines() if line.strip()}
    tops = set()
    for line in (dist.read_text("RECORD") or "").splitlines():
        first = line.partition(",")[0].replace("\\", "/").partition("/")
        part = first[0]
        if not part or part.startswith("..") or part.endswith((".dist-info", ".egg-info",
                                                               ".data", ".pth")):
            continue
        if first[1]:  # a folder: a package
            tops.add(part)
        elif part.endswith((".py", ".so", ".pyd")):  # a module
            tops.add(part.partition(".")[0])
    return {t for t in tops if t.isidentifier() and not t.startswith("__editable__")}


def _editable_folder(dist: metadata.Distribution) -> str | None:
    """The folder an editable install of ``dist`` reads its files from."""
    try:
        url = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        return None
    if url.get("dir_info", {}).get("editable") and str(url.get("url", "")).startswith("file://"):
        return os.path.realpath(url["url"][len("file://"):]) + os.sep
    return None
