"""daskdag: values and gradients of a DAG of JAX functions, computed as one Dask graph.

>>> res = daskdag.compute_grads(dag, x, ["D", "E"])          # one input
>>> res["D"].value, res["D"].grad
>>> res = daskdag.sweep_grads(dag, xs, ["D", "E"])           # many, stacked
>>> res = daskdag.jacobian(dag, x, ["A", "B"])                # full Jacobians, as jax.jacrev
>>> daskdag.check_grads(dag, x, ["D", "E"])                   # each node's VJP against FD
"""

from .api import Result, compute_grads, jacobian, sweep_grads
from .checks import check_grads
from .errors import ClusterError, DAGError, GradientCheckError, NodeError
from .spec import Node

__all__ = ["compute_grads", "jacobian", "sweep_grads", "Node", "Result", "DAGError", "NodeError", "ClusterError",
           "check_grads", "GradientCheckError"]
__version__ = "0.1.0"
