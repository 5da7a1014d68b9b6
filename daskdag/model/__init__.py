"""The user's model: what a call asks for, checked, before anything runs.

- :mod:`~daskdag.model.spec`: the DAG dict validated into a :class:`~daskdag.model.spec.Spec` of
  :class:`~daskdag.Node` s;
- :mod:`~daskdag.model.custom`: a node outside JAX with its own derivative rules, as given;
- :mod:`~daskdag.model.leaves`: which leaves of a value are differentiated;
- :mod:`~daskdag.model.plan`: which nodes a call runs, and which run under vjp;
- :mod:`~daskdag.model.shapes`: the shapes of its values, traced abstractly;
- :mod:`~daskdag.model.colouring`: a sparse Jacobian's rows or columns grouped by colour;
- :mod:`~daskdag.model.patterns`: a sparse Jacobian's patterns as the user gives them, checked,
  and their colours;
- :mod:`~daskdag.model.jacobian_layout`: a Jacobian's results laid out as ``jax.jacrev`` does,
  or as ``scipy.sparse`` blocks;
- :mod:`~daskdag.model.request`: one check of every entry point's arguments (and the CLI's).

May import: :mod:`daskdag.errors`, :mod:`daskdag.config`, :mod:`daskdag.cancel`,
:mod:`daskdag.caches`, :mod:`daskdag.transport`. In: the user's DAG, inputs, outputs and
options. Out: a spec, a plan, a request; or a :class:`~daskdag.DAGError` naming the culprit.
"""
