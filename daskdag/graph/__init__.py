"""Stages and the Dask graph of a call: ``stages`` (nodes grouped into tasks), ``compiled``
(fused stages as compiled programs), ``dense`` (a backward pass as a dense Jacobian), ``tasks``
(the functions Dask runs: a stage's forward pass and its pullback, its backward pass, a gradient),
``assembly`` (task keys, ``Intake``, ``TaskGraph``), ``build`` (the graph of a call),
``sparsity`` (a DAG's Jacobian patterns), ``whole`` (a call as one jitted program).

May import: :mod:`daskdag.errors`, :mod:`daskdag.config`, :mod:`daskdag.cancel`,
:mod:`daskdag.caches`, :mod:`daskdag.transport`, :mod:`daskdag.model`, :mod:`daskdag.rules`.
"""
