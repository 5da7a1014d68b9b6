"""Which tests run where: the markers that ``make test-fast`` selects by, and the groups that
``pytest-xdist`` shares the two cores by (``make test``: ``-n 2 --dist loadgroup``).

- A test that starts or uses a distributed cluster is marked ``cluster``: by hand, or here when
  it asks for one of :data:`CLUSTER_FIXTURES`, or, for a fence of the docs, when its code
  starts one (:data:`CLUSTER_CODE`). A test that starts any other process (a child interpreter,
  a command, Dask's multiprocessing scheduler) is marked ``subprocess``: by hand, or here by
  :data:`SUBPROCESS_FIXTURES` and :data:`SUBPROCESS_CODE`. ``make test-fast`` leaves both out,
  and ``bench``.
- ``make test`` shares the two cores by file (``-n 2 --dist loadgroup``: each file an xdist
  group, so a module's fixtures, its cluster among them, are made once): a worker runs a file
  whole, then takes the next, the longest first as their tests' timeouts estimate it
  (:func:`estimate`), so that no long file is left for the end. (pytest-xdist's own
  ``loadgroup`` reads the groups from suffixes of the node ids, which pytest 9.2's node ids no
  longer take: pytest-xdist issue 1386. So each worker writes its groups to a file of the run,
  :func:`write_groups`, and :func:`make_scheduler`'s scheduler reads them.)
- The markers are held by what the tests do: a test marked neither ``cluster`` nor
  ``subprocess`` that starts a process (``subprocess.Popen``, a ``multiprocessing`` process: a
  cluster's nanny, a process pool) fails at teardown, naming what it started
  (:func:`watch_processes`, :func:`unmarked_processes`).
"""

from __future__ import annotations

import json
import multiprocessing.process
import subprocess
import threading
from pathlib import Path

import pytest

#: Fixtures that give a test a cluster (``tests/conftest.py`` and the test modules').
CLUSTER_FIXTURES = frozenset({"cluster", "client", "cli_cluster", "cli_client",
                              "restarting_cluster", "fresh_client", "compose_cluster",
                              "tls_cluster", "slurm_daemons"})

#: Fixtures that start other processes for a test: the commands of ``test_cli.py`` started at
#: once, ``daskdag certs``, wheels built, a copy of JAX (``python -m pip``), a process pool.
SUBPROCESS_FIXTURES = frozenset({"launched", "certs", "wheels", "jax_on_pythonpath",
                                 "processes"})

#: What a docs fence that starts a cluster calls.
CLUSTER_CODE = ("LocalCluster(", "Client(")

#: What a docs fence that starts other processes asks for (``.visualize(`` runs ``dot``).
SUBPROCESS_CODE = ('scheduler="processes"', ".visualize(")

#: The markers that say a test starts processes.
PROCESS_MARKERS = ("cluster", "subprocess")


def mark(items: list) -> None:
    """Add the ``cluster`` and ``subprocess`` markers this module infers, and each item's xdist
    group (its file)."""
    for item in items:
        code = getattr(item, "code", None)  # (pytest-markdown-docs' fences carry their source)
        code = code if isinstance(code, str) else ""
        fixtures = set(getattr(item, "fixturenames", ()))
        if CLUSTER_FIXTURES & fixtures or any(c in code for c in CLUSTER_CODE):
            item.add_marker(pytest.mark.cluster)
        elif SUBPROCESS_FIXTURES & fixtures or any(c in code for c in SUBPROCESS_CODE):
            item.add_marker(pytest.mark.subprocess)
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


# -- the groups, as the xdist workers collected them --------------------------------------------

#: The key of ``workerinput`` that names the folder where workers write their groups.
GROUPS = "daskdag_groups"


#: What a test without a timeout of its own is estimated to take (seconds).
UNTIMED = 5.0


def group_of(item) -> str:
    """``item``'s xdist group (:func:`mark` gave it one)."""
    return item.get_closest_marker("xdist_group").args[0]


def estimate(item) -> float:
    """How long ``item`` may take, for ordering alone: its ``timeout`` marker, else
    :data:`UNTIMED` (a test that may run long says so with its timeout)."""
    timeout = item.get_closest_marker("timeout")
    return float(timeout.args[0]) if timeout and timeout.args else UNTIMED


def write_groups(config, items: list) -> None:
    """On an xdist worker: ``items`` in their groups, the groups longest first (the sum of their
    tests' :func:`estimate`; a group's tests in their order), and ``{node id: group}`` written
    into the run's groups folder for :func:`make_scheduler`."""
    folder = getattr(config, "workerinput", {}).get(GROUPS)
    if not folder:
        return
    cost: dict[str, float] = {}
    for item in items:
        cost[group_of(item)] = cost.get(group_of(item), 0.0) + estimate(item)
    items.sort(key=lambda item: -cost[group_of(item)])  # (stable: in a group, as collected)
    path = Path(folder) / f"{config.workerinput['workerid']}.json"
    path.with_suffix(".tmp").write_text(json.dumps({item.nodeid: group_of(item)
                                                    for item in items}))
    path.with_suffix(".tmp").replace(path)  # (whole, or not there)


def make_scheduler(config, log, folder: Path):
    """xdist's scheduling by scope, each group a scope, in the order the workers collected them
    (:func:`write_groups`): a worker runs a group whole, then takes the next."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # (read once every worker has collected)
                self.groups = {}
                for path in sorted(folder.glob("*.json")):
                    self.groups.update(json.loads(path.read_text()))
            return self.groups.get(nodeid) or nodeid.split("::")[0]

    config.option.loadscopereorder = False  # (the order of the collection: longest first)
    return GroupScheduling(config, log)


# -- the processes a test starts -------------------------------------------------------------------

_started: list[str] = []  # what this process started, in order (a description each)
_lock = threading.Lock()


def _note(what: str) -> None:
    with _lock:
        _started.append(what)


def watch_processes() -> None:
    """From now on, note every process this one starts (once per process)."""
    if getattr(subprocess.Popen, "_daskdag_watched", False):
        return
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    start = multiprocessing.process.BaseProcess.start

    def noted_execute_child(self, args, *rest, **kw):
        _note(" ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args))
        return execute_child(self, args, *rest, **kw)

    def noted_start(self):
        _note(f"a multiprocessing process ({self.name})")
        return start(self)

    subprocess.Popen._execute_child = noted_execute_child  # type: ignore[attr-defined]
    subprocess.Popen._daskdag_watched = True  # type: ignore[attr-defined]
    multiprocessing.process.BaseProcess.start = noted_start  # type: ignore[method-assign]


def started() -> int:
    """How many processes this one started so far (a mark to compare with)."""
    return len(_started)


def unmarked_processes(item, since: int) -> str | None:
    """Why ``item`` fails, if it started processes since ``since`` (:func:`started`) and carries
    neither ``cluster`` nor ``subprocess``; else None."""
    if any(item.get_closest_marker(m) for m in PROCESS_MARKERS):
        return None
    with _lock:
        new = _started[since:]
    if not new:
        return None
    shown = "\n".join(f"  {what[:200]}" for what in new[:5])
    return (f"{item.nodeid} started {len(new)} process(es) but is marked neither `cluster` nor "
            f"`subprocess` (make test-fast would run it):\n{shown}\nMark it "
            f"@pytest.mark.cluster (it starts or uses a cluster) or @pytest.mark.subprocess.")
