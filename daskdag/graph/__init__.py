"""Stages and the Dask graph of a call.

- :mod:`~daskdag.graph.stages`: a plan's nodes grouped into stages (chains, fused groups);
- :mod:`~daskdag.graph.run`: a stage's forward pass, and the pullback it leaves;
- :mod:`~daskdag.graph.compiled`: a fused stage as compiled programs (``jit``, ``vmap``);
- :mod:`~daskdag.graph.tasks`: the functions Dask runs: forward, backward, gradient tasks;
- :mod:`~daskdag.graph.assembly`: task keys, how a graph takes in its values (``Intake``), the
  task graph itself; every builder assembles its graph from these;
- :mod:`~daskdag.graph.build`: the graph of a call (reverse mode, Jacobians), seeded by a
  ``GradientSeeding`` or a ``JacobianSeeding``;
- :mod:`~daskdag.graph.forward`: the graph of a call in forward mode;
- :mod:`~daskdag.graph.sparsity`: a DAG's Jacobian sparsity patterns, composed node by node;
- :mod:`~daskdag.graph.whole`: a call that is one closed fused stage as one jitted program (one
  dispatch in this process, one task on a cluster: ``OneTask``).

May import: :mod:`daskdag.errors`, :mod:`daskdag.config`, :mod:`daskdag.cancel`,
:mod:`daskdag.caches`, :mod:`daskdag.transport`, :mod:`daskdag.model`, :mod:`daskdag.rules`. In:
a plan, input values, cotangents (or tangents). Out: ``{output: (value, {name: grad})}`` of
``Delayed`` sharing one graph (nothing runs until Dask runs it), or a whole program.
"""
