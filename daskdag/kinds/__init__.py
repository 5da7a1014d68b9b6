"""The derivative kinds, each a small strategy over one program
(:class:`~daskdag.running.passes.Derivative`): what it lowers to, and what its results are.
``gradients`` (:class:`~daskdag.Result`), ``jacobians`` (full Jacobians, sparsity patterns,
their layout), ``tangents`` (JVPs, and where tangents enter), ``hessians`` (HVPs).

May import: every layer below it (:mod:`daskdag.sweeps` and under).
"""
