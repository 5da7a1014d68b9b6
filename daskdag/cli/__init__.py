"""daskdag's command line: the ``daskdag`` command (also ``python -m daskdag.cli``), with the
commands ``run`` and ``sweep`` (:mod:`daskdag.cli.commands`) and ``certs``, which writes the TLS
files of a secured Dask cluster (:mod:`daskdag.cli.tls`); docs/guides/cli.md describes them.
Its exit codes and its own two errors are here (the rest are daskdag's: :mod:`daskdag.errors`).

May import: all of daskdag (the top layer); nothing imports it but the deploy recipes.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from daskdag.cli.commands import parser
    from daskdag.cli.tls import security, write_certs

EXIT_OK, EXIT_NODE, EXIT_USAGE, EXIT_CLUSTER, EXIT_ITEMS_FAILED, EXIT_STORE = 0, 1, 2, 3, 4, 5
EXIT_INTERRUPTED = 130

EXIT_CODES = """exit codes:
  0    success (RESULT.npz written)
  1    a node failed (daskdag.NodeError: its message, and the hint if any), or
       an unexpected error (with its traceback)
  2    bad usage, DAG module or inputs (argparse errors, daskdag.DAGError, a
       module, attribute, file or npz key that is missing or wrong, an output
       that is not a scalar given no --cotangents)
  3    cluster problems: a scheduler that does not answer within --timeout,
       daskdag.ClusterError
  4    (sweep --errors collect) some items failed: RESULT.npz is written, with
       <output>.failed
  5    (--store) the store holds another call or sweep, or another is using
       it (daskdag.StoreError: what changed)
  130  interrupted (Ctrl-C)"""


class UsageError(Exception):
    """A bad command line, DAG module or input file: exit 2, its message on stderr."""


class Unreachable(Exception):
    """No scheduler answered: exit 3."""


def main(argv: Sequence[str] | None = None) -> int:
    """The ``daskdag`` command with the arguments ``argv`` (default: this process's); returns
    its exit code. ``daskdag --version`` answers before JAX, Dask and daskdag's modules are
    imported (which take seconds); every other command imports them first."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args in (["--version"], ["-V"]):
        print(f"daskdag {metadata.version('daskdag')}")
        return 0
    return importlib.import_module("daskdag.cli.commands").main(args)


def __getattr__(name: str) -> Any:
    where = {"parser": "daskdag.cli.commands", "security": "daskdag.cli.tls",
             "write_certs": "daskdag.cli.tls"}
    if name in where:
        return getattr(importlib.import_module(where[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["main", "parser", "security", "write_certs"]
