"""check_grads from inside (daskdag.checks): each node checked in topological order, and what
each check costs, counted against ``checks.PROJECTIONS``."""

import daskdag
from daskdag.checks import PROJECTIONS
from daskdag.model.spec import parse

from .support.numbers import RTOL32


def test_seed_dag_passes_and_runs_each_node_once_forward(seed, x5):
    dag, f, _ = seed
    checked = daskdag.check_grads(dag, x5, ["D", "E"])
    assert list(checked) == [n for n in parse(dag).order]  # every node, in topological order
    assert all(0 <= r <= RTOL32 for r in checked.values()), checked
    # Calls per node, in its own check alone: once to linearize (which also gives the nodes
    # after it their value), and 2 evaluations per projection and differentiated dep (each
    # node here has one dep): 1 + 4, as check_grads says.
    assert {k: c.calls for k, c in f.items()} == {k: 1 + 2 * PROJECTIONS for k in f}
