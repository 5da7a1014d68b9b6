"""Scenario: a long ``compute_grads`` call with ``store=``, its client SIGKILLed about halfway,
then the same call again, against the same call uninterrupted.

On the runner's default 2-worker cluster (``clients["2w"]``): a DAG of 12 nodes of about
``pause`` seconds each (2 s; 0.5 s in a quick run: ``time.sleep`` then ``tanh(x * w)`` on
float32[64]), a chain ``n0 -> n1 -> ... -> n11`` whose last node is the loss, so that the call
takes 12 pauses however the cluster places it; the gradient with respect to ``x``. The DAG is a
module written to a temporary directory, as a user's script is (the workers get its functions by
value).

memory:   ``daskdag.compute_grads(dag, x, "n11", client=client)``: nothing kept.
durable:  the same with ``store=`` a new directory (under the system's temporary directory):
          each node's value and residuals written and synced by its task as it finishes.
rerun after SIGKILL: before the timing, the durable call runs in another process (its own
          client of the same cluster), SIGKILLed once 6 of the 12 nodes are stored; timed is
          the same call in this process on that store, which runs the 6 others.

Every result is checked: the rerun's bit for bit against the uninterrupted durable call's. One
repetition of each (a call takes 12 pauses), timed one after the other. Ratios:
``durable/memory`` and ``rerun/durable``.

Target (issue 41): ``rerun/durable <= 0.6``.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import daskdag

from .. import common

TITLE = "Durable calls (a long call's client killed, then the call again)"
DESCRIPTION = ("``compute_grads(store=...)`` of 12 nodes of 2 s, the client SIGKILLed halfway, "
               "the same call again, against the call uninterrupted")
CLUSTERS = ("2w", "2w_tuned")  # its calls on 2w (2w_tuned: up, unused)
WHERE = "the runner's default 2-worker cluster (2w); stores under the system's temporary directory"
NODES = 12


@dataclass(frozen=True)
class Config:
    pause: float
    reps: int = 1
    width: int = 64


FULL = Config(pause=2.0)
QUICK = Config(pause=0.5)

MODULE = '''
import time
import jax.numpy as jnp
import numpy as np

PAUSE = {pause!r}
W = np.linspace(0.5, 1.5, {width}).astype(np.float32)


def node(k):
    def f(a):
        time.sleep(PAUSE)
        out = jnp.tanh(a * W + 0.01 * k)
        return jnp.sum(out ** 2) if k == {last} else out
    return f


DAG = {{f"n{{k}}": (node(k), ["x" if k == 0 else f"n{{k - 1}}"]) for k in range({nodes})}}
'''

RUNNER = '''
import sys
sys.path.insert(0, {folder!r})
import numpy as np
from distributed import Client
import daskdag
import {module} as m

with Client({scheduler!r}, set_as_default=False, timeout=60) as client:
    daskdag.compute_grads(m.DAG, np.load({x!r}), "n{last}", client=client, store={store!r})
'''


def stored(store: Path) -> int:
    """The nodes the store holds complete (their stage's group written, which is last)."""
    stages = store / "stages"
    if not stages.exists():
        return 0
    return sum(1 for e in stages.iterdir()
               if (e / "zarr.json").exists() and b"sha256" in (e / "zarr.json").read_bytes())


def run(quick: bool, clients: dict) -> dict:
    cfg = QUICK if quick else FULL
    client = clients["2w"]
    root = Path(tempfile.mkdtemp(prefix="daskdag-durable-calls-"))
    try:
        name = f"durable_calls_dag_{os.getpid()}"
        (root / f"{name}.py").write_text(MODULE.format(pause=cfg.pause, width=cfg.width,
                                                       last=NODES - 1, nodes=NODES))
        sys.path.insert(0, str(root))
        try:
            m = importlib.import_module(name)
        finally:
            sys.path.remove(str(root))
        x = np.random.default_rng(0).uniform(-1, 1, cfg.width).astype(np.float32)
        np.save(root / "x.npy", x)
        out = f"n{NODES - 1}"
        print(f"{TITLE}: {NODES} nodes of {cfg.pause} s", flush=True)

        def call(store=None):
            r = daskdag.compute_grads(m.DAG, x, out, client=client, store=store)
            return np.asarray(r.value), np.asarray(r.grad)

        times: dict[str, list[float]] = {"memory": [], "durable": [],
                                         "rerun after SIGKILL": []}
        kept_at_kill = []
        for rep in range(cfg.reps):
            took, ref = common.timed(call)
            times["memory"].append(took)
            took, uninterrupted = common.timed(call, root / f"uninterrupted-{rep}")
            times["durable"].append(took)
            for a, b in zip(uninterrupted, ref):
                np.testing.assert_allclose(a, b, rtol=1e-6)
            store = root / f"killed-{rep}"
            script = root / "runner.py"
            script.write_text(RUNNER.format(folder=str(root), module=name, x=str(root / "x.npy"),
                                            scheduler=client.scheduler.address, store=str(store),
                                            last=NODES - 1))
            proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONPATH": str(Path.cwd())})
            deadline = time.monotonic() + NODES * cfg.pause * 10 + 120
            while stored(store) < NODES // 2 and proc.poll() is None:
                assert time.monotonic() < deadline, "the killed call stored too little in time"
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kept_at_kill.append(stored(store))
            took, resumed = common.timed(call, store)
            times["rerun after SIGKILL"].append(took)
            for a, b in zip(resumed, uninterrupted):
                np.testing.assert_array_equal(a, b)  # bit for bit
            print(f"  rep {rep + 1}/{cfg.reps}: " + ", ".join(
                f"{k} {v[-1]:.2f} s" for k, v in times.items()) +
                f" ({kept_at_kill[-1]} of {NODES} nodes stored at the kill)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    c = common.case(f"{NODES} nodes of {cfg.pause} s",
                    {"nodes": NODES, "pause_s": cfg.pause, "stored_at_kill": kept_at_kill},
                    times, {"durable/memory": ("durable", "memory"),
                            "rerun/durable": ("rerun after SIGKILL", "durable")})
    wanted = [{"case": c["case"], "ratio": "rerun/durable", "op": "<=", "bound": 0.6,
               "source": "issue 41"}]
    return {"title": TITLE, "config": asdict(cfg), "cases": [c],
            "where": {k: WHERE for k in times}, "targets": common.targets([c], wanted)}
