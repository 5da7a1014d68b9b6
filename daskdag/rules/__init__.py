"""Differentiation rules: how each kind of node runs under vjp and jvp. Reverse mode (``vjp``:
the pullback protocol, one registry of rules by the kind of a node's function, remat, JAX's
rule, where cotangents start), forward mode (``jvp``, ``lifted``), the user's rules
(``custom``), Jacobian sparsity read off a jaxpr (``sparsity``), finite differences
(``finite_differences``).

May import: :mod:`daskdag.errors`, :mod:`daskdag.config`, :mod:`daskdag.cancel`,
:mod:`daskdag.caches`, :mod:`daskdag.transport`, :mod:`daskdag.model`.
"""

from daskdag.rules import custom  # (registers the user's rules)

__all__ = ["custom", "finite_differences", "jvp", "sparsity", "vjp"]
