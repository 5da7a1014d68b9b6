"""Ctrl-C sent to a call running in a child process: a compute_grads call
(``tests/ctrl_c_child.py``, :func:`interrupt`) or a sweep (:data:`SWEEP_CHILD`,
:func:`start_sweep_child`, :func:`assert_stopped_by_ctrl_c`)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path


CTRL_C_CHILD = Path(__file__).parent.parent / "ctrl_c_child.py"


def interrupt(target: str, tmp_path, progress: bool = False):
    """Start ``ctrl_c_child.py`` on ``target``, send it SIGINT once its first slow node runs.

    Returns ``(seconds until KeyboardInterrupt reached it, nodes started by then, nodes started
    1.5 s later, the process)``; the process waits on its stdin, which the caller closes.
    """
    log = tmp_path / f"starts-{target.replace('/', '_').replace(':', '_')}-{progress}"
    proc = subprocess.Popen([sys.executable, str(CTRL_C_CHILD), target, str(log)]
                            + (["progress"] if progress else []),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("ready")
    deadline = time.monotonic() + 60
    while not log.exists():  # the first node has started: the call is under way
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    time.sleep(0.2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    line = ""
    while not any(w in line for w in ("interrupted", "finished", "Error")):  # past progress bars
        line = proc.stdout.readline()
        assert line, "the child exited without a word"
    took = time.monotonic() - sent
    assert "interrupted" in line, line
    started = log.read_text().count("start")
    time.sleep(1.5)
    return took, started, log.read_text().count("start"), proc


# -- a sweep: 400 slow items, on threads or on a cluster --------------------------------------------

SWEEP_CHILD = textwrap.dedent("""
    import sys, time
    import jax.numpy as jnp
    import daskdag

    def hook(*exc):  # when the KeyboardInterrupt reaches the top, before the interpreter's teardown
        print(f"uncaught at {time.time()!r}", file=sys.stderr, flush=True)
        sys.__excepthook__(*exc)

    sys.excepthook = hook

    def slow(x):
        time.sleep(0.3)
        print("item", flush=True)
        return jnp.sum(x ** 2)

    client = None
    if len(sys.argv) > 1:
        from distributed import Client
        client = Client(sys.argv[1])
    print("started", flush=True)
    daskdag.sweep_grads({"L": (slow, ["x"])}, jnp.ones((400, 3)), "L", client=client)
""")


def start_sweep_child(*args):
    """Start :data:`SWEEP_CHILD` (``args``: a scheduler address, or none for threads), its
    stdout and stderr piped; it prints ``started``, then ``item`` as each item ends."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", SWEEP_CHILD, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def assert_stopped_by_ctrl_c(child):
    """SIGINT the child: its sweep must stop and raise KeyboardInterrupt within 2 s, and the
    process end with it.

    Timed to the exception reaching the top of the child: the interpreter's teardown after it
    (module finalization, 0.4 s here when idle) took up to 2 s more on this loaded 2-core box.
    """
    sent = time.time()
    child.send_signal(signal.SIGINT)
    child.wait(timeout=60)
    ended = time.time() - sent
    err = child.stderr.read()
    assert "KeyboardInterrupt" in err and child.returncode == -signal.SIGINT, err[-3000:]
    stopped = float(err.split("uncaught at ")[1].split()[0]) - sent
    print(f"KeyboardInterrupt raised {stopped:.2f} s after Ctrl-C; process ended after {ended:.2f} s")
    assert stopped < 2.0, f"took {stopped:.2f} s to stop"
