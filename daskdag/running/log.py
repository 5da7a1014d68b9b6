"""What daskdag logs under the logger ``"daskdag"``: each call and sweep at INFO, tasks at DEBUG."""

from __future__ import annotations

import logging

import jax

from daskdag.graph.assembly import kind_of, runs
from daskdag.graph.whole import OneTask
from daskdag.running.local import Filled

logger = logging.getLogger("daskdag")
logger.addHandler(logging.NullHandler())


def submitted(kind: str, plan, graph: dict, where: str, placed: int | None = None) -> None:
    """Log one call's graph as it goes to ``where``, with the bytes it ``placed`` there."""
    if not logger.isEnabledFor(logging.INFO):
        return
    tasks = _tasks(graph)
    stages = sum(1 for k in tasks if kind_of(k) in ("fwd", "jvp"))
    logger.info("%s: outputs %s, wrt %s: %d stages, %d tasks, on %s%s", kind, list(plan.outputs),
                list(plan.wrt), stages, len(tasks), where,
                "" if placed is None else f"; placed {placed} bytes on the cluster")
    if logger.isEnabledFor(logging.DEBUG):
        for key, task in tasks.items():
            fn = runs(task)
            logger.debug("  task %s: %s", key, getattr(fn, "__qualname__", type(task).__name__))


def ran_whole(kind: str, plan, where: str) -> None:
    """Log one call run as one program (:mod:`daskdag.graph.whole`) at ``where``."""
    logger.info("%s: outputs %s, wrt %s: one program, on %s", kind, list(plan.outputs),
                list(plan.wrt), where)


def reused(kind: str, nodes) -> None:
    """Log the nodes whose values a call took from the call before."""
    logger.info("%s: nodes %s reused from the call before (their inputs are the same)", kind,
                list(nodes))


def _tasks(graph) -> dict:
    if isinstance(graph, Filled):
        return graph.dsk
    if isinstance(graph, OneTask):
        return {graph.key: graph}
    merged = {}
    for delayed in jax.tree.leaves(graph):  # (Delayed objects are leaves to JAX)
        merged.update({k: v for layer in delayed.dask.layers.values() for k, v in layer.items()})
    return merged
