"""For every test of the repository, the fences of README.md and docs/ included: JAX with four
CPU devices; a fence that needs a program this machine lacks is skipped, saying which, as the
tests that need it are; the markers and xdist groups of ``tests/support/selection.py``, and a
test that starts a process unmarked fails; distributed's profiler and event-loop watch slowed
in every process the tests start (:data:`QUIET`), and one JAX compilation cache shared by them
(:data:`COMPILATION_CACHE`)."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.support")  # (before the import below)
from tests.support import clusters, selection  # noqa: E402

# Four CPU devices for JAX, here and in the cluster workers the tests start (they inherit the
# environment), so that placement on devices is tested on any machine; set before JAX starts.
_DEVICES = "--xla_force_host_platform_device_count=4"
if _DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}".strip()

# distributed's diagnostics that run while a cluster idles: the statistical profiler of each
# worker's threads (every 10 ms) and the check of each event loop's ticks (every 20 ms); they
# cost an idle 2-worker LocalCluster about 0.12 of a core, 0.045 without. They feed the
# dashboard and the "event loop was unresponsive" warnings, nothing a test reads. Set for this
# process and, through the environment, every process the tests start (before dask reads it).
QUIET = {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
         "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "1s"}
for _name, _value in QUIET.items():
    os.environ.setdefault(_name, _value)

# One JAX persistent compilation cache for the test run, in .jax-cache/ (what ``make clean``
# removes), every program in it however quick its compilation: each process the tests start
# (xdist workers, cluster workers, fresh interpreters) loads what another one compiled, and a
# later run what this one did. A program is found by its HLO, options and JAX version, so a
# change of code compiles anew. Set for this process and, through the environment, every process
# the tests start (before JAX reads it).
COMPILATION_CACHE = {
    "JAX_COMPILATION_CACHE_DIR": str(Path(__file__).resolve().parent / ".jax-cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
for _name, _value in COMPILATION_CACHE.items():
    os.environ.setdefault(_name, _value)

# program -> what a fence that needs it calls
NEEDS = {"dot": ".visualize("}
INSTALL = {"dot": "graphviz's `dot` program is not installed (apt-get install graphviz)"}


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """The markers and groups of :mod:`selection` first, then the other plugins' changes, then,
    on an xdist worker, the groups written for the scheduler (:func:`selection.write_groups`)."""
    selection.mark(items)
    skip_what_needs_a_missing_program(items)
    result = yield
    selection.write_groups(config, items)
    return result


def skip_what_needs_a_missing_program(items):
    missing = {program: INSTALL[program] for program in NEEDS if shutil.which(program) is None}
    for item in items:
        code = getattr(item, "code", None)  # (pytest-markdown-docs' fences carry their source)
        for program, reason in missing.items():
            if isinstance(code, str) and NEEDS[program] in code:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_markdown_docs_globals():
    """A fence runs as a saved script does: ``__name__`` is ``"__main__"``, so the code under
    ``if __name__ == "__main__":`` (a cluster's creation) runs too."""
    return {"__name__": "__main__"}


_STARTED = pytest.StashKey[int]()


def pytest_configure(config):
    selection.watch_processes()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # (before the first test's fixtures, under pytest's capture, which forked workers' output
    # then goes to as a spawned worker's does)
    clusters.fork_workers()
    item.stash[_STARTED] = selection.started()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test's teardown fails when the test started a process unmarked (:mod:`selection`)."""
    report = yield
    if call.when == "teardown" and report.passed and _STARTED in item.stash:
        why = selection.unmarked_processes(item, item.stash[_STARTED])
        if why:
            report.outcome, report.longrepr = "failed", why
    return report


_GROUPS = pytest.StashKey[Path]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(pytest-xdist, on the controller) Where this run's workers write their groups."""
    config = node.config
    if _GROUPS not in config.stash:
        config.stash[_GROUPS] = Path(tempfile.mkdtemp(prefix="daskdag-groups-"))
    node.workerinput[selection.GROUPS] = str(config.stash[_GROUPS])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: :func:`selection.make_scheduler` (xdist's own one does not group
    under pytest 9.2)."""
    if config.getvalue("dist") == "loadgroup":
        return selection.make_scheduler(config, log, config.stash[_GROUPS])
    return None


def pytest_unconfigure(config):
    if _GROUPS in config.stash:
        shutil.rmtree(config.stash[_GROUPS], ignore_errors=True)
