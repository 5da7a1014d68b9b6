"""Run by tests as a separate process, which they interrupt with SIGINT: compute_grads over a
chain of slow nodes. Usage: ctrl_c_child.py SCHEDULER LOG [progress]

SCHEDULER: 'threads', 'sync', or a scheduler address ('threads' and 'sync' are given only as
Dask's ``scheduler`` setting, ``dask.config.set(scheduler=...)``). Each node appends a line to
LOG when it starts: ``start TIME MAIN SCHEDULER``, TIME its ``time.time()``, MAIN whether it runs
in this process's main thread, SCHEDULER which of Dask's local schedulers runs it (``sync``:
``dask.local.get_sync`` is on its stack, ``threads``: ``dask.threaded.get``, ``-``: neither,
as daskdag's own in-order loop or a worker). Prints 'ready' before the call, then
'interrupted TIME' when KeyboardInterrupt reaches it (and stays connected until its stdin
closes), or 'finished' / the other exception's name.
"""

import signal
import sys
import threading
import time

import dask
import dask.local
import dask.threaded
import jax.numpy as jnp
from distributed import Client

import daskdag

target, log = sys.argv[1], sys.argv[2]
# A test run started in the background (`make test &`) ignores SIGINT, and so would this child;
# Ctrl-C in a terminal raises KeyboardInterrupt, which is what the tests are about.
signal.signal(signal.SIGINT, signal.default_int_handler)
SCHEDULERS = {dask.local.get_sync.__code__: "sync", dask.threaded.get.__code__: "threads"}


def scheduler() -> str:
    """Which of Dask's local schedulers runs the calling node (see the module's docstring)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code in SCHEDULERS:
            return SCHEDULERS[frame.f_code]
        frame = frame.f_back
    return "-"


def slow(a):
    with open(log, "a") as f:
        f.write(f"start {time.time()!r} {threading.current_thread() is threading.main_thread()} "
                f"{scheduler()}\n")
    time.sleep(0.5)
    return a + 1.0


dag = {n: (slow, [d]) for n, d in zip("ABCDEFGH", "xABCDEFG")}
dag["L"] = (jnp.sum, ["H"])
client = None if target in ("threads", "sync") else Client(target, set_as_default=False)
print("ready", flush=True)
try:
    with dask.config.set(scheduler=target if client is None else None):
        daskdag.compute_grads(dag, jnp.arange(3.0), "L", client=client, progress="progress" in sys.argv)
    print("finished", flush=True)
except KeyboardInterrupt:
    print(f"interrupted {time.time()!r}", flush=True)
    sys.stdin.read()  # stay connected while the test looks at the cluster
except BaseException as e:
    print(type(e).__name__, e, flush=True)
