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
"""

from importlib import metadata as _metadata

from daskdag.api import Result, compute_grads, grads, sweep_grads
from daskdag.forward_mode import JVPResult, compute_jvps, jvps
from daskdag.hessians import HVPResult, compute_hvps, hvps
from daskdag.full_jacobians import jacobian, jacobian_sparsity, jacobians
from daskdag.checks import check_grads, check_totals
from daskdag.caches import clear_caches
from daskdag.running.jobs import CallInfo
from daskdag.transforms import (Prepared, value_and_grad, value_and_jacobian, value_and_jvp,
                                value_grad_and_hvp)
from daskdag.errors import (ClusterError, DAGError, GradientCheckError, NodeError, StoreError,
                            TotalCheckError)
from daskdag.running.lazy import Call
from daskdag.model.spec import Node
from daskdag.sweeps.store import SweepStore

# The public names are daskdag's, wherever they are defined (reprs, docs, pickles by reference).
for _public in (JVPResult, HVPResult, Result, Call, Node, ClusterError, DAGError, GradientCheckError,
                NodeError, StoreError, TotalCheckError, CallInfo, Prepared, SweepStore):
    _public.__module__ = __name__
del _public

__all__ = ["compute_grads", "jacobian", "compute_jvps", "sweep_grads", "check_grads",
           "grads", "jacobians", "jvps", "jacobian_sparsity", "compute_hvps", "hvps", "HVPResult", "Call", "Node", "Result", "JVPResult",
           "DAGError", "NodeError", "ClusterError", "StoreError", "GradientCheckError", "check_totals",
           "TotalCheckError", "value_and_grad", "value_and_jacobian", "value_and_jvp",
           "value_grad_and_hvp", "Prepared", "CallInfo", "clear_caches", "SweepStore"]
# One source: pyproject.toml's version, as installed (the key checked across a cluster's workers).
__version__ = _metadata.version("daskdag")
