"""Scenario: a sparse n x n Jacobian through a 5-node DAG, dense against coloured passes.

    A = blocks(x),  B = blocks(A),  C = blocks(A) or stencil(blocks(A)),  D = blocks(B * C),
    E = blocks(D),  blocks(a) = tanh(... tanh(a.reshape(-1, 4) @ W_1) ... @ W_L).reshape(-1)

``x`` float32[n]; every node is a JAX node, eager (the tuple form) or ``jit=True`` (the cases
ending in ``_jit``), each with its own ``L`` small float32[4, 4] matrices, so each does real
work per element and mixes only the 4 elements of its block. Two shapes:

block:   C = blocks(A): the Jacobian of E is block-diagonal, 4 x 4 blocks (4 colours).
banded:  C = stencil(blocks(A)), ``stencil(a) = pad(a[2:] - 2 a[1:-1] + a[:-2], 1)`` (a
         second difference, zero at the ends): its Jacobian is banded, so each block of E
         also reaches into its neighbours' (block-tridiagonal, a band).

Methods, each the Jacobian of E with respect to x:

dense:              ``daskdag.jacobian(dag, x, "E")`` (mode "auto": n outputs and n inputs,
                    a tie: forward, n columns of the identity pushed under ``jax.vmap``).
sparse:             the same with ``sparsity=pattern``, the pattern from
                    ``daskdag.jacobian_sparsity`` computed once beforehand (one pass per colour).
sparse_scipy:       the same with ``sparse=True`` (a ``scipy.sparse.csr_array``).
detect_and_sparse:  ``sparsity="detect"``: the pattern found in the call, then as ``sparse``.
jax_jacrev:         ``jax.jacrev`` of the composed function (``jax.jit`` of it where the
                    nodes are jitted): n rows under ``jax.vmap``, no DAG.

Each method runs once first and is checked against ``jax_jacrev``'s Jacobian (largest absolute
difference, ``ATOL``; the dense and sparse layouts alike); the pattern is checked to cover every
nonzero of it. Then they are timed interleaved, by median. The passes a call makes are
counted, not inferred: a copy of the DAG whose node A passes its value through an identity with
a ``custom_vjp`` that counts, with a host callback, the cotangent rows its pullback is given
(a ``custom_jvp`` that counts the tangent columns, where the mode is forward); the check is
that a sparse call makes as many as the pattern has colours (``colour_rows`` /
``colour_columns`` of ``daskdag.model.colouring``, the mode as daskdag's ``auto`` picks it:
the fewer colours, forward on a tie), and a dense one n. Detection alone
(``jacobian_sparsity``) is timed apart, by median. Target (issue 23, at its n = 2,000, so
not in a quick run): ``sparse/dense`` <= 0.1.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

import daskdag
from daskdag.model import colouring

from .. import common
TITLE = "Sparse Jacobian through a 5-node DAG"
DESCRIPTION = ("a block-diagonal and a banded n x n Jacobian through a 5-node DAG of eager "
               "nodes: ``daskdag.jacobian`` dense, with a sparsity pattern (one pass per "
               "colour, passes counted) and with ``sparsity=\"detect\"``, against "
               "``jax.jacrev``; on this process's threads, no cluster")
CLUSTERS = None  # on this process's threads
BLOCK = 4
ATOL = 1e-5
TARGETS = [{"case": case, "ratio": "sparse/dense", "op": "<=", "bound": 0.1, "source": "issue 23"}
           for case in ("block", "banded", "block_jit", "banded_jit")]


@dataclass(frozen=True)
class Config:
    n: int       # elements of x, and of every node's value
    layers: int  # tanh(h @ W) layers per node
    reps: int


FULL = Config(n=2000, layers=8, reps=5)  # dense: about 0.5-1 s on 2 shared cores
QUICK = Config(n=400, layers=8, reps=3)


def blocks(a, ws):
    h = a.reshape(-1, BLOCK)
    for w in ws:
        h = jnp.tanh(h @ w)
    return h.reshape(-1)


def stencil(a):
    return jnp.pad(a[2:] - 2 * a[1:-1] + a[:-2], 1)


def make_weights(cfg: Config) -> dict[str, list]:
    rng = np.random.default_rng(0)
    return {name: [jnp.asarray(rng.standard_normal((BLOCK, BLOCK), np.float32) / 2)
                   for _ in range(cfg.layers)] for name in "ABCDE"}


def node_functions(ws: dict, banded: bool) -> dict:
    """``{node: (function, deps)}``: the DAG's nodes, as the module's docstring draws them."""
    c = ((lambda a: stencil(blocks(a, ws["C"]))) if banded else partial(blocks, ws=ws["C"]))
    return {"A": (partial(blocks, ws=ws["A"]), ["x"]), "B": (partial(blocks, ws=ws["B"]), ["A"]),
            "C": (c, ["A"]), "D": (lambda b, c: blocks(b * c, ws["D"]), ["B", "C"]),
            "E": (partial(blocks, ws=ws["E"]), ["D"])}


def composed(x, nodes: dict):
    """E of x, the nodes called in order: what ``jax.jacrev`` differentiates."""
    values = {"x": x}
    for name, (fn, deps) in nodes.items():
        values[name] = fn(*(values[d] for d in deps))
    return values["E"]


# -- counting passes --------------------------------------------------------------------------------

class Counter:
    """The rows (reverse) or columns (forward) that pass through an identity, counted by a host
    callback that sees each ``jax.vmap`` call's whole stack (``vmap_method="expand_dims"``)."""

    def __init__(self):
        self.seen = 0

    def _tick(self, stack):
        self.seen += stack.shape[0] if stack.ndim == 2 else 1  # (a lone row: not vmapped)
        return stack

    def _through(self, t):
        return jax.pure_callback(self._tick, jax.ShapeDtypeStruct(t.shape, t.dtype), t,
                                 vmap_method="expand_dims")

    def identity(self, mode: str):
        """The identity on a 1-D array whose pullback (``"rev"``) or pushforward (``"fwd"``)
        counts what it is given."""
        if mode == "rev":
            @jax.custom_vjp
            def ident(a):
                return a
            ident.defvjp(lambda a: (a, None), lambda _, ct: (self._through(ct),))
        else:
            @jax.custom_jvp
            def ident(a):
                return a
            ident.defjvp(lambda primals, tangents: (primals[0], self._through(tangents[0])))
        return ident


def as_dag(nodes: dict, jit: bool) -> dict:
    """The nodes as daskdag's DAG: the tuple form (eager), or ``Node(..., jit=True)``."""
    return {n: daskdag.Node(fn, deps, jit=True) if jit else (fn, deps)
            for n, (fn, deps) in nodes.items()}


def count_passes(nodes: dict, x, mode: str, jit: bool, **kwargs) -> int:
    """The rows (or columns) node A's value is pulled back (pushed forward) with in one
    ``daskdag.jacobian(dag, x, "E", mode=mode, **kwargs)``: its passes."""
    counter = Counter()
    ident = counter.identity(mode)
    fn, deps = nodes["A"]
    dag = as_dag({**nodes, "A": (lambda a: ident(fn(a)), deps)}, jit)
    jax.block_until_ready(daskdag.jacobian(dag, x, "E", mode=mode, **kwargs).grad)
    jax.effects_barrier()
    return counter.seen


# -- one case ----------------------------------------------------------------------------------------

def _jacobian(dag, x, **kwargs):
    return daskdag.jacobian(dag, x, "E", **kwargs).grad


def _dense(jac) -> np.ndarray:
    return jac.toarray() if sp.issparse(jac) else np.asarray(jac)


def measure_case(name: str, cfg: Config, banded: bool, jit: bool) -> dict:
    nodes = node_functions(make_weights(cfg), banded)
    dag = as_dag(nodes, jit)
    x = np.random.default_rng(1).standard_normal(cfg.n).astype(np.float32)
    jacrev = jax.jacrev(partial(composed, nodes=nodes))  # jitted where the nodes are
    jacrev = jax.jit(jacrev) if jit else jacrev

    want = np.asarray(jax.block_until_ready(jacrev(jnp.asarray(x))))
    detect_s = []
    for _ in range(cfg.reps):
        seconds, pattern = common.timed(daskdag.jacobian_sparsity, dag, x, "E")
        detect_s.append(seconds)
    pattern = colouring.as_pattern(pattern)
    missed = int(np.sum((want != 0) & ~pattern.toarray()))
    if missed:
        raise AssertionError(f"{TITLE} ({name}): the detected pattern misses {missed} nonzeros")
    rows, cols = colouring.colour_rows(pattern), colouring.colour_columns(pattern)
    colours = {"rev": colouring.count(rows), "fwd": colouring.count(cols)}
    mode = "fwd" if colours["fwd"] <= colours["rev"] else "rev"  # as jacobian(mode="auto")

    runs = {"dense": partial(_jacobian, dag, x),
            "sparse": partial(_jacobian, dag, x, sparsity=pattern),
            "sparse_scipy": partial(_jacobian, dag, x, sparsity=pattern, sparse=True),
            "detect_and_sparse": partial(_jacobian, dag, x, sparsity="detect"),
            "jax_jacrev": partial(jacrev, x)}
    errors = {}
    for m, f in runs.items():
        got = jax.block_until_ready(f())
        if m == "sparse_scipy" and not sp.issparse(got):
            raise AssertionError(f"{TITLE} ({name}): sparse=True returned {type(got).__name__}")
        errors[m] = float(np.max(np.abs(_dense(got) - want)))
    bad = {m: e for m, e in errors.items() if e > ATOL}
    if bad:
        raise AssertionError(f"{TITLE} ({name}): disagrees with jax.jacrev: {bad}")

    passes = {"sparse": count_passes(nodes, x, mode, jit, sparsity=pattern),
              "dense": count_passes(nodes, x, "rev", jit)}  # (n rows, as n columns forward)
    if passes["sparse"] != colours[mode] or passes["dense"] != cfg.n:
        raise AssertionError(f"{TITLE} ({name}): passes {passes}, but {colours[mode]} colours "
                             f"({mode}) and {cfg.n} elements")

    times = common.interleaved(runs, cfg.reps, label=f"{name}: ")
    print(f"  {name}: colours {colours}, passes {passes}, nnz {pattern.nnz}, detection "
          f"{statistics.median(detect_s) * 1e3:.1f} ms", flush=True)
    return common.case(
        name, {"n": cfg.n, "layers": cfg.layers, "banded": banded, "jit": jit}, times,
        {"sparse/dense": ("sparse", "dense"),
         "detect_and_sparse/dense": ("detect_and_sparse", "dense"),
         "sparse/jax_jacrev": ("sparse", "jax_jacrev"),
         "dense/jax_jacrev": ("dense", "jax_jacrev")},
        colours=colours, mode=mode,
        passes={**passes, "how": f"counted: cotangent rows (tangent columns, forward) seen at "
                                 f"node A, one {mode} call each"},
        passes_equal_colours=passes["sparse"] == colours[mode],
        nnz={"pattern": int(pattern.nnz), "jacobian": int(np.count_nonzero(want)),
             "dense": cfg.n * cfg.n},
        detection={"times_s": detect_s, "median_s": statistics.median(detect_s)},
        checks={"max_abs_error": errors, "atol": ATOL})


def run(quick: bool, clients: dict) -> dict:
    cfg = QUICK if quick else FULL
    print(f"{TITLE}: x float32[{cfg.n}], 5 nodes of {cfg.layers} layers on blocks of "
          f"{BLOCK}", flush=True)
    cases = [measure_case(f"{shape}{'_jit' if jit else ''}", cfg, banded=shape == "banded", jit=jit)
             for jit in (False, True) for shape in ("block", "banded")]
    summary = "; ".join(
        f"{c['case']}: {c['colours'][c['mode']]} colours ({c['mode']}), "
        f"{c['passes']['sparse']} passes counted (dense: {c['passes']['dense']}), "
        f"pattern nnz {c['nnz']['pattern']}, detection {c['detection']['median_s'] * 1e3:.1f} ms"
        for c in cases)
    return {"title": TITLE, "config": {**asdict(cfg), "block": BLOCK, "atol": ATOL},
            "description": f"Median seconds of {cfg.reps} runs of the Jacobian of E, float32"
                           f"[{cfg.n}, {cfg.n}], through 5 JAX nodes ({cfg.layers} layers "
                           f"of `tanh(h @ W)`, W 4x4, per node) on Dask's threaded scheduler: "
                           f"eager nodes, and `jit=True` nodes (cases `_jit`). "
                           f"`dense`: `daskdag.jacobian` (auto: reverse, {cfg.n} rows); `sparse`: "
                           f"`sparsity=` the pattern of `jacobian_sparsity`, found beforehand; "
                           f"`sparse_scipy`: also `sparse=True`; `detect_and_sparse`: "
                           f"`sparsity=\"detect\"`; `jax_jacrev`: `jax.jacrev` of the composed "
                           f"function (`jax.jit` of it in the `_jit` cases). Every result within {ATOL:g} of `jax_jacrev`'s. "
                           f"Passes counted at node A, each equal to the pattern's colours: "
                           f"{summary}.",
            "targets": [] if quick else common.targets(cases, TARGETS), "cases": cases}


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    print(json.dumps(run(parser.parse_args().quick, {})["cases"], indent=1, default=float))
