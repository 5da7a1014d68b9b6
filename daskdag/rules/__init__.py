"""Differentiation rules: how each kind of node runs under vjp and jvp. JAX's own (``vjp``,
``jvp``, ``lifted``), the user's (``custom``), one registry of them by the kind of a node's
function (``registry``), the pullback protocol (``pullback``, ``remat``), where cotangents start
(``seeds``), Jacobian sparsity read off a jaxpr (``sparsity``), finite differences
(``finite_differences``).

May import: :mod:`daskdag.errors`, :mod:`daskdag.config`, :mod:`daskdag.cancel`,
:mod:`daskdag.caches`, :mod:`daskdag.transport`, :mod:`daskdag.model`.
"""

from daskdag.rules import custom  # (registers the user's rules)

__all__ = ["custom", "finite_differences", "jvp", "pullback", "registry", "remat", "seeds",
           "sparsity", "vjp"]
