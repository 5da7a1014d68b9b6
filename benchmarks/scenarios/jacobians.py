"""Scenario: the full Jacobian of a 64-output node chain, with ``daskdag.jacobian`` and its peers.

    x -> h1 -> ... -> h6 -> out,   h_i = tanh(h_{i-1} @ W_i),   out = mean(h6 @ W_out, axis=0)

``x`` float32[rows, width], every ``W_i`` float32[width, width], ``W_out`` float32[width, 64]:
``out`` has 64 elements, so its Jacobian is float32[64, rows, width]. In two modes:

jit:    every daskdag node is ``Node(..., jit=True)`` (the chain is one fused stage).
eager:  every node runs op by op, as a node with Python control flow must.

Methods, each returning the Jacobian (and the value for daskdag):

jacrev:          ``jax.jacrev`` of the composed chain; jit mode: ``jax.jit(jax.jacrev(...))``,
                 one XLA program, the limit for a chain that can be jitted whole. The baseline.
daskdag_threads: ``daskdag.jacobian(dag, x, "out")`` on Dask's threaded scheduler: the 64 rows of
                 the identity pulled back as one batch under ``jax.vmap``.
torch:           the same chain in PyTorch (CPU, eager, the same float32 weights),
                 ``torch.autograd.functional.jacobian(f, x, vectorize=True)`` (one batched
                 backward pass). Skipped, and said so, when torch is not installed.

Each method runs once first (compiles), is checked against ``jacrev`` (``RTOL``, relative to
its largest entry; torch to ``RTOL_TORCH``), then they are timed interleaved, by median.
Target (issue 12): jit mode, ``daskdag_threads / jacrev`` <= 1.2.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import daskdag

from .. import common
TITLE = "Jacobian of a 64-output chain"
DESCRIPTION = ("``daskdag.jacobian`` of a 64-output chain against ``jax.jacrev`` and "
               "PyTorch")
CLUSTERS = ("2w", "2w_tuned")  # up while it runs, unused: its methods run in this process
RTOL = 1e-4
RTOL_TORCH = 1e-3
TARGETS = [{"case": "jit", "ratio": "daskdag_threads/jacrev", "op": "<=", "bound": 1.2,
            "source": "issue 12"}]


@dataclass(frozen=True)
class Config:
    rows: int
    width: int
    depth: int  # tanh layers before the output node
    outputs: int
    reps: int


FULL = Config(rows=128, width=256, depth=6, outputs=64, reps=7)
QUICK = Config(rows=32, width=128, depth=6, outputs=64, reps=3)


def make_weights(cfg: Config) -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    scale = np.float32(np.sqrt(cfg.width))
    ws = [rng.standard_normal((cfg.width, cfg.width), np.float32) / scale
          for _ in range(cfg.depth)]
    return ws, rng.standard_normal((cfg.width, cfg.outputs), np.float32) / scale


def make_dag(ws, w_out, jit: bool) -> dict:
    dag, prev = {}, "x"
    for i, w in enumerate(ws):
        dag[f"h{i}"] = daskdag.Node(partial(_layer, w=jnp.asarray(w)), [prev], jit=jit)
        prev = f"h{i}"
    dag["out"] = daskdag.Node(partial(_readout, w=jnp.asarray(w_out)), [prev], jit=jit)
    return dag


def _layer(h, w):
    return jnp.tanh(h @ w)


def _readout(h, w):
    return jnp.mean(h @ w, axis=0)


def composed(x, ws, w_out):
    for w in ws:
        x = _layer(x, w)
    return _readout(x, w_out)


def torch_method(ws, w_out):
    """The chain in PyTorch, as a method of the NumPy ``x``; None without torch."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    tw = [torch.from_numpy(w) for w in ws]
    tw_out = torch.from_numpy(w_out)

    def f(x):
        for w in tw:
            x = torch.tanh(x @ w)
        return torch.mean(x @ tw_out, dim=0)

    def run(x):
        return torch.autograd.functional.jacobian(f, torch.from_numpy(x), vectorize=True).numpy()

    return run


def methods(cfg: Config, jit: bool) -> dict:
    ws, w_out = make_weights(cfg)
    jws, jw_out = [jnp.asarray(w) for w in ws], jnp.asarray(w_out)
    jacrev = jax.jacrev(lambda x: composed(x, jws, jw_out))
    runs = {"jacrev": jax.jit(jacrev) if jit else jacrev,
            "daskdag_threads": partial(_daskdag, make_dag(ws, w_out, jit))}
    torch_run = torch_method(ws, w_out)
    if torch_run is not None:
        runs["torch"] = torch_run
    return runs


def _daskdag(dag, x):
    return daskdag.jacobian(dag, x, "out").grad


def run(quick: bool, clients: dict) -> dict:
    cfg = QUICK if quick else FULL
    print(f"{TITLE}: x float32[{cfg.rows}, {cfg.width}], {cfg.depth} layers, "
          f"{cfg.outputs} outputs", flush=True)
    x = np.random.default_rng(1).standard_normal((cfg.rows, cfg.width), np.float32)
    cases = []
    for mode in ("jit", "eager"):
        runs = methods(cfg, jit=mode == "jit")
        want = jax.block_until_ready(runs["jacrev"](jnp.asarray(x)))
        diffs = {n: common.worst_difference(f(x), want) for n, f in runs.items() if n != "jacrev"}
        bad = {n: d for n, d in diffs.items() if d > (RTOL_TORCH if n == "torch" else RTOL)}
        if bad:
            raise AssertionError(f"{TITLE} ({mode}): disagrees with jacrev: {bad}")
        times = common.interleaved({n: partial(f, x) for n, f in runs.items()}, cfg.reps,
                                   label=f"{mode}: ")
        cases.append(common.case(mode, {"mode": mode}, times,
                                 {"daskdag_threads/jacrev": ("daskdag_threads", "jacrev"),
                                  "torch/jacrev": ("torch", "jacrev"),
                                  "daskdag_threads/torch": ("daskdag_threads", "torch")},
                                 checks={"worst_relative": diffs}))
    return {"title": TITLE, "config": {**asdict(cfg), "rtol": RTOL},
            "description": f"Median seconds of {cfg.reps} runs; the Jacobian is float32"
                           f"[{cfg.outputs}, {cfg.rows}, {cfg.width}]. jit: daskdag's nodes "
                           f"`jit=True`, `jacrev` is `jax.jit(jax.jacrev(...))`; eager: neither "
                           f"jitted. torch: `torch.autograd.functional.jacobian(vectorize=True)`.",
            "targets": common.targets(cases, TARGETS), "cases": cases}


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    print(json.dumps(run(parser.parse_args().quick, {})["cases"], indent=1, default=float))
