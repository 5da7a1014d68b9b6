"""Differentiation rules: how each kind of node runs under vjp and jvp.

- :mod:`~daskdag.rules.pullback`: the pullback protocol every backward half follows;
- :mod:`~daskdag.rules.vjp`, :mod:`~daskdag.rules.jvp`: JAX's own rules, leaf by leaf;
- :mod:`~daskdag.rules.custom`: the user's own rules (``Node(vjp=...)``, ``fwd``/``bwd``, ``jvp``);
- :mod:`~daskdag.rules.registry`: one registry of the rules, by the kind of a node's function;
- :mod:`~daskdag.rules.seeds`: where cotangents start (seeds, a Jacobian's rows) and their sums;
- :mod:`~daskdag.rules.remat`: a ``remat`` node's pullback, which redoes its forward pass;
- :mod:`~daskdag.rules.sparsity`: a function's Jacobian sparsity pattern, read off its jaxpr;
- :mod:`~daskdag.rules.finite_differences`: a node's VJP checked against central differences
  (the numerics of :mod:`daskdag.checks`).

May import: :mod:`daskdag.errors`, :mod:`daskdag.config`, :mod:`daskdag.cancel`,
:mod:`daskdag.caches`, :mod:`daskdag.transport`, :mod:`daskdag.model`. In: a node, its args,
which are differentiated. Out: primals and pullbacks (or tangents).
"""

from daskdag.rules import custom  # (registers the user's rules)

__all__ = ["custom", "finite_differences", "jvp", "pullback", "registry", "remat", "seeds",
           "sparsity", "vjp"]
