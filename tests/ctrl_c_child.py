"""Run by tests as a separate process, which they interrupt with SIGINT: compute_grads over a
chain of slow nodes. Usage: ctrl_c_child.py SCHEDULER LOG [progress]

SCHEDULER: 'threads', 'sync', or a scheduler address. Each node appends a line to LOG when it
starts. Prints 'ready' before the call, then 'interrupted' when KeyboardInterrupt reaches it (and
stays connected until its stdin closes), or 'finished' / the other exception's name.
"""

import signal
import sys
import time

import dask
import jax.numpy as jnp
from distributed import Client

import daskdag

target, log = sys.argv[1], sys.argv[2]
# A test run started in the background (`make test &`) ignores SIGINT, and so would this child;
# Ctrl-C in a terminal raises KeyboardInterrupt, which is what the tests are about.
signal.signal(signal.SIGINT, signal.default_int_handler)


def slow(a):
    with open(log, "a") as f:
        f.write("start\n")
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
    print("interrupted", flush=True)
    sys.stdin.read()  # stay connected while the test looks at the cluster
except BaseException as e:
    print(type(e).__name__, e, flush=True)
