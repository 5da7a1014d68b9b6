"""daskdag: values and gradients of a DAG of JAX functions, computed as one Dask graph.

>>> res = daskdag.compute_grads(dag, x, ["D", "E"])          # one input
>>> res["D"].value, res["D"].grad
>>> res = daskdag.sweep_grads(dag, xs, ["D", "E"])           # many, stacked
>>> res = daskdag.jacobian(dag, x, ["A", "B"])                # full Jacobians, as jax.jacrev
>>> res = daskdag.compute_jvps(dag, x, v, ["D", "E"])        # forward mode: res["D"].tangent
>>> res = daskdag.compute_hvps(dag, x, v, ["D", "E"])        # Hessian-vector products: .hvp
>>> daskdag.check_grads(dag, x, ["D", "E"])                   # each node's VJP against FD
>>> daskdag.check_totals(dag, x, ["D", "E"])                  # the outputs' gradients against FD
>>> call = daskdag.grads(dag, x, ["D", "E"])                  # lazy: a Dask collection
>>> dask.compute(call, other_dask_work)
>>> f = daskdag.value_and_grad(dag, "D")                        # prepared once, called many times
>>> value, grad = f(x)
>>> values, grads = f.sweep(xs)                                 # over many items, stacked
"""

from __future__ import annotations

import importlib as _importlib
import threading as _threading
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

# daskdag's settings join Dask's defaults now, before a `dask.config.set` of one of them can run:
# on leaving that block Dask restores what it found, which must already hold the others.
from daskdag import config as _config  # noqa: E402,F401  (dask.config and yaml only)

if TYPE_CHECKING:  # (what the names are; they are imported when first asked for: _load)
    from daskdag.api import (compute_grads, compute_hvps, compute_jvps, grads, hvps, jacobian,
                             jacobian_sparsity, jacobians, jvps, sweep_grads, sweep_hvps,
                             sweep_jacobians, sweep_jvps)
    from daskdag.kinds.gradients import Result
    from daskdag.kinds.hessians import HVPResult
    from daskdag.kinds.tangents import JVPResult
    from daskdag.checks import check_grads, check_totals
    from daskdag.caches import clear_caches
    from daskdag.running.jobs import CallInfo
    from daskdag.prepared import (Prepared, grad, value_and_grad, value_and_jacobian,
                                  value_and_jvp, value_grad_and_hvp)
    from daskdag.errors import (ClusterError, DAGError, GradientCheckError, NodeError, SolveError,
                                StoreError, TotalCheckError)
    from daskdag.running.lazy import Call
    from daskdag.model.spec import Node
    from daskdag.model.implicit import Implicit, coupled
    from daskdag.sweeps.store import SweepStore

# Where each public name is defined. `import daskdag` imports none of them (nor JAX's, Dask's
# or distributed's modules that they need): the first public name asked for imports them all
# (_load), so that `import daskdag` and `daskdag --version` stay fast.
_WHERE = {
    "daskdag.api": ("compute_grads", "grads", "sweep_grads", "jacobian", "jacobians",
                    "sweep_jacobians", "jacobian_sparsity", "compute_jvps", "jvps", "sweep_jvps",
                    "compute_hvps", "hvps", "sweep_hvps"),
    "daskdag.kinds.gradients": ("Result",),
    "daskdag.kinds.tangents": ("JVPResult",),
    "daskdag.kinds.hessians": ("HVPResult",),
    "daskdag.checks": ("check_grads", "check_totals"),
    "daskdag.caches": ("clear_caches",),
    "daskdag.running.jobs": ("CallInfo",),
    "daskdag.prepared": ("Prepared", "grad", "value_and_grad", "value_and_jacobian",
                         "value_and_jvp", "value_grad_and_hvp"),
    "daskdag.errors": ("ClusterError", "DAGError", "GradientCheckError", "NodeError",
                       "SolveError", "StoreError", "TotalCheckError"),
    "daskdag.running.lazy": ("Call",),
    "daskdag.model.spec": ("Node",),
    "daskdag.model.implicit": ("Implicit", "coupled"),
    "daskdag.sweeps.store": ("SweepStore",),
}
# The public names are daskdag's, wherever they are defined (reprs, docs, pickles by reference).
_RENAMED = ("JVPResult", "HVPResult", "Result", "Call", "Node", "Implicit", "coupled",
            "SolveError", "ClusterError", "DAGError",
            "GradientCheckError", "NodeError", "StoreError", "TotalCheckError", "CallInfo",
            "Prepared", "SweepStore")
_lock = _threading.RLock()


def _load() -> None:
    """Import every public name into this module (once)."""
    with _lock:
        if "compute_grads" in globals():
            return
        found = {}
        for module, names in _WHERE.items():
            imported = _importlib.import_module(module)
            found.update({n: getattr(imported, n) for n in names})
        for n in _RENAMED:
            found[n].__module__ = __name__
        globals().update(found)


def __getattr__(name: str) -> Any:
    if name in __all__:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = ["compute_grads", "jacobian", "compute_jvps", "compute_hvps", "grads", "jacobians",
           "jvps", "hvps", "sweep_grads", "sweep_jacobians", "sweep_jvps", "sweep_hvps",
           "jacobian_sparsity", "check_grads", "check_totals", "grad", "value_and_grad",
           "value_and_jacobian", "value_and_jvp", "value_grad_and_hvp", "Prepared", "Call",
           "Node", "Implicit", "coupled", "Result", "JVPResult", "HVPResult", "CallInfo",
           "DAGError", "NodeError", "SolveError", "ClusterError", "StoreError",
           "GradientCheckError", "TotalCheckError", "clear_caches", "SweepStore"]
# One source: pyproject.toml's version, as installed (the key checked across a cluster's workers).
__version__ = _metadata.version("daskdag")
