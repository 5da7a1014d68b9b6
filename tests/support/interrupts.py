"""Ctrl-C sent to a call running in a child process (``tests/ctrl_c_child.py``)."""

import signal
import subprocess
import sys
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
