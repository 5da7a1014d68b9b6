"""Failed items' errors as a sweep keeps them: holding no stack frames (:func:`detached`), and
picklable (:func:`picklable`), so that they can come back from a worker and go into a store."""

from __future__ import annotations

import pickle
import traceback

from daskdag.errors import NodeError


def detached(e: NodeError, item: int | None) -> NodeError:
    """``e`` for ``item``, holding no stack frames: a traceback holds every local of the calls
    it came through (from a cluster, this sweep's own frames: its futures and arrays), which a
    kept error would keep alive. The original's traceback stays, as text in a note."""
    todo: list[BaseException | None]
    seen, todo = set(), [e.original]
    while todo:  # the original and the exceptions chained to it
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if x.__traceback__ is not None:
            x.add_note("Raised at (traceback kept as text):\n"
                       + "".join(traceback.format_tb(x.__traceback__)).rstrip())
            x.__traceback__ = None
        todo += [x.__cause__, x.__context__]
    return NodeError(e.node, e.phase, e.original, item=item)


def picklable(e: NodeError) -> NodeError:
    """``e``, or where what it holds cannot be pickled, the same error with its original
    exception's text alone."""
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return NodeError(e.node, e.phase, RuntimeError(f"{type(e.original).__name__}: "
                                                       f"{e.original}"), item=e.item)
