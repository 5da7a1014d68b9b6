"""Ctrl-C sent to a call running in a child process: a compute_grads call
(``tests/ctrl_c_child.py``, :func:`interrupt`) or a sweep (:data:`SWEEP_CHILD`,
:func:`start_sweep_child`, :func:`assert_stopped_by_ctrl_c`)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple


CTRL_C_CHILD = Path(__file__).parent.parent / "ctrl_c_child.py"


class Start(NamedTuple):
    """A node's start, as ``ctrl_c_child.py`` logs it: its ``time.time()``, whether it ran in
    the child's main thread, and which of Dask's local schedulers ran it (``"sync"``,
    ``"threads"``, or ``"-"``: neither)."""
    time: float
    main: bool
    scheduler: str


def starts(log: Path) -> list[Start]:
    """The node starts ``ctrl_c_child.py`` logged in ``log`` so far."""
    return [Start(float(t), main == "True", where) for _, t, main, where in
            (line.split() for line in log.read_text().splitlines())]


@dataclass
class Interrupted:
    """A ``ctrl_c_child.py`` that Ctrl-C reached (:func:`interrupt`): SIGINT ``sent`` at this
    process's ``time.time()``, KeyboardInterrupt ``caught`` by the child's ``except`` at its
    own (the same clock), ``started`` nodes in its log once this process read that it was."""
    proc: subprocess.Popen
    log: Path
    sent: float
    caught: float
    started: int

    @property
    def took(self) -> float:
        """Seconds from SIGINT sent to the KeyboardInterrupt reaching the child's user code."""
        return self.caught - self.sent

    def end(self, timeout: float = 60) -> list[Start]:
        """Close the child's stdin and wait for it to exit; then its nodes' starts, final: no
        node of its call runs in it any more (on a cluster, wait for the workers first)."""
        self.proc.stdin.close()
        self.proc.wait(timeout=timeout)
        return starts(self.log)


def interrupt(target: str, tmp_path, progress: bool = False) -> Interrupted:
    """Start ``ctrl_c_child.py`` on ``target``, send it SIGINT once its first slow node runs;
    return once KeyboardInterrupt reached it. The process waits on its stdin, which
    :meth:`Interrupted.end` closes."""
    log = tmp_path / f"starts-{target.replace('/', '_').replace(':', '_')}-{progress}"
    proc = subprocess.Popen([sys.executable, str(CTRL_C_CHILD), target, str(log)]
                            + (["progress"] if progress else []),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("ready")
    deadline = time.monotonic() + 60
    while not log.exists():  # the first node has started: the call is under way
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    time.sleep(0.2)  # (into the node's wait, mostly: where Ctrl-C comes is not what is tested)
    sent = time.time()
    proc.send_signal(signal.SIGINT)
    line = ""
    while not any(w in line for w in ("interrupted", "finished", "Error")):  # past progress bars
        line = proc.stdout.readline()
        assert line, "the child exited without a word"
    assert "interrupted" in line, line
    started = len(starts(log))
    caught = float(line[line.index("interrupted"):].split()[1])
    return Interrupted(proc, log, sent, caught, started)


# -- a sweep: 400 slow items, on threads or on a cluster --------------------------------------------

SWEEP_CHILD = textwrap.dedent("""
    import sys, threading, time
    import jax.numpy as jnp
    import daskdag

    def hook(*exc):  # when the KeyboardInterrupt reaches the top, before the interpreter's teardown
        print(f"uncaught at {time.time()!r}", file=sys.stderr, flush=True)
        sys.__excepthook__(*exc)

    sys.excepthook = hook

    def slow(x):
        start = time.time()
        time.sleep(0.3)
        print(f"item {start!r} {time.time()!r} {threading.get_ident()}", flush=True)
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
    stdout and stderr piped; it prints ``started``, then ``item START END THREAD`` as each item
    ends (on a cluster, to the worker's output), START and END its ``time.time()``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-c", SWEEP_CHILD, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def assert_stopped_by_ctrl_c(child, here: bool = True):
    """SIGINT the child: its sweep must stop, raise KeyboardInterrupt, and the process end with
    it. ``here``: its items ran on its own threads (no cluster), which print when each started
    and ended: then checked by the order of events, not by times (a loaded machine delays the
    child, not the order of its events): each chunk stopped after its current item (at most one
    item per thread started after Ctrl-C: the one it was on, if that began as the signal went),
    and every item ended before the KeyboardInterrupt reached the top. On a cluster, where the
    items print elsewhere, the KeyboardInterrupt must reach the top within 2 s of Ctrl-C.

    Timed to the exception reaching the top of the child: the interpreter's teardown after it
    (module finalization, 0.4 s here when idle) took up to 2 s more on this loaded 2-core box.
    """
    from collections import Counter

    sent = time.time()
    child.send_signal(signal.SIGINT)
    child.wait(timeout=60)
    ended = time.time() - sent
    err, out = child.stderr.read(), child.stdout.read()
    assert "KeyboardInterrupt" in err and child.returncode == -signal.SIGINT, err[-3000:]
    raised = float(err.split("uncaught at ")[1].split()[0])
    stopped = raised - sent
    print(f"KeyboardInterrupt raised {stopped:.2f} s after Ctrl-C; process ended after {ended:.2f} s")
    if not here:
        assert stopped < 2.0, f"took {stopped:.2f} s to stop"
        return
    items = [(float(a), float(b), thread) for _, a, b, thread in
             (line.split() for line in out.splitlines() if line.startswith("item "))]
    after = Counter(thread for a, _, thread in items if a > sent)
    assert all(n <= 1 for n in after.values()), (sent, items)  # each stopped after its item
    assert all(b < raised for _, b, _ in items), (raised, items)  # ... before it was raised


# -- a sweep with a store: 200 slow items, on threads or on a cluster -----------------------------

STORED_SWEEP_CHILD = textwrap.dedent("""
    import signal, sys, time
    import numpy as np
    import jax.numpy as jnp
    import daskdag

    signal.signal(signal.SIGINT, signal.default_int_handler)  # (as in a terminal)
    STORE, LOG = sys.argv[1], sys.argv[2]

    def slow(x, i):
        time.sleep(0.2)
        with open(LOG, "a") as f:
            f.write(f"{int(i)}\\n")
        return jnp.sum(x ** 2)

    client = None
    if len(sys.argv) > 3:
        from distributed import Client
        client = Client(sys.argv[3])
    print("started", flush=True)
    daskdag.sweep_grads({"L": (slow, ["x", "i"])},
                        {"x": np.ones((ITEMS, 3), np.float32), "i": np.arange(ITEMS)}, "L",
                        batched=["x", "i"], wrt=["x"], store=STORE, client=client, progress=True)
""").replace("ITEMS", "200")
STORED_ITEMS = 200


def start_stored_sweep_child(store, log, *args):
    """Start :data:`STORED_SWEEP_CHILD` with its ``store`` and ``log`` (a line per item computed;
    ``args``: a scheduler address, or none for threads), its stdout and stderr piped."""
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-c", STORED_SWEEP_CHILD, str(store), str(log), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": path})


def pieces(store: Path) -> list[tuple[int, int]]:
    """The store's complete pieces, ``(start, stop)``."""
    done = store / "done"
    return sorted(tuple(map(int, p.name.split("-"))) for p in done.iterdir()
                  if (p / "zarr.json").exists()) if done.exists() else []


def assert_ctrl_c_says_what_is_saved(child, store: Path, log: Path):
    """Once the child's first piece is saved, SIGINT it. The first piece was saved after fewer
    items than a chunk holds; the child ends with a KeyboardInterrupt saying how many items the
    store holds (those of its complete pieces), raised from sweep_grads (no frame of daskdag's
    own but that call's, none of threading's), and its progress bar ends at that count."""
    import json
    import re

    assert child.stdout.readline().strip() == "started", child.stderr.read()
    deadline = time.monotonic() + 120
    while not pieces(store):
        assert time.monotonic() < deadline and child.poll() is None, child.stderr.read()[-3000:]
        time.sleep(0.02)
    computed = len(log.read_text().split())
    chunk = json.loads((store / "zarr.json").read_text())["attributes"]["daskdag"]["chunk_size"]
    assert computed < chunk, (computed, chunk)  # (a piece saved early: not a whole chunk first)
    child.send_signal(signal.SIGINT)
    child.wait(timeout=60)
    err = child.stderr.read()
    saved = sum(b - a for a, b in pieces(store))
    assert child.returncode == -signal.SIGINT, err[-3000:]
    assert err.rstrip().endswith(f"KeyboardInterrupt: {saved} of {STORED_ITEMS} items saved in "
                                 f"{store}; run the same call again to resume"), err[-3000:]
    trace = err[err.rindex("Traceback (most recent call last)"):]
    frames = re.findall(r'File "([^"]+)"', trace)
    assert len(frames) == 2 and frames[1].endswith("daskdag/api.py"), trace  # (<string>, api)
    assert "threading" not in trace
    bar = re.findall(rf"(\d+)/{STORED_ITEMS} ", err)
    assert bar and int(bar[-1]) == saved, bar[-5:]
    assert 0 < saved < STORED_ITEMS
