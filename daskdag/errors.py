"""The two errors a user meets: a bad DAG spec, and a node that failed while running."""

from __future__ import annotations


class DAGError(ValueError):
    """The DAG, its inputs, outputs or options are malformed. The message names the culprit."""


class NodeError(RuntimeError):
    """A node's function (or its pullback) raised. ``node`` names it, ``item`` the sweep item
    (else ``None``); the original exception is ``__cause__``.

    Picklable, cause included, so it survives the trip back from a ``distributed`` worker.
    """

    def __init__(self, node: str, phase: str, original: BaseException, item: int | None = None):
        hint = ""
        if type(original).__name__ == "ConcretizationTypeError":
            hint = (" (the node is differentiated with jax.vjp, so its inputs are tracers: "
                    "float(), int() and np.asarray() on them fail; "
                    "wrap the non-JAX part in jax.custom_vjp to give it its own VJP)")
        where = f"item {item}: " if item is not None else ""
        super().__init__(f"{where}node {node!r} failed in its {phase} pass: "
                         f"{type(original).__name__}: {original}{hint}")
        self.node, self.phase, self.original, self.item = node, phase, original, item
        self.__cause__ = original

    def __reduce__(self):
        return NodeError, (self.node, self.phase, self.original, self.item)


class ClusterError(RuntimeError):
    """The cluster cannot run this graph: versions that differ from the client's, or no worker
    offering a resource a node needs. The message names the workers or the node."""
