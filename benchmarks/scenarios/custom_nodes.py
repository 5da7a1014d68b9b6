"""Scenario: nodes outside JAX, with the user's own VJP, against JAX nodes doing the same work.

    x -> h1 -> ... -> hL -> loss,   h_i = tanh(h_{i-1} @ W_i),   loss = sum(hL ** 2)

``x`` float32[rows, width], every ``W_i`` float32[width, width], the weights closed over by
the nodes. The gradient of ``loss`` with respect to ``x``, by:

numpy_hand:      the forward loop and the adjoint loop written by hand in NumPy: the work a
                 user-VJP node does, without daskdag. The baseline of the user-VJP nodes.
daskdag_custom:  ``daskdag.compute_grads`` of the chain as ``Node(fwd=..., bwd=...)`` nodes, the
                 same NumPy code as ``numpy_hand``, on Dask's threaded scheduler.
jax_hand:        the same chain as eager JAX nodes, with the hand-written ``jax.vjp`` plumbing.
daskdag_jax:     ``compute_grads`` of the chain as eager JAX nodes, threaded scheduler.

Two sizes: ``small`` (width 32: the per-node cost dominates) and ``large`` (width 512: the
matrix products do). Each method runs once first, is checked against ``jax.grad`` of the
composed chain (``RTOL``), then they are timed interleaved, by median. What is measured is
daskdag's cost per user-VJP node (``daskdag_custom/numpy_hand``), against its cost per JAX node
(``daskdag_jax/jax_hand``), and the two kinds of node against each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import daskdag

from .. import common
TITLE = "Nodes with the user's own VJP (NumPy) against JAX nodes"
DESCRIPTION = ("nodes of NumPy code with the user's own VJP against JAX nodes and "
               "hand-written loops")
CLUSTERS = ("2w", "2w_tuned")  # up while it runs, unused: its methods run in this process
RTOL = 1e-4


@dataclass(frozen=True)
class Config:
    rows: int
    depth: int
    widths: tuple[int, ...]
    reps: int


FULL = Config(rows=64, depth=8, widths=(32, 512), reps=21)
QUICK = Config(rows=16, depth=4, widths=(32, 128), reps=5)


def _fwd(h, w):
    y = np.tanh(h @ w)
    return y, (h, y)


def _bwd(w, res, ct):
    h, y = res
    g = ct * (1.0 - y * y)
    return (g @ w.T,)


def custom_dag(ws) -> dict:
    dag, prev = {}, "x"
    for i, w in enumerate(ws):
        dag[f"h{i}"] = daskdag.Node(fwd=partial(_fwd, w=w), bwd=partial(_bwd, w), deps=[prev])
        prev = f"h{i}"
    dag["loss"] = daskdag.Node(fwd=lambda h: (np.sum(h * h), h),
                               bwd=lambda h, ct: (2.0 * ct * h,), deps=[prev])
    return dag


def jax_dag(ws) -> dict:
    dag, prev = {}, "x"
    for i, w in enumerate(ws):
        dag[f"h{i}"] = (partial(_layer, w=jnp.asarray(w)), [prev])
        prev = f"h{i}"
    dag["loss"] = (lambda h: jnp.sum(h * h), [prev])
    return dag


def _layer(h, w):
    return jnp.tanh(h @ w)


def numpy_hand(ws, x):
    residuals, h = [], x
    for w in ws:
        h, res = _fwd(h, w)
        residuals.append(res)
    ct = 2.0 * h
    for w, res in zip(reversed(ws), reversed(residuals)):
        (ct,) = _bwd(w, res, ct)
    return ct


def jax_hand(jws, x):
    pullbacks, h = [], jnp.asarray(x)
    for w in jws:
        h, pb = jax.vjp(partial(_layer, w=w), h)
        pullbacks.append(pb)
    loss, pb = jax.vjp(lambda h: jnp.sum(h * h), h)
    (ct,) = pb(jnp.ones_like(loss))
    for pb in reversed(pullbacks):
        (ct,) = pb(ct)
    return jax.block_until_ready(ct)


def _daskdag(dag, x):
    return daskdag.compute_grads(dag, x, "loss").grad


def run(quick: bool, clients: dict) -> dict:
    cfg = QUICK if quick else FULL
    rng = np.random.default_rng(0)
    cases = []
    for width in cfg.widths:
        print(f"{TITLE}: width {width}, {cfg.depth} layers, x float32[{cfg.rows}, {width}]",
              flush=True)
        ws = [rng.standard_normal((width, width), np.float32) / np.float32(np.sqrt(width))
              for _ in range(cfg.depth)]
        jws = [jnp.asarray(w) for w in ws]
        x = rng.standard_normal((cfg.rows, width), np.float32)
        runs = {"numpy_hand": partial(numpy_hand, ws), "daskdag_custom": partial(_daskdag, custom_dag(ws)),
                "jax_hand": partial(jax_hand, jws), "daskdag_jax": partial(_daskdag, jax_dag(ws))}

        def composed(x):
            for w in jws:
                x = _layer(x, w)
            return jnp.sum(x * x)

        want = jax.grad(composed)(jnp.asarray(x))
        diffs = {n: common.worst_difference(f(x), want) for n, f in runs.items()}
        bad = {n: d for n, d in diffs.items() if d > RTOL}
        if bad:
            raise AssertionError(f"{TITLE} (width {width}): disagrees with jax.grad: {bad}")
        times = common.interleaved({n: partial(f, x) for n, f in runs.items()}, cfg.reps,
                                   label=f"width {width}: ")
        cases.append(common.case("small" if width == cfg.widths[0] else "large",
                                 {"width": width}, times,
                                 {"daskdag_custom/numpy_hand": ("daskdag_custom", "numpy_hand"),
                                  "daskdag_jax/jax_hand": ("daskdag_jax", "jax_hand"),
                                  "daskdag_custom/daskdag_jax": ("daskdag_custom", "daskdag_jax")},
                                 checks={"worst_relative": diffs}))
    return {"title": TITLE, "config": {**asdict(cfg), "rtol": RTOL},
            "description": f"Median seconds of {cfg.reps} runs of the gradient of a {cfg.depth}-"
                           f"layer tanh chain, float32[{cfg.rows}, width]; Dask's threaded "
                           f"scheduler. custom: `Node(fwd=, bwd=)` nodes of NumPy code; jax: eager "
                           f"JAX nodes; `_hand`: the same work without daskdag.",
            "targets": [], "cases": cases}


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    print(json.dumps(run(parser.parse_args().quick, {})["cases"], indent=1, default=float))
