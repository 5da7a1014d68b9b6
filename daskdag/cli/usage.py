"""What the command line says when it stops: its exit codes, and the two errors of its own
(the rest are daskdag's: :mod:`daskdag.errors`)."""

from __future__ import annotations

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
