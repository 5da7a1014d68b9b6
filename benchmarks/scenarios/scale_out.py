"""Scenario: scaling out to W slots, on nodes that wait (a solver, a GPU kernel) rather than compute.

For each shape (W single-thread workers, W = 4, 8, 16; and 4 workers of 8 threads, 32 slots; a
quick run: 4x1 and 2x4) the scenario starts its own default cluster, one at a time:
``distributed.LocalCluster(n_workers=w, threads_per_worker=t, processes=True,
dashboard_address=None)`` with distributed's defaults, and a ``Client(cluster,
set_as_default=False)``; this process's environment is kept as ``common._environ_kept`` keeps
it. The nodes mostly sleep (releasing the GIL), so every slot on a 2-core machine can be busy at
once. ``W`` below is the number of slots, ``w * t``.

wide:   4W independent branches ``x -> S_i``, each ``time.sleep(0.25)`` then ``sin(x * (i + 1))``
        on float32[8], and one scalar ``head`` summing them all; the value and gradient of
        ``head``.
        daskdag:       ``daskdag.compute_grads(dag, x, "head", client=client)``.
        hand_written:  the same work as a hand-written Dask graph: one ``dask.delayed`` task per
                       branch doing ``jax.value_and_grad`` of its share (the sum of its branch's
                       output), summed by one task, on the same client (the folded graph).
        Ideal: the total waiting over W slots, (4W * 0.25 s) / W = 1 s.
deep:   4 layers of 4W branches, each ``time.sleep(0.1)`` then JAX arithmetic: layer 0 takes x,
        branch i of a later layer takes branches i and i + 1 (mod 4W) of the layer before; two
        scalar outputs sum half of the last layer each; the values and gradients of both.
        daskdag:       ``daskdag.compute_grads(dag, x, ["out0", "out1"], client=client)``.
        two_phase:     the general schedule a user writes by hand for such a DAG: per node a
                       forward task keeping its ``jax.vjp`` (value and pullback, which cannot
                       be pickled, so each node's tasks are pinned round-robin to a worker with
                       ``dask.annotate(workers=...)``), a task taking its value out, and a
                       backward task pulling both outputs' cotangents back; each output's head
                       forward and backward in one task; one task per output summing x's
                       shares. There is no folded graph for it: a branch's share depends on
                       other branches.
        Ideal: 4 layers * 4 * 0.1 s = 1.6 s.
sweeps: 100W items, each item's node ``time.sleep(0.02)`` then ``tanh(x * w)``, the loss the
        sum of squares; ``x`` batched (float32[100W, 8]), ``w`` shared.
        daskdag:  ``daskdag.sweep_grads(dag, {"x": xs, "w": w}, "loss", batched=["x"],
                  client=client)``, its default chunk size.
        delayed:  ``dask.delayed`` over the same chunks of items (the chunk size daskdag's
                  default gives, ``max(1, min(256, ceil(N / (4 * threads))))``, recorded), each
                  chunk task doing ``jax.value_and_grad`` item by item of the composed
                  function, all chunks computed at once with ``dask.compute(*parts,
                  scheduler=client)`` and stacked.
        Ideal: N * 0.02 s / W = 2 s.

Each method runs once first (warm-up: compiles, places things), daskdag checked against the
other method (values and gradients, ``np.testing.assert_allclose``, rtol 1e-5); then the
methods are timed interleaved (``common.interleaved``), each repetition on a fresh input
(``x + rep * 1e-3``) so that nothing is served from an earlier identical call. Efficiency is
ideal / median time, reported as the ratios ``efficiency_<method>``, next to the ratio of the
medians ``daskdag/<baseline>``.

The diagnosis (``branch_tasks`` of each wide and deep case, from ``distributed.get_task_stream``):
for each timed call of each method, how many branches (forward tasks) ran on each worker (ideal:
4 per slot per layer), and the call's timeline: before the first branch started, from it to the
last branch's end, and the tail after it, broken into its parts (``tail``: per kind of task that
ran after the last branch ended, when the first of them started and the last ended, relative to
that end, and their compute and transfer seconds; ``return``: from the last task's end to the
call's end). ``tail_ratio``: daskdag's median tail over the baseline's. For sweeps,
``cpu_floor_s``: the delayed method's own work per item without the waiting, timed in this
process, times N over the machine's cores, a floor that the waiting does not set (on 2 cores,
100W items' JAX work can exceed N * 0.02 / W).

Targets (issue 30), at each shape: wide and deep ``efficiency_daskdag >= 0.85`` and
``daskdag/<baseline> <= 1.0``, the wide tail ``tail_ratio <= 2``; sweeps ``daskdag/delayed <= 1.0``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable, Iterator

import dask
from dask.utils import key_split
import distributed
import jax
import jax.numpy as jnp
import numpy as np

import daskdag

from .. import common, report
TITLE = "Scale-out to W slots (nodes that wait)"
DESCRIPTION = ("nodes that wait, on default clusters of W = 4, 8, 16 workers that it starts "
               "itself: ``compute_grads`` of a wide DAG and ``sweep_grads`` against "
               "hand-written Dask graphs, as efficiency against the ideal")
CLUSTERS = None  # starts a cluster of its own per shape
RTOL = 1e-5
STEP = 1e-3  # each repetition's input is the warm-up's plus rep * STEP
WHERE = "a default LocalCluster the scenario starts (workers x threads as the case says)"


@dataclass(frozen=True)
class Config:
    shapes: tuple[tuple[int, int], ...]  # (workers, threads per worker), one cluster each
    reps: int  # timed repetitions per method, after one warm-up
    branches_per_slot: int = 4  # wide and deep: 4W branches (per layer)
    wide_wait_s: float = 0.25  # wide: each branch's wait
    layers: int = 4  # deep: layers of branches
    deep_wait_s: float = 0.1  # deep: each node's wait
    items_per_slot: int = 100  # sweeps: 100W items
    item_wait_s: float = 0.02  # sweeps: each item's wait
    width: int = 8  # x (an item of xs) is float32[width]
    start_timeout_s: float = 300.0  # for all workers to join


FULL = Config(shapes=((4, 1), (8, 1), (16, 1), (4, 8)), reps=3)
QUICK = Config(shapes=((4, 1), (2, 4)), reps=2)


def label(workers: int, threads: int) -> str:
    """A shape's name in case names: ``W=8`` for 8 single-thread workers, else ``4x8``."""
    return f"W={workers}" if threads == 1 else f"{workers}x{threads}"


# --- The clusters ------------------------------------------------------------------------------

def kind(n_workers: int, threads: int = 1) -> str:
    return (f"distributed.LocalCluster(n_workers={n_workers}, threads_per_worker={threads}, "
            f"processes=True, dashboard_address=None), distributed's defaults")


@contextlib.contextmanager
def cluster(n_workers: int, timeout: float, threads: int = 1) -> Iterator[distributed.Client]:
    """A default ``n_workers``-worker process cluster of ``threads`` threads each and a client of
    it (not the default client); this process's ``os.environ`` left as it was."""
    with common._environ_kept():
        local = distributed.LocalCluster(n_workers=n_workers, threads_per_worker=threads,
                                         processes=True, dashboard_address=None)
    with local, distributed.Client(local, set_as_default=False) as client:
        client.wait_for_workers(n_workers, timeout=timeout)
        yield client


class Fresh:
    """``fn(x)`` with a fresh input each call: the first call (the warm-up) gets ``x``, the
    k-th ``x + (k - 1) * STEP``. ``windows``: each call's (start, end) in ``time.time()``."""

    def __init__(self, fn: Callable, x):
        self.fn, self.x, self.calls, self.windows = fn, x, 0, []

    def __call__(self):
        x = self.x + np.float32(self.calls * STEP)
        self.calls += 1
        start = time.time()
        out = jax.block_until_ready(self.fn(x))
        self.windows.append((start, time.time()))
        return out


# --- wide: 4W branches that wait, one head --------------------------------------------------------

def branch(wait: float, i: int, x):
    time.sleep(wait)  # standing in for a solver or a GPU kernel
    return jnp.sin(x * (i + 1))


def total(*branches):
    return sum(jnp.sum(s) for s in branches)


def wide_dag(n: int, wait: float) -> dict:
    dag = {f"S{i}": (partial(branch, wait, i), ["x"]) for i in range(n)}
    dag["head"] = (total, [f"S{i}" for i in range(n)])
    return dag


def wide_daskdag(dag: dict, client, x):
    r = daskdag.compute_grads(dag, x, "head", client=client)
    return r.value, r.grad


def branch_share(wait: float, i: int, x):
    """One branch's share of the head: its value and gradient."""
    return jax.value_and_grad(lambda x: jnp.sum(branch(wait, i, x)))(x)


def add_shares(*shares):
    return sum(s[0] for s in shares), sum(s[1] for s in shares)


def wide_hand_written(n: int, wait: float, client, x):
    shares = [dask.delayed(branch_share, pure=True)(wait, i, x) for i in range(n)]
    (out,) = dask.compute(dask.delayed(add_shares, pure=True)(*shares), scheduler=client)
    return out


# --- deep: layers of 4W branches, fan-in between layers, two outputs ----------------------------

def mix(wait: float, i: int, a, b):
    time.sleep(wait)
    return jnp.sin(a * (1.0 + 0.01 * i) + 0.5 * b)


def deep_names(n: int, layers: int) -> list[list[str]]:
    return [[f"L{k}_{i}" for i in range(n)] for k in range(layers)]


def deep_dag(n: int, layers: int, wait: float) -> dict:
    names = deep_names(n, layers)
    dag = {names[0][i]: (partial(branch, wait, i), ["x"]) for i in range(n)}
    for k in range(1, layers):
        for i in range(n):
            dag[names[k][i]] = (partial(mix, wait, i), [names[k - 1][i], names[k - 1][(i + 1) % n]])
    dag["out0"] = (total, names[-1][:n // 2])
    dag["out1"] = (total, names[-1][n // 2:])
    return dag


def deep_daskdag(dag: dict, client, x):
    r = daskdag.compute_grads(dag, x, ["out0", "out1"], client=client)
    return [r["out0"].value, r["out1"].value, r["out0"].grad, r["out1"].grad]


def node_forward(fn, *args):
    """A node's value and pullback (``jax.vjp``): kept on the worker that ran it."""
    return jax.vjp(fn, *args)


def node_value(out):
    return out[0]


def node_backward(out, *shares):
    """Per output, the node's cotangent (the sum of its consumers' ``shares``, each a per-output
    list of cotangents or None) pulled back to its inputs."""
    value, pullback = out
    per_output = [[s[o] for s in shares if s[o] is not None] for o in range(len(shares[0]))]
    return [pullback(sum(cts)) if cts else None for cts in per_output]


def pick_share(cts, position: int):
    """The share a backward task sent to its ``position``-th input, per output."""
    return [None if c is None else c[position] for c in cts]


def head_forward_backward(*values):
    value, pullback = jax.vjp(total, *values)
    return value, pullback(jnp.ones_like(value))


def head_share(out, position: int, output: int, outputs: int):
    """A head's cotangent for its ``position``-th input, in the per-output list of its output."""
    return [out[1][position] if o == output else None for o in range(outputs)]


def grad_sum(output: int, *shares):
    return sum(s[output] for s in shares if s[output] is not None)


def deep_two_phase(n: int, layers: int, wait: float, client, x):
    """The two-phase schedule (see the module's docstring), node (k, i) pinned to worker
    ``i mod w``."""
    addresses = common.workers(client)
    names = deep_names(n, layers)
    fns = {names[0][i]: partial(branch, wait, i) for i in range(n)}
    fns.update({names[k][i]: partial(mix, wait, i) for k in range(1, layers) for i in range(n)})
    deps = {names[0][i]: ["x"] for i in range(n)}
    deps.update({names[k][i]: [names[k - 1][i], names[k - 1][(i + 1) % n]]
                 for k in range(1, layers) for i in range(n)})
    delayed = partial(dask.delayed, pure=True)
    fwd, val, bwd = {}, {"x": x}, {}
    for k in range(layers):
        for i in range(n):
            name = names[k][i]
            with dask.annotate(workers=[addresses[i % len(addresses)]], allow_other_workers=False):
                fwd[name] = delayed(node_forward)(fns[name], *[val[d] for d in deps[name]])
                val[name] = delayed(node_value)(fwd[name])
    halves = [names[-1][:n // 2], names[-1][n // 2:]]
    heads = [delayed(head_forward_backward)(*[val[m] for m in half]) for half in halves]
    shares: dict[str, list] = {m: [] for m in fns}  # node -> its consumers' shares
    for o, half in enumerate(halves):
        for position, m in enumerate(half):
            shares[m].append(delayed(head_share)(heads[o], position, o, len(halves)))
    grads_x = []
    for k in reversed(range(layers)):
        for i in range(n):
            name = names[k][i]
            with dask.annotate(workers=[addresses[i % len(addresses)]], allow_other_workers=False):
                bwd[name] = delayed(node_backward)(fwd[name], *shares[name])
            for position, d in enumerate(deps[name]):
                share = delayed(pick_share)(bwd[name], position)
                (grads_x if d == "x" else shares[d]).append(share)
    outs = [delayed(node_value)(h) for h in heads] + [delayed(grad_sum)(o, *grads_x)
                                                      for o in range(len(halves))]
    return list(dask.compute(*outs, scheduler=client))


# --- Where the branches ran, and the tail -------------------------------------------------------

def branch_tasks(data: list[dict], classify: Callable[[str], tuple[str, int]],
                 windows: list[tuple[float, float]], workers: list[str], ideal: float) -> dict:
    """Where and when the branch tasks of each timed call ran, and what ran after them:
    ``data`` the task stream (``distributed.get_task_stream``), ``classify(key)`` a task's kind
    and how many branches it runs (0: not a branch task), ``windows`` each call's (start, end)
    in ``time.time()``, ``workers`` the cluster's addresses in the order to report, ``ideal``
    the branches per worker of an even spread.

    Out, ``ideal_per_worker`` and ``calls``, one entry per call: ``per_worker`` (branches run
    on each worker), ``busiest`` and ``idle_workers``; the call's timeline:
    ``before_first_s`` (from the call's start to the first branch task's start: building,
    sending, scheduling), ``branches_s`` (first branch start to last branch end) and
    ``after_last_s`` (last branch end to the call's end, the tail); and the tail's parts,
    ``tail``: per kind of task that ran after the last branch's end, ``start_s`` and
    ``end_s`` (its first start and last end, from that end), ``compute_s`` and
    ``transfer_s`` (summed over its tasks), ``tasks``; and ``return_s``, from the last task's
    end to the call's end."""
    calls = [{"counts": Counter(), "starts": [], "stops": [], "others": []} for _ in windows]
    outside = 0
    for task in data:
        what, found = classify(str(task.get("key")))
        compute = [s for s in task.get("startstops", ()) if s.get("action") == "compute"]
        if not compute:
            continue
        start, stop = compute[0]["start"], compute[0]["stop"]
        k = next((k for k, (a, b) in enumerate(windows) if a <= start <= b), None)
        if k is None:
            outside += found
            continue
        if not found:
            moved = sum(s["stop"] - s["start"] for s in task["startstops"]
                        if s.get("action") == "transfer")
            calls[k]["others"].append((what, start, stop, moved))
            continue
        calls[k]["counts"][task.get("worker")] += found
        calls[k]["starts"].append(start)
        calls[k]["stops"].append(stop)
    out = []
    for (a, b), call in zip(windows, calls):
        counts = [call["counts"].get(w, 0) for w in workers]
        entry = {"per_worker": counts, "busiest": max(counts), "idle_workers": counts.count(0)}
        if call["starts"]:
            first, last = min(call["starts"]), max(call["stops"])
            entry.update(before_first_s=first - a, branches_s=last - first, after_last_s=b - last)
            tail: dict = {}
            for what, start, stop, moved in call["others"]:
                if stop <= last:
                    continue
                part = tail.setdefault(what, {"start_s": math.inf, "end_s": -math.inf,
                                              "compute_s": 0.0, "transfer_s": 0.0, "tasks": 0})
                part["start_s"] = min(part["start_s"], start - last)
                part["end_s"] = max(part["end_s"], stop - last)
                part["compute_s"] += stop - start
                part["transfer_s"] += moved
                part["tasks"] += 1
            entry["tail"] = dict(sorted(tail.items(), key=lambda kv: kv[1]["start_s"]))
            ends = [p["end_s"] for p in tail.values()]
            entry["return_s"] = (b - last) - max(ends, default=0.0)
        out.append(entry)
    result = {"ideal_per_worker": ideal, "calls": out}
    if outside:
        result["outside_calls"] = outside
    if not any(sum(c["per_worker"]) for c in out):
        result["note"] = "no branch task found in the task stream (has the key format changed?)"
    return result


def daskdag_tasks(branches: list[str]) -> Callable[[str], tuple[str, int]]:
    """A daskdag key's kind (``fwd``, ``val``, ``bwd``, ``grad``; a forward task of a branch
    node is ``fwd``, of any other ``fwd (other)``) and how many of the nodes ``branches`` it
    runs forward: the key names them as whole words (a fused key may name several)."""
    name = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, branches))
                      + r")(?![A-Za-z0-9_])")

    def classify(key: str) -> tuple[str, int]:
        kind = key.partition(":")[0] if ":" in key.partition("-")[0] else key.partition("-")[0]
        if kind == "fwd":
            found = len(name.findall(key.partition("[")[0]))
            return ("fwd" if found else "fwd (other)"), found
        return kind, 0

    return classify


def dask_tasks(*branch_functions: str) -> Callable[[str], tuple[str, int]]:
    """A hand-written graph's key's kind, its function's name (``dask.utils.key_split``), and 1
    for the tasks of ``branch_functions``."""
    def classify(key: str) -> tuple[str, int]:
        kind = key_split(key)
        return kind, int(kind in branch_functions)

    return classify


def tail_ratio(c: dict, method: str, baseline: str) -> float | None:
    """The median call's tail (``after_last_s``) of ``method`` over ``baseline``'s."""
    med = {}
    for m in (method, baseline):
        tails = sorted(k["after_last_s"] for k in c["branch_tasks"][m]["calls"]
                       if "after_last_s" in k)
        if not tails:
            return None
        med[m] = tails[len(tails) // 2]
    return med[method] / med[baseline]


def _timed_with_stream(client, runs: dict, reps: int, text: str) -> tuple[dict, list, float]:
    got = [r() for r in runs.values()]  # warm-up, checked
    for g, r in zip(jax.tree.leaves(got[0]), jax.tree.leaves(got[1])):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=RTOL)
    for r in runs.values():
        r.windows.clear()
    with distributed.get_task_stream(client) as stream:
        times = common.interleaved(runs, reps, text)
    return times, stream.data, common.worst_difference(got[0], got[1])


def wide(cfg: Config, shape: tuple[int, int], client) -> dict:
    w = shape[0] * shape[1]
    n, wait = cfg.branches_per_slot * w, cfg.wide_wait_s
    text = f"wide {label(*shape)}: "
    print(f"{TITLE}, {text}", flush=True)
    dag = wide_dag(n, wait)
    x = jnp.linspace(0.01, 0.02, cfg.width, dtype=jnp.float32)  # every sin(x * (i + 1)) > 0
    runs = {"daskdag": Fresh(partial(wide_daskdag, dag, client), x),
            "hand_written": Fresh(partial(wide_hand_written, n, wait, client), x)}
    times, data, diff = _timed_with_stream(client, runs, cfg.reps, text)
    c = _efficiency(common.case(f"wide, {label(*shape)}", _params(shape, branches=n, wait_s=wait),
                                times, {"daskdag/hand_written": ("daskdag", "hand_written")}),
                    n * wait / w)
    addresses = common.workers(client)
    per_worker = cfg.branches_per_slot * shape[1]
    c["branch_tasks"] = {
        "daskdag": branch_tasks(data, daskdag_tasks([f"S{i}" for i in range(n)]),
                                runs["daskdag"].windows, addresses, per_worker),
        "hand_written": branch_tasks(data, dask_tasks(branch_share.__name__),
                                     runs["hand_written"].windows, addresses, per_worker)}
    _tail(c, "hand_written")
    c["max_rel_diff"] = diff
    return c


def deep(cfg: Config, shape: tuple[int, int], client) -> dict:
    w = shape[0] * shape[1]
    n, wait, layers = cfg.branches_per_slot * w, cfg.deep_wait_s, cfg.layers
    text = f"deep {label(*shape)}: "
    print(f"{TITLE}, {text}", flush=True)
    dag = deep_dag(n, layers, wait)
    x = jnp.linspace(0.01, 0.02, cfg.width, dtype=jnp.float32)
    runs = {"daskdag": Fresh(partial(deep_daskdag, dag, client), x),
            "two_phase": Fresh(partial(deep_two_phase, n, layers, wait, client), x)}
    times, data, diff = _timed_with_stream(client, runs, cfg.reps, text)
    c = _efficiency(common.case(f"deep, {label(*shape)}",
                                _params(shape, branches=n, layers=layers, wait_s=wait), times,
                                {"daskdag/two_phase": ("daskdag", "two_phase")}),
                    layers * n * wait / w)
    addresses = common.workers(client)
    per_worker = cfg.branches_per_slot * shape[1] * layers
    branches = [m for row in deep_names(n, layers) for m in row]
    c["branch_tasks"] = {
        "daskdag": branch_tasks(data, daskdag_tasks(branches), runs["daskdag"].windows,
                                addresses, per_worker),
        "two_phase": branch_tasks(data, dask_tasks(node_forward.__name__),
                                  runs["two_phase"].windows, addresses, per_worker)}
    _tail(c, "two_phase")
    c["max_rel_diff"] = diff
    return c


def _params(shape: tuple[int, int], **more) -> dict:
    return {"W": shape[0] * shape[1], "workers": shape[0], "threads": shape[1], **more}


def _tail(c: dict, baseline: str) -> None:
    ratio = tail_ratio(c, "daskdag", baseline)
    if ratio is not None:
        c["ratios"]["tail_ratio"] = ratio


# --- sweeps: 100W items that wait ---------------------------------------------------------------

def wait_then_tanh(wait: float, x, w):
    time.sleep(wait)
    return jnp.tanh(x * w)


def sum_of_squares(h):
    return jnp.sum(h ** 2)


def item_loss(wait: float, x, w):
    return sum_of_squares(wait_then_tanh(wait, x, w))


def sweep_dag(wait: float) -> dict:
    return {"h": (partial(wait_then_tanh, wait), ["x", "w"]), "loss": (sum_of_squares, ["h"])}


def default_chunk_size(items: int, threads: int) -> int:
    """daskdag's default chunk size for item-by-item nodes, as its docs state it."""
    return max(1, min(256, math.ceil(items / (4 * threads))))


def sweep_daskdag(dag: dict, w, client, xs):
    r = daskdag.sweep_grads(dag, {"x": xs, "w": w}, "loss", batched=["x"], client=client)
    grad = r.grad["x"] if isinstance(r.grad, dict) else r.grad
    return np.asarray(r.value), np.asarray(grad)


def chunk_grads(wait: float, xs, w):
    """Each item's loss and gradient with respect to its x, stacked."""
    f = jax.value_and_grad(partial(item_loss, wait))
    values, grads = zip(*(f(x, w) for x in xs))
    return np.stack(values), np.stack(grads)


def sweep_delayed(wait: float, w, chunk: int, client, xs):
    xs = np.asarray(xs)
    parts = [dask.delayed(chunk_grads, pure=True)(wait, xs[i:i + chunk], w)
             for i in range(0, len(xs), chunk)]
    done = dask.compute(*parts, scheduler=client)
    return np.concatenate([v for v, _ in done]), np.concatenate([g for _, g in done])


def cpu_per_item(xs, w, items: int = 50) -> float:
    """Seconds per item of ``chunk_grads``' own work (no waiting), in this process: the best of
    two timings after a warm-up."""
    chunk_grads(0.0, xs[:2], w)
    best = math.inf
    for _ in range(2):
        t = time.perf_counter()
        chunk_grads(0.0, xs[:items], w)
        best = min(best, time.perf_counter() - t)
    return best / items


def sweeps(cfg: Config, shape: tuple[int, int], client) -> dict:
    w = shape[0] * shape[1]
    n, wait = cfg.items_per_slot * w, cfg.item_wait_s
    text = f"sweeps {label(*shape)}: "
    print(f"{TITLE}, {text}", flush=True)
    threads = sum(info.get("nthreads", 1) for info in common.live_workers(client).values())
    chunk = default_chunk_size(n, threads)
    rng = np.random.default_rng(w)
    xs = rng.uniform(0.1, 1.0, (n, cfg.width)).astype(np.float32)
    wv = jnp.asarray(rng.uniform(0.5, 1.5, cfg.width).astype(np.float32))
    runs = {"daskdag": Fresh(partial(sweep_daskdag, sweep_dag(wait), wv, client), xs),
            "delayed": Fresh(partial(sweep_delayed, wait, wv, chunk, client), xs)}
    got, ref = runs["daskdag"](), runs["delayed"]()  # warm-up, checked
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=RTOL)
    times = common.interleaved(runs, cfg.reps, text)
    c = _efficiency(common.case(f"sweeps, {label(*shape)}",
                                _params(shape, items=n, wait_s=wait, chunk_size=chunk),
                                times, {"daskdag/delayed": ("daskdag", "delayed")}),
                    n * wait / w)
    c["max_rel_diff"] = common.worst_difference(got, ref)
    per_item = cpu_per_item(xs, wv)
    c["cpu_s_per_item"] = per_item
    c["cpu_floor_s"] = n * per_item / (os.cpu_count() or 1)
    return c


def _efficiency(c: dict, ideal: float) -> dict:
    """``c`` with ``ideal_s`` and, per method, ``efficiency`` = ideal / median, also as the
    ratio ``efficiency_<method>``."""
    c["ideal_s"] = ideal
    for m, record in c["methods"].items():
        record["efficiency"] = ideal / record["median_s"]
        c["ratios"][f"efficiency_{m}"] = record["efficiency"]
    return c


# --- The scenario ------------------------------------------------------------------------------

def wanted(shapes: tuple[tuple[int, int], ...]) -> list[dict]:
    out = []
    for shape in shapes:
        name = label(*shape)
        for case, base in (("wide", "hand_written"), ("deep", "two_phase")):
            out += [{"case": f"{case}, {name}", "ratio": "efficiency_daskdag", "op": ">=",
                     "bound": 0.85, "source": "issue 30"},
                    {"case": f"{case}, {name}", "ratio": f"daskdag/{base}", "op": "<=",
                     "bound": 1.0, "source": "issue 30"}]
        out += [{"case": f"wide, {name}", "ratio": "tail_ratio", "op": "<=", "bound": 2.0,
                 "source": "issue 30"},
                {"case": f"sweeps, {name}", "ratio": "daskdag/delayed", "op": "<=", "bound": 1.0,
                 "source": "issue 30"}]
    return out


def run(quick: bool, clients: dict) -> dict:
    """``clients`` (the runner's clusters) are not used: each shape gets a cluster of its own."""
    cfg = QUICK if quick else FULL
    cases, started = [], {}
    for shape in cfg.shapes:
        t = time.perf_counter()
        print(f"{TITLE}: starting {shape[0]} workers of {shape[1]} threads", flush=True)
        with cluster(shape[0], cfg.start_timeout_s, shape[1]) as client:
            started[label(*shape)] = time.perf_counter() - t
            for c in (wide(cfg, shape, client), deep(cfg, shape, client),
                      sweeps(cfg, shape, client)):
                c["cluster"] = kind(*shape)
                cases.append(c)
    return {"title": TITLE, "config": asdict(cfg), "cases": cases,
            "cluster_start_s": started,
            "where": {m: WHERE for m in ("daskdag", "hand_written", "two_phase", "delayed")},
            "targets": common.targets(cases, wanted(cfg.shapes))}


# --- Its report (benchmarks/report.py draws the rest) ---------------------------------------------

def section(s: dict) -> str:
    """A column per cluster shape: each case's efficiencies (ideal / median), the ratio to its
    baseline, the spread of the branch tasks; then the wide and deep tails, broken into their
    parts; then the medians per case."""
    cfg = s["config"]
    shapes: dict[str, dict] = {}
    for c in s["cases"]:
        kind, shape = c["case"].split(", ", 1)
        shapes.setdefault(shape, {})[kind] = c
    names = list(shapes)

    def eff(kind, m):
        def cell(d):
            c = d.get(kind)
            return f"{c['methods'][m]['efficiency']:.2f}" if c and m in c["methods"] else "–"
        return cell

    def ratio(kind, r):
        def cell(d):
            c = d.get(kind)
            return f"{c['ratios'][r]:.2f}" if c and r in c.get("ratios", {}) else "–"
        return cell

    def spread(kind, m):
        def cell(d):
            calls = (((d.get(kind) or {}).get("branch_tasks") or {}).get(m) or {}).get("calls", [])
            calls = [k for k in calls if sum(k["per_worker"])]
            return ", ".join(f"{max(k['per_worker'])}/{min(k['per_worker'])}" for k in calls) or "–"
        return cell

    rows = [("wide: daskdag", eff("wide", "daskdag")),
            ("wide: hand_written (folded)", eff("wide", "hand_written")),
            ("wide: daskdag / hand_written", ratio("wide", "daskdag/hand_written")),
            ("wide: tail, daskdag / hand_written", ratio("wide", "tail_ratio")),
            ("wide: branches per worker, daskdag", spread("wide", "daskdag")),
            ("wide: branches per worker, hand_written", spread("wide", "hand_written")),
            ("deep: daskdag", eff("deep", "daskdag")),
            ("deep: two_phase", eff("deep", "two_phase")),
            ("deep: daskdag / two_phase", ratio("deep", "daskdag/two_phase")),
            ("deep: tail, daskdag / two_phase", ratio("deep", "tail_ratio")),
            ("deep: branches per worker, daskdag", spread("deep", "daskdag")),
            ("deep: branches per worker, two_phase", spread("deep", "two_phase")),
            ("sweeps: daskdag", eff("sweeps", "daskdag")),
            ("sweeps: delayed", eff("sweeps", "delayed")),
            ("sweeps: daskdag / delayed", ratio("sweeps", "daskdag/delayed"))]
    table = report.table(["", *names], [[label, *(cell(shapes[n]) for n in names)]
                                        for label, cell in rows])
    head = ("For each shape (`W=k`: k single-thread workers; `wxt`: w workers of t threads), a "
            "default process `LocalCluster` that the scenario starts (one at a time; start-up "
            "took " + ", ".join(f"{float(t):.0f} s for {w}" for w, t in
                                 s.get("cluster_start_s", {}).items())
            + f"). W = slots (workers x threads). wide: {cfg['branches_per_slot']}W branches "
            f"that each wait {cfg['wide_wait_s']:g} s, summed by one scalar head, against the "
            f"folded hand-written graph (one `value_and_grad` task per branch, one sum); deep: "
            f"{cfg['layers']} layers of {cfg['branches_per_slot']}W branches that each wait "
            f"{cfg['deep_wait_s']:g} s, fan-in between layers, two outputs, against the "
            f"two-phase hand-written graph (forward tasks keeping each node's `jax.vjp`, "
            f"backward tasks pulling back, pinned round-robin); sweeps: "
            f"{cfg['items_per_slot']}W items that each wait {cfg['item_wait_s'] * 1e3:g} ms, "
            f"`sweep_grads` against `dask.delayed` over the same chunks. Efficiency = ideal / "
            f"median of {cfg['reps']} runs, the ideal being the waiting spread evenly over the W "
            f"slots: 1 is perfect. Branches per worker: for each timed call, the most and the "
            f"fewest branch (forward) tasks one worker ran; even is "
            f"{cfg['branches_per_slot']} per thread ({cfg['layers']} times that for deep).")
    tails = []
    for kind, base in (("wide", "hand_written"), ("deep", "two_phase")):
        tail_rows = []
        for n in names:
            c = shapes[n].get(kind)
            for m in ("daskdag", base):
                entry = _median_call(c, m)
                if entry is None:
                    continue
                parts = "; ".join(
                    f"`{what}` x{p['tasks']} {p['start_s'] * 1e3:+.0f}..{p['end_s'] * 1e3:+.0f} ms"
                    f" (compute {p['compute_s'] * 1e3:.0f}, transfer {p['transfer_s'] * 1e3:.0f})"
                    for what, p in entry.get("tail", {}).items())
                tail_rows.append([n, m, report.seconds(entry["before_first_s"]),
                                  report.seconds(entry["branches_s"]),
                                  report.seconds(entry["after_last_s"]), parts or "–",
                                  report.seconds(entry.get("return_s", 0.0))])
        tails.append(
            f"The {kind} case's median call: before the first branch, the branches, and the "
            f"tail after the last branch's end, in its parts: each kind of task that ran after "
            f"that end (daskdag's by key kind; the hand-written graph's by function), when the "
            f"first of them started and the last ended relative to it, and their compute and "
            f"transfer time summed; `return`: from the last task's end to the call's end.\n\n"
            + report.table(["shape", "method", "before", "branches", "tail", "tail's parts",
                            "return"], tail_rows))

    def med(c, m):
        return report.seconds(c["methods"][m]["median_s"]) if m in c["methods"] else "–"

    case_rows = []
    for c in s["cases"]:
        base = next(m for m in c["methods"] if m != "daskdag")
        r = f"daskdag/{base}"
        floor = report.seconds(c["cpu_floor_s"]) if "cpu_floor_s" in c else "–"
        case_rows.append([c["case"], med(c, "daskdag"), f"{med(c, base)} (`{base}`)",
                          report.seconds(c["ideal_s"]),
                          f"{c['ratios'][r]:.2f}" if r in c["ratios"] else "–",
                          str(c["params"].get("chunk_size", "–")), floor])
    cases = ("Median times per case; `CPU floor` (sweeps): the delayed method's own JAX work "
             "per item, without the waiting, timed in this process, times N over the "
             "machine's cores, a bound the waiting does not set.\n\n"
             + report.table(["case", "daskdag", "baseline", "ideal", "daskdag / baseline",
                             "chunk", "CPU floor"], case_rows))
    return "\n\n".join([head, table, *tails, cases])


def _median_call(c: dict | None, m: str) -> dict | None:
    """Of a case's timed calls of method ``m``, the one with the median time (its timeline)."""
    calls = [k for k in (((c or {}).get("branch_tasks") or {}).get(m) or {}).get("calls", [])
             if "branches_s" in k]
    if not calls:
        return None
    return sorted(calls, key=lambda k: k["before_first_s"] + k["branches_s"]
                  + k["after_last_s"])[len(calls) // 2]


def plot(s: dict, ax_row) -> None:
    """Efficiency per cluster shape; the median call's tail, wide and deep."""
    ax, tail_ax = ax_row
    shapes = list(dict.fromkeys(c["case"].split(", ", 1)[1] for c in s["cases"]))
    lines = [("wide", "daskdag"), ("wide", "hand_written"), ("deep", "daskdag"),
             ("deep", "two_phase"), ("sweeps", "daskdag"), ("sweeps", "delayed")]
    for j, (kind, m) in enumerate(lines):
        pts = [(shapes.index(c["case"].split(", ", 1)[1]), c["methods"][m]["efficiency"])
               for c in s["cases"] if c["case"].startswith(kind) and m in c["methods"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{kind}: {m}", color=f"C{j // 2}",
                    linestyle="-" if m == "daskdag" else "--")
    ax.axhline(1, color="black", linewidth=0.8)
    ax.axhline(0.85, color="gray", linewidth=0.8, linestyle=":", label="target (0.85)")
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("cluster shape")
    ax.set_ylabel("efficiency (ideal / median)")
    ax.set_title("efficiency")
    ax.legend(fontsize=7)
    width = 0.2
    for j, (kind, base) in enumerate((("wide", "hand_written"), ("deep", "two_phase"))):
        for k, m in enumerate(("daskdag", base)):
            pts = []
            for i, shape in enumerate(shapes):
                c = next((c for c in s["cases"] if c["case"] == f"{kind}, {shape}"), None)
                entry = _median_call(c, m)
                if entry is not None:
                    pts.append((i + (2 * j + k - 1.5) * width, entry["after_last_s"]))
            if pts:
                tail_ax.bar(*zip(*pts), width=width, label=f"{kind}: {m}", color=f"C{j}",
                            alpha=1.0 if m == "daskdag" else 0.5)
    tail_ax.set_xticks(range(len(shapes)), shapes)
    tail_ax.set_xlabel("cluster shape")
    tail_ax.set_ylabel("seconds after the last branch")
    tail_ax.set_title("the tail (median call)")
    tail_ax.legend(fontsize=7)


PLOT_AXES = 2  # the axes, in a row, that plot draws on
