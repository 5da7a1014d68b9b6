"""A sweep's progress bar (daskdag.sweeps.progress), its counts read from inside: when some items
fail, the last count is exact (every item counted, none twice)."""

import jax.numpy as jnp

import daskdag
from daskdag.sweeps import progress

from .support.progress import Recorded
from .test_sweep_failures import encode, flaky


def test_progress_final_count_is_exact_with_failures(monkeypatch):
    monkeypatch.setattr(progress, "tqdm", Recorded)
    Recorded.counts = []
    dag = {"H": (encode, ["x", "w"]), "L": (flaky, ["H"])}
    xs = jnp.linspace(-1.0, 1.0, 10)[:, None] * jnp.ones((10, 3))
    res = daskdag.sweep_grads(dag, {"x": xs, "w": jnp.eye(3)}, "L", batched=["x"], chunk_size=4,
                              errors="collect", progress=True)
    assert res.failed and Recorded.counts[-1] == 10 and max(Recorded.counts) == 10
