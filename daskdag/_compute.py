"""Running one call's graph: on Dask's local scheduler or a ``distributed`` client, with an
optional progress bar over its tasks, and leaving nothing running when interrupted.

Ctrl-C: Dask's local scheduler hands a task to a thread only when one is free, so once the
interrupt leaves its loop no further task starts, and the stages running in the background stop
at their next node (the call's ``stop`` event). On a cluster the call's futures are released, so
the scheduler cancels every task of the call that no other call wants, and a running stage
stops at its next node (:func:`daskdag._progress.dropped`).
"""

from __future__ import annotations

import contextlib

import dask
import distributed
import jax
from dask.diagnostics import ProgressBar


def compute(graph: dict, client, progress: bool = False, stop=None, local: str | None = None) -> dict:
    """``graph`` (``{output: (value, {input: grad})}`` of ``Delayed``) computed, same structure:
    on ``client``, else on Dask's ``local`` scheduler (``"threads"``, ``"sync"``) in this
    process, whatever default client exists. ``stop``: the ``daskdag._progress.Stop`` a local
    graph's stages watch; set when the call ends early."""
    if client is None:
        try:
            with ProgressBar() if progress else contextlib.nullcontext():
                (computed,) = dask.compute(graph, scheduler=local or "threads")
        except BaseException:  # Ctrl-C, or a failed node: running stages stop at their next node
            if stop is not None:
                stop.set()
            raise
        return computed
    delayed, structure = jax.tree.flatten(graph)  # Delayed objects are leaves to JAX
    futures = client.compute(delayed)
    try:
        if progress:  # the text bar, which blocks until the tasks finish or one fails: in a
            # notebook the widget would return at once and, not being displayed, show nothing
            distributed.progress(futures, scheduler=client.scheduler.address, notebook=False)
        return jax.tree.unflatten(structure, client.gather(futures))
    finally:  # early (Ctrl-C, a failed node): free the scheduler of this call's tasks now
        for f in futures:
            f.release()
