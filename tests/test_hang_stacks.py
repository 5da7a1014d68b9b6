"""A cluster test that times out shows the stacks of every process (tests/support/hangs.py): the
client's, the scheduler's, each nanny's and worker's, each under a header of its own.

The cluster tests of tests/hang_child.py hang on purpose (a task that sleeps until its test
ends); each runs in a pytest of its own, both at once, and their failures are read here."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .support import hangs
from .support.clusters import eventually

ROOT = Path(__file__).resolve().parent.parent
CHILD = "tests/hang_child.py"
LOCAL = "test_a_task_on_a_local_cluster_never_ends"
CLI = "test_a_task_on_dask_cli_processes_never_ends"


def sections(output: str) -> list[tuple[str, str]]:
    """``(what, text)`` of each ``== stacks of <what> ==`` of ``output``: what follows its
    header, up to the next header or the end of the dump."""
    found = []
    parts = re.split(r"^== stacks of (.*) ==$", output, flags=re.MULTILINE)
    for what, text in zip(parts[1::2], parts[2::2]):
        found.append((what, text.split("+" * 40)[0]))
    return found


def only(found, prefix: str) -> list[tuple[str, str]]:
    return [(w, t) for w, t in found if w.startswith(prefix)]


def run_children(tmp_path, names, timeout: float) -> dict:
    """Run ``tests/hang_child.py::<name>`` for each of ``names``, each in a pytest of its own,
    all at once; ``{name: (exit code, output)}``. One still running after ``timeout`` s is
    killed, with its process group (the dask commands it started)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_TIMEOUT")}
    procs = {}
    for name in names:
        out = open(tmp_path / f"{name}.out", "w")
        procs[name] = (subprocess.Popen(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"{CHILD}::{name}"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True), out)
    deadline = time.monotonic() + timeout
    results = {}
    try:
        for name, (proc, out) in procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.close()
            results[name] = (proc.returncode, (tmp_path / f"{name}.out").read_text())
    finally:
        for proc, out in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.close()
    return results


@pytest.mark.cluster
@pytest.mark.timeout(150)
def test_a_cluster_test_that_times_out_shows_the_stacks_of_every_process(tmp_path):
    """Each process under a header of its own, before pytest-timeout fails the test: the worker's
    thread in the task that never ends, the scheduler's event loop, the client waiting."""
    results = run_children(tmp_path, [LOCAL, CLI], timeout=120)
    for name, (code, output) in results.items():
        assert code == 1 and f"FAILED {CHILD}::{name}" in output, output[-5000:]
        assert "Timeout (>15.0s) from pytest-timeout" in output, output[-5000:]
        assert "stacks of every process of the test's clusters" in output, output[-5000:]
        assert "skipped" not in output and "could not" not in output, output
        found = sections(output)
        (client,) = only(found, "the client")  # where the test waits on its task
        assert f"in {name}" in client[1] and "in result" in client[1], client[1]

    # A LocalCluster: its one worker's process; its scheduler, here in the client's process.
    output = results[LOCAL][1]
    found = sections(output)
    (worker,) = only(found, "worker tcp://127.0.0.1:")
    assert re.fullmatch(r"worker tcp://127\.0\.0\.1:\d+ \(pid \d+\)", worker[0])
    assert "in sleep_forever" in worker[1], worker[1]
    assert "<- the worker's event loop" in worker[1], worker[1]
    assert "its scheduler and nannies run in the client's process" in output
    client = only(found, "the client")[0][1]
    assert re.search(r"Thread 'IO loop' .*<- the event loop of LocalCluster tcp://", client), client
    assert "distributed/utils.py" in client  # (the scheduler's event loop: distributed's thread)

    # The dask commands: a scheduler, two nannies, each nanny's worker, each a process.
    found = sections(results[CLI][1])
    (scheduler,) = only(found, "scheduler tcp://127.0.0.1:")
    assert "<- the scheduler's event loop" in scheduler[1], scheduler[1]
    assert "dask_scheduler.py" in scheduler[1], scheduler[1]
    assert len(only(found, "nanny tcp://127.0.0.1:")) == 2, [w for w, _ in found]
    workers = only(found, "worker tcp://127.0.0.1:")
    assert len(workers) == 2, [w for w, _ in found]
    assert sum("in sleep_forever" in text for _, text in workers) == 1, workers


@pytest.mark.timeout(60)
@pytest.mark.subprocess
def test_the_dump_names_what_it_cannot_signal_and_never_raises(tmp_path):
    """A process gone, one without the preload (SIGUSR1 would end it: it is not signalled), a
    cluster whose processes cannot be listed: each a line; a preloaded process: its stacks."""
    preloaded = subprocess.Popen([sys.executable, "-c", (
        "import runpy, sys\nrunpy.run_path(sys.argv[1])\n"
        "def sleep_forever():\n    import time\n    while True:\n        time.sleep(0.1)\n"
        "sleep_forever()\n"), hangs.preload_file()])
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    key, broken = object(), object()
    processes = [hangs.Process(preloaded.pid, "preloaded"), hangs.Process(plain.pid, "plain"),
                 hangs.Process(gone.pid, "gone"), hangs.Process(None, "none", "never started")]

    def unlistable():
        raise RuntimeError("no list")

    try:
        eventually(lambda: hangs.process_info(preloaded.pid), 30, "the preload ran")
        with hangs.watching(key, "a cluster", lambda: (processes, ["a note"], {})), \
                hangs.watching(broken, "a broken cluster", unlistable):
            output = hangs.dump("a test", wait=5)
        assert plain.poll() is None  # (not signalled: it would have ended)
    finally:
        for p in (preloaded, plain):
            p.kill()
            p.wait()
    found = dict(sections(output))
    assert "in sleep_forever" in found[f"preloaded (pid {preloaded.pid})"]
    assert "does not handle SIGUSR1" in found[f"plain (pid {plain.pid})"]
    assert "it has exited" in found[f"gone (pid {gone.pid})"]
    assert "(skipped: never started)" in found["none (pid None)"]
    assert "a note" in output and "could not be listed: RuntimeError('no list')" in output
    assert "test_the_dump_names_what_it_cannot_signal_and_never_raises" in \
        found[f"the client: this process (pid {os.getpid()})"]
