"""The user's model, checked before anything runs: the DAG as a spec of nodes (``spec``,
``custom``, ``implicit``, ``devices``), which leaves are differentiated (``leaves``), which nodes a
call runs (``plan``), shapes traced abstractly (``shapes``), sparse Jacobians' patterns and
colours (``patterns``, ``colouring``), Jacobians laid out (``jacobian_layout``), and one check of
every entry point's arguments (``request``); else a :class:`~daskdag.DAGError` naming the culprit.

May import: :mod:`daskdag.errors`, :mod:`daskdag.config`, :mod:`daskdag.cancel`,
:mod:`daskdag.caches`, :mod:`daskdag.transport`.
"""
