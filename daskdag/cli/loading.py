"""Loading the DAG named on the command line, ``MODULE[:DAG]``: a module or a ``.py`` file, and
the attribute holding the dict (or a callable returning it)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from daskdag.cli.usage import UsageError

TARGET_HELP = ("an importable module (pkg.mod, looked up from the current directory "
               "first, as `python -m` does) or a .py file (path/to/pipeline.py, loaded with its "
               "directory first on sys.path, as `python path/to/pipeline.py` does); DAG is the "
               "attribute holding the dict {name: (fn, [deps])} (dotted: obj.attr), or a "
               "zero-argument callable returning it. Default attribute: dag")


def load_dag(target: str) -> dict:
    """The DAG named by ``MODULE[:DAG]`` (see :data:`TARGET_HELP`), as a dict, not yet validated
    (:func:`daskdag.model.spec.parse` does that); ``UsageError`` naming what was looked for when
    it is not there."""
    # DAG is "dag" where none is given, or what follows the last ":" is no name (C:\dags\p.py).
    module_part, sep, attr = target.rpartition(":")
    if not sep or not all(p.isidentifier() for p in attr.split(".")):
        module_part, attr = target, "dag"
    if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
        module, where = _exec_file(module_part)
    else:
        module, where = _import_module(module_part), module_part
    return dict(_dag_object(module, where, attr))


def _exec_file(module_part: str) -> tuple[ModuleType, str]:
    """``(module, its resolved path as text)``: the module the file defines, run with its
    directory first on ``sys.path`` (where it stays, as with ``python path/file.py``) and kept
    in ``sys.modules`` (for pickling by value); ``UsageError`` where it is missing or raised."""
    path = Path(module_part).expanduser()
    if not path.is_file():
        raise UsageError(f"no DAG module file {str(path)!r}" + ("" if path.suffix == ".py" else
                         " (a module name is written pkg.mod, a file path/to/file.py)"))
    path = path.resolve()
    name = path.stem if path.stem.isidentifier() else "daskdag_cli_dag"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) != str(path):
        name = f"daskdag_cli_{abs(hash(str(path)))}"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]  # (a .py file)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException as e:
        sys.modules.pop(name, None)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise UsageError(f"loading DAG module {str(path)!r} failed: {type(e).__name__}: {e}") from e
    return module, str(path)


def _import_module(module_part: str) -> ModuleType:
    """The module, imported with the current directory first on ``sys.path`` (as ``python -m``
    has it); ``UsageError`` where there is no such module or importing it raised."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as e:
        if e.name and (module_part == e.name or module_part.startswith(e.name + ".")):
            raise UsageError(f"no module named {module_part!r} (looked for {e.name!r} on "
                             f"sys.path, the current directory first); for a file write "
                             f"path/to/{module_part.rpartition('.')[2]}.py") from e
        raise UsageError(f"importing DAG module {module_part!r} failed: {e}") from e
    except Exception as e:
        raise UsageError(f"importing DAG module {module_part!r} failed: "
                         f"{type(e).__name__}: {e}") from e


def _dag_object(module: ModuleType, where: str, attr: str) -> Any:
    """The mapping at the (dotted) attribute ``DAG``, or what calling it returns; ``UsageError``
    where there is no such attribute (listing the module's dicts and callables), the call
    raised, or the result is no mapping."""
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            have = sorted(k for k, v in vars(module).items()
                          if not k.startswith("_") and (isinstance(v, Mapping) or callable(v))
                          and not isinstance(v, type(sys)))
            raise UsageError(f"DAG module {where!r} has no attribute {attr!r}" + (
                f"; dicts and callables there: {', '.join(have[:20])}" if have else ""))
        obj = getattr(obj, part)
    if not isinstance(obj, Mapping) and callable(obj):
        try:
            obj = obj()
        except Exception as e:
            raise UsageError(f"{where}:{attr} is callable, but calling it with no arguments "
                             f"failed: {type(e).__name__}: {e}") from e
    if not isinstance(obj, Mapping):
        raise UsageError(f"{where}:{attr} is a {type(obj).__name__}, not the DAG dict "
                         f"{{name: (fn, [deps])}} (nor a zero-argument callable returning it)")
    return obj
