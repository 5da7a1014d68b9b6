"""Scenario: durable sweeps (``sweep_grads(store=...)``) against the same sweep in memory.

On the runner's default 2-worker cluster (``clients["2w"]``): 2,000 items (500 in a quick run)
of a two-node DAG whose item node does a little JAX work (``tanh(x @ M)`` on float32[64],
``M`` 64 x 64, shared), the loss the sum of squares, the gradient with respect to ``x``.

memory:   ``daskdag.sweep_grads(dag, {"x": xs, "M": M}, "loss", batched=["x"], client=client)``,
          results in memory only, daskdag's default chunks (8 of 250 items).
durable:  the same with ``store=`` a new directory each repetition (under the system's temporary
          directory): every chunk written and synced as it finishes.
memory (20 chunks), resume: the same sweep in 20 chunks (``chunk_size`` a twentieth of the
          items), so that 90% of it is 18 whole chunks; ``resume`` is the call on a store
          holding 90% of the sweep (a finished store copied, then the completion marks
          (``done/`` groups) of its last 2 chunks removed, as a sweep killed at 90% leaves it):
          what finishing a sweep that died at 90% costs.

Each method runs once first (warm-up), the durable result checked against the in-memory one bit
for bit, then the methods are timed interleaved (``common.interleaved``). Ratios:
``durable/memory`` and ``resume/memory`` (against ``memory (20 chunks)``).

Targets (issue 31): ``durable/memory <= 1.05``; ``resume/memory <= 0.15``.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import daskdag

from .. import common

TITLE = "Durable sweeps (results on disk, resumed)"
DESCRIPTION = ("``sweep_grads(store=...)`` against the same sweep in memory, and resuming "
               "a sweep that died at 90%")
CLUSTERS = ("2w", "2w_tuned")  # its sweeps on 2w (2w_tuned: up, unused)
WHERE = "the runner's default 2-worker cluster (2w); stores under the system's temporary directory"


@dataclass(frozen=True)
class Config:
    items: int
    reps: int
    width: int = 64


FULL = Config(items=2000, reps=5)
QUICK = Config(items=500, reps=2)


def item_node(x, M):
    return jnp.tanh(x @ M)


def loss(h):
    return jnp.sum(h ** 2)


DAG = {"h": (item_node, ["x", "M"]), "loss": (loss, ["h"])}


def call(client, xs, M, store=None, chunk_size=None):
    r = daskdag.sweep_grads(DAG, {"x": xs, "M": M}, "loss", batched=["x"], client=client,
                            store=store, chunk_size=chunk_size)
    return np.asarray(r.value), np.asarray(r.grad["x"])


def pieces(store: Path) -> list[Path]:
    """The store's completion marks (``done/<start>-<stop>`` groups), in item order."""
    return sorted(p for p in (store / "done").iterdir() if (p / "zarr.json").exists())


class Stores:
    """A new store per call (``fresh``), and stores at 90% made from a finished one
    (``at_90``)."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="daskdag-durable-"))
        self.count = 0

    def fresh(self) -> Path:
        self.count += 1
        return self.root / f"store-{self.count}"

    def at_90(self, finished: Path) -> Path:
        store = self.fresh()
        shutil.copytree(finished, store)
        dones = pieces(store)
        assert len(dones) % 10 == 0, "90% is not a whole number of chunks"
        for d in dones[len(dones) - len(dones) // 10:]:
            shutil.rmtree(d)
        return store

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)


def run(quick: bool, clients: dict) -> dict:
    cfg = QUICK if quick else FULL
    client = clients["2w"]
    rng = np.random.default_rng(0)
    xs = rng.uniform(-1, 1, (cfg.items, cfg.width)).astype(np.float32)
    M = jnp.asarray(rng.uniform(-0.2, 0.2, (cfg.width, cfg.width)).astype(np.float32))
    stores = Stores()
    try:
        print(f"{TITLE}: {cfg.items} items", flush=True)
        ref = call(client, xs, M)
        finished = stores.fresh()
        got = call(client, xs, M, finished)  # warm-up of the durable path, checked
        for g, r in zip(got, ref):
            np.testing.assert_array_equal(g, r)
        chunks = len(pieces(finished))
        twentieth = cfg.items // 20
        in_20 = stores.fresh()
        call(client, xs, M, in_20, twentieth)
        resumed = call(client, xs, M, stores.at_90(in_20))
        for g, r in zip(resumed, ref):
            np.testing.assert_array_equal(g, r)
        at_90 = [stores.at_90(in_20) for _ in range(cfg.reps)]  # (copied before the timing)
        methods = {"memory": lambda: call(client, xs, M),
                   "durable": lambda: call(client, xs, M, stores.fresh()),
                   "memory (20 chunks)": lambda: call(client, xs, M, None, twentieth),
                   "resume": lambda: call(client, xs, M, at_90.pop())}
        times = common.interleaved(methods, cfg.reps, "durable: ")
        store_bytes = sum(p.stat().st_size for p in finished.rglob("*") if p.is_file())
    finally:
        stores.close()
    c = common.case(f"{cfg.items} items", {"items": cfg.items, "chunks": chunks,
                                           "store_bytes": store_bytes}, times,
                    {"durable/memory": ("durable", "memory"),
                     "resume/memory": ("resume", "memory (20 chunks)")})
    wanted = [{"case": c["case"], "ratio": "durable/memory", "op": "<=", "bound": 1.05,
               "source": "issue 31"},
              {"case": c["case"], "ratio": "resume/memory", "op": "<=", "bound": 0.15,
               "source": "issue 31"}]
    return {"title": TITLE, "config": asdict(cfg), "cases": [c],
            "where": {m: WHERE for m in methods}, "targets": common.targets([c], wanted)}
