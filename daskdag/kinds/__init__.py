"""The derivative kinds, each a small strategy over one program
(:class:`~daskdag.running.passes.Derivative`): what it lowers to, as the table of
:mod:`daskdag.running.passes` says, and what its results are. Everything else, preparation
and reuse, stores, sweeps, placement, is written once below them.

- :mod:`~daskdag.kinds.gradients`: gradients (:class:`~daskdag.Result`);
- :mod:`~daskdag.kinds.jacobians`: full Jacobians (reverse, forward, sparse) and sparsity patterns;
- :mod:`~daskdag.kinds.tangents`: Jacobian-vector products (:class:`~daskdag.JVPResult`), and
  where every kind that pushes tangents lets them in;
- :mod:`~daskdag.kinds.hessians`: Hessian-vector products (:class:`~daskdag.HVPResult`).

May import: every layer below it (:mod:`daskdag.sweeps` and under). In: a call's DAG, inputs,
outputs and options. Out: its lowering, and its results from the passes'.
"""
