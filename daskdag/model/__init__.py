"""The user's model, checked before anything runs: the DAG as a spec of nodes (``spec``,
``implicit``, ``devices``), which leaves are differentiated and their shapes traced abstractly
(``leaves``), which nodes a call runs (``plan``), sparse Jacobians' patterns and colours
(``colouring``), and one check of every entry point's arguments (``request``); else a
:class:`~daskdag.DAGError` naming the culprit.

May import: :mod:`daskdag.errors`, :mod:`daskdag.config`, :mod:`daskdag.cancel`,
:mod:`daskdag.caches`, :mod:`daskdag.transport`.
"""
