"""A call as a Dask collection (:class:`Call`), computed later, alone or with other Dask work."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, Callable

import dask
import dask.threaded
from dask.base import DaskMethodsMixin, get_scheduler
from dask.highlevelgraph import HighLevelGraph

from daskdag.running import cluster
from daskdag.graph.assembly import kind_of
from daskdag.model.plan import Plan
from daskdag.running.programs import is_client
from daskdag.transport import protocol
from daskdag.transport.scope import JaxSettings, within


class Call(DaskMethodsMixin):
    """One call of [`daskdag.grads`][daskdag.grads], [`daskdag.jacobians`][daskdag.jacobians]
    or [`daskdag.jvps`][daskdag.jvps], not computed yet. ``outputs``: the outputs it computes;
    ``wrt``: what their gradients (or tangents) are taken with respect to. ``.compute()``
    returns ``{output: Result}`` (one ``Result`` for a single output name), as the eager
    function does."""

    __slots__ = ("_dask", "_name", "_keys", "_finish", "_plan", "_persisted_", "_keep")

    def __init__(self, dsk: Any, keys: list, finish: Callable[[dict], Any], plan: Plan, name: str,
                 persisted: bool = False, keep: Any = None) -> None:
        self._dask, self._keys, self._finish, self._plan, self._name = dsk, keys, finish, plan, name
        self._persisted_ = persisted  # its results are computed and held (dask.persist)
        self._keep = keep  # the DAG's entries: their functions live while the call does

    @classmethod
    def of(cls, plan: Plan, built: dict, finish: Callable[[dict], Any], keep: Any = None
           ) -> "Call":
        """From a built graph and ``finish`` (of its results); ``keep``: what it keeps alive."""
        keys = [k for value, grads in built.values()
                for k in (value.key, *(g.key for g in grads.values()))]
        structure = [(o, list(grads)) for o, (_, grads) in built.items()]
        dsk = next(iter(built.values()))[0].dask  # (one graph, which they all share)
        return cls(dsk, keys, _Finish(structure, finish), plan, f"daskdag-call-{keys[0]}",
                   keep=keep)

    @property
    def outputs(self) -> tuple[str, ...]:
        return self._plan.outputs

    @property
    def wrt(self) -> tuple[str, ...]:
        return self._plan.wrt

    # -- the collection protocol -------------------------------------------------------------

    def __dask_graph__(self) -> HighLevelGraph:
        if "distributed.protocol" in sys.modules:  # (any client may compute it, not only the
            protocol.with_distributed()  # default: its results' classes are deserialized here)
        client = getattr(get_scheduler(), "__self__", None)  # (the client computing now would use)
        if is_client(client):  # (distributed calls no __dask_optimize__: this is the last place)
            cluster.check(client, self._plan)
        if isinstance(self._dask, HighLevelGraph):
            return self._dask
        return HighLevelGraph.from_collections(self._name, self._dask, dependencies=())

    def __dask_keys__(self) -> list:
        return list(self._keys)

    def __dask_layers__(self) -> tuple:
        return tuple(self._dask.layers) if isinstance(self._dask, HighLevelGraph) else (self._name,)

    def __dask_tokenize__(self) -> tuple:
        return "daskdag.Call", tuple(self._keys)  # content keys already

    __dask_scheduler__ = staticmethod(dask.threaded.get)

    @staticmethod
    def __dask_optimize__(dsk: Any, keys: Any, **kwargs: Any) -> Any:
        return dsk  # (daskdag's graph is built already fused into stages)

    def __dask_postcompute__(self) -> tuple:
        return self._finish, ()

    def __dask_postpersist__(self) -> tuple:
        return self._persisted, ()

    def _persisted(self, dsk: Any, *, rename: dict | None = None) -> "Call":
        keys = [rename.get(k, k) for k in self._keys] if rename else self._keys
        return Call(dsk, keys, self._finish, self._plan, self._name, persisted=True,
                    keep=self._keep)

    def visualize(self, filename: str | None = "daskdag",  # type: ignore[override]
                  format: str | None = None, **kwargs: Any) -> Any:
        """Dask's picture of the graph (needs graphviz: ``pip install 'daskdag[viz]'`` and the
        ``dot`` program), one shape per task, labelled by its key less its token
        (``fwd:A+B``: stage A+B's forward task), forward tasks blue and backward ones orange.
        ``filename``, ``format`` and other keywords as for ``dask.visualize``."""
        tasks = {k: {"label": k.rsplit("-", 1)[0], "style": "filled",
                     "fillcolor": "#f6c89f" if kind_of(k) in ("bwd", "grad") else "#b9d3ee"}
                 for k in dict(self._dask)}  # (its keys; dask.visualize asks for the graph)
        kwargs.setdefault("function_attributes", tasks)
        kwargs.setdefault("collapse_outputs", True)
        return dask.visualize(self, filename=filename, format=format, **kwargs)

    def __repr__(self) -> str:
        n = len(self._dask) if not isinstance(self._dask, HighLevelGraph) else sum(
            len(layer) for layer in self._dask.layers.values())
        state = "persisted" if self._persisted_ else "not computed"
        return (f"daskdag.Call(outputs={list(self.outputs)}, wrt={list(self.wrt)}, {n} tasks, "
                f"{state})")


class _Finish:
    """``finish`` of a :class:`Call`'s computed values, back in their structure, under the
    JAX settings of the thread that made it."""

    def __init__(self, structure: list, finish: Callable[[dict], Any]) -> None:
        self.structure, self.finish = structure, finish
        self.settings = JaxSettings.current()

    def __call__(self, results: Iterable[Any]) -> Any:
        it = iter(results)
        computed = {o: (next(it), {n: next(it) for n in names}) for o, names in self.structure}
        return within(self.settings, self.finish, computed)
