"""Chaos: a 6-worker cluster under nannies, one random worker SIGKILLed every 3 s (the nanny
restarts it), through a long sweep_grads and then a loop of compute_grads calls. Every item and
every call must come out right, none lost, no call may hang or mistake a dead worker for a
version mismatch, distributed must log no defect, and afterwards the scheduler holds nothing
but the values daskdag keeps for later calls."""

import os
import random
import threading
import time

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import daskdag

from .support.clusters import local_client, scheduler_tasks, wait_only_kept_left
from .support.faults import KEEP_NANNIES, bounded, not_a_mismatch, sigkill
from .support.numbers import assert_tree_close

WORKERS = 6
KILL_EVERY = 3.0  # seconds between two kills
ITEMS = 1000
ITEM_PAUSE = 0.2  # seconds per item: 1000 items on 6 workers, 33 s of sleeping per worker
CHUNK = 5  # items per chunk: ~1 s each, so a chunk is seldom caught by several kills in a row
SWEEP_BOUND = 150.0  # seconds the sweep may take
LOOP_FOR = 20.0  # seconds of compute_grads calls
CALL_BOUND = 60.0  # seconds one of them may take


class Chaos(threading.Thread):
    """Every ``every`` seconds, SIGKILLs one worker process chosen at random among those that
    answer (``client.run``). ``kills``: the pids killed."""

    def __init__(self, client, every=KILL_EVERY, seed=0):
        super().__init__(daemon=True, name="chaos")
        self.client, self.every, self.rng = client, every, random.Random(seed)
        self.stopped, self.kills, self.errors = threading.Event(), [], []

    def run(self):
        while not self.stopped.wait(self.every):
            try:
                pids = [p for p in self.client.run(os.getpid, on_error="return").values()
                        if isinstance(p, int)]
            except Exception as e:  # (the scheduler is busy with the dead; try at the next tick)
                self.errors.append(e)
                continue
            if pids:
                self.kills.extend(sigkill([self.rng.choice(sorted(pids))]))

    def stop(self):
        self.stopped.set()
        self.join(30)


def slow_encode(x, w):
    time.sleep(ITEM_PAUSE)
    return jnp.tanh(w * x)


def loss(h):
    return jnp.sum(h ** 2)


def pause(seconds):
    def node(v):
        time.sleep(seconds)
        return jnp.sin(v) + 1.5

    return node


def loop_dag():
    return {"A": (pause(0.2), ["x"]), "B": (pause(0.2), ["A"]),
            "C": (lambda B: jnp.sum(jnp.log(B)), ["B"]),
            "E": (lambda B: jnp.sum(B * jnp.arange(B.shape[0])), ["B"])}


def loop_ref(x):
    B = jnp.sin(jnp.sin(x) + 1.5) + 1.5
    return {"C": jnp.sum(jnp.log(B)), "E": jnp.sum(B * jnp.arange(B.shape[0]))}


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_random_worker_killed_every_3s_through_a_sweep_and_a_loop_of_calls(distributed_log):
    w = np.linspace(0.5, 1.5, 4).astype(np.float32)
    xs = np.random.default_rng(0).uniform(-1.0, 1.0, (ITEMS, 4)).astype(np.float32)
    sweep_dag = {"H": (slow_encode, ["x", "w"]), "L": (loss, ["H"])}
    with dask.config.set(KEEP_NANNIES), local_client(WORKERS) as client:
        before = scheduler_tasks(client)
        # a warm-up sweep (the workers import JAX), then the sweep under chaos
        daskdag.sweep_grads(sweep_dag, {"x": xs[:2 * WORKERS], "w": w}, "L", batched=["x"],
                            chunk_size=2, client=client)
        chaos = Chaos(client)
        chaos.start()
        try:
            res, took = bounded(lambda: not_a_mismatch(lambda: daskdag.sweep_grads(
                sweep_dag, {"x": xs, "w": w}, "L", batched=["x"], chunk_size=CHUNK,
                errors="collect", client=client)), SWEEP_BOUND, "the sweep under chaos")
            swept = len(chaos.kills)
            print(f"sweep of {ITEMS} items: {took:.1f} s, {swept} workers killed")
            assert swept >= 5, "too few kills landed during the sweep to test anything"
            assert not res.failed, {i: str(e) for i, e in list(res.failed.items())[:5]}
            assert not np.isnan(res.value).any() and not np.isnan(res.grad["x"]).any()
            value, grad = jax.vmap(jax.value_and_grad(lambda x: loss(jnp.tanh(w * x))))(xs)
            assert_tree_close(res.value, value, rtol=1e-5)
            assert_tree_close(res.grad["x"], grad, rtol=1e-5)
            del res
            distributed_log.check()

            # compute_grads calls, one after another, for LOOP_FOR seconds: the same input
            # again and again (what the cluster keeps is lost and recomputed) and new ones
            dag, x0 = loop_dag(), jnp.linspace(-1.0, 1.0, 5)
            calls, slowest, start = 0, 0.0, time.monotonic()
            while time.monotonic() - start < LOOP_FOR:
                x = x0 if calls % 2 else x0 + 0.01 * calls
                r, took = bounded(lambda: not_a_mismatch(lambda: daskdag.compute_grads(
                    dag, x, ["C", "E"], client=client)), CALL_BOUND, f"call {calls} under chaos")
                for o in ("C", "E"):
                    value, grad = jax.value_and_grad(lambda x: loop_ref(x)[o])(x)
                    assert_tree_close(r[o].value, value, rtol=1e-5)
                    assert_tree_close(r[o].grad, grad, rtol=1e-5)
                calls, slowest = calls + 1, max(slowest, took)
            print(f"{calls} compute_grads calls in {time.monotonic() - start:.1f} s (slowest "
                  f"{slowest:.1f} s), {len(chaos.kills) - swept} workers killed meanwhile")
        finally:
            chaos.stop()
        assert len(chaos.kills) - swept >= 5
        client.wait_for_workers(WORKERS, timeout=120)
        distributed_log.check()
        wait_only_kept_left(client, before, timeout=60, what="the sweep and the calls")
