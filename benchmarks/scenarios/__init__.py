"""The benchmark scenarios, one module each, listed in :data:`NAMES` in report order.

Each module declares its scenario, once, and the runner (``benchmarks/__main__.py``) and the
report (``benchmarks/report.py``) read the declarations:

``TITLE``            its heading in the report (the runner's results carry it too).
``DESCRIPTION``      one line, what it measures against what: the runner's ``--help`` lists it.
``CLUSTERS``         the runner's clusters (keys of ``common.CLUSTERS``) that are up while it
                     runs, or None. The runner starts the union of those of the scenarios it
                     runs, runs those scenarios (in :data:`NAMES`' order) with ``clients``
                     ``{name: distributed.Client}`` of every cluster it started, closes them,
                     then runs the scenarios of ``CLUSTERS = None`` with ``clients`` ``{}``:
                     those start their own clusters or run on this process's threads.
``run(quick, clients)``  measures; returns its results (``{"title", "config", "cases",
                     "targets", ...}``, each case as ``common.case`` makes it).
``section(s)``       optional: its Markdown section, from its results ``s``; without one, the
                     report's generic tables (``report.generic``).
``plot(s, axes)``    optional, with ``PLOT_AXES``: its figure, on ``PLOT_AXES`` axes in a row;
                     without one, the report's generic bar plot (``report.generic_plot``).
``RATIO_NOTE``       optional: a clause the report adds to its rule for reading ratios.

Importing this package imports no scenario: :func:`load` imports one when it is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

NAMES = ("k_heads", "multi_head", "overhead", "sweeps", "large_sweep", "portable", "jacobians",
         "sparse_jacobians", "custom_nodes", "tiny_nodes", "scale_out", "remat",
         "repeat_calls", "durable_sweeps", "shared_work", "durable_calls", "implicit",
         "import_time")


def present(name: str) -> bool:
    """Whether ``name`` is a scenario of :data:`NAMES` whose module is there."""
    return name in NAMES and importlib.util.find_spec(f"{__name__}.{name}") is not None


def load(name: str) -> ModuleType | None:
    """Scenario ``name``'s module, or None where it is not one of :data:`NAMES` or its module
    is not there (the runner then skips it, and says so)."""
    return importlib.import_module(f"{__name__}.{name}") if present(name) else None
