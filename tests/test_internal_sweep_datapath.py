"""A sweep's data path on a cluster: a chunk's items travel inside its task (so the scheduler
can run it again wherever it likes: nothing is scattered), its results come back as NumPy, a
chunk killed with its worker runs again (the scheduler's doing), one lost too often is sent
again by the sweep or fails it clearly, a shared input lost with its only holder is computed
again, and nothing of the sweep stays on the cluster; and how many items a chunk holds by
default (about four chunks per parallel slot, within bounds of memory)."""

import logging
import os
import pickle
import signal
import tempfile
import time

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed.diagnostics.plugin import SchedulerPlugin

import daskdag
from daskdag import Node
from daskdag.errors import ClusterError
from daskdag.running import compute
from daskdag.sweeps import engines

from .support.clusters import eventually, local_client, scheduler_tasks, wait_only_kept_left
from .support.keys import key_kind, key_label
from .support.numbers import assert_tree_close

ITEMS, SIZE = 8, 16384  # items of float32[16384]: 64 KB each


def encode(x, w):
    return jnp.tanh(x * w)


def energy(h):
    if jnp.mean(h) > -2.0:  # a Python branch on a value: item by item, as eager users write it
        return jnp.mean(h ** 2)
    return jnp.mean(h)


#: Where :func:`slow_energy` notes the process of each item it starts.
STARTED = os.path.join(tempfile.gettempdir(), f"daskdag-datapath-{os.getpid()}")


def slow_energy(h):
    import os

    with open(STARTED, "a") as started:
        started.write(f"{os.getpid()}\n")
    time.sleep(0.2)  # each item: long enough to kill a worker while its chunk runs
    return jnp.mean(h ** 2)


DAG = {"H": (encode, ["x", "w"]), "E": (energy, ["H"])}


def inputs(n=ITEMS):
    xs = jax.random.normal(jax.random.key(0), (n, SIZE))
    return {"x": xs, "w": jnp.float32(0.5)}


def expected(values):
    def one(x):
        return energy(encode(x, values["w"]))
    out = [jax.value_and_grad(one)(x) for x in values["x"]]
    return np.stack([v for v, _ in out]), np.stack([g for _, g in out])


class Specs(SchedulerPlugin):
    """Records the pickled size of every task the scheduler receives."""

    def __init__(self):
        self.sizes = {}

    def update_graph(self, scheduler, *, keys, **kwargs):
        for key in keys:
            ts = scheduler.tasks.get(key)
            if ts is not None and ts.run_spec is not None:
                self.sizes[key] = len(pickle.dumps(ts.run_spec, protocol=5))


def task_sizes(dask_scheduler):
    return dict(dask_scheduler.plugins["record-specs"].sizes)


def is_graph(key) -> bool:
    return (key_kind(key), key_label(key)) == ("sweep", "graph")


class Logged(logging.Handler):
    """distributed's log lines, in the test process (where a LocalCluster's scheduler runs)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("distributed").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("distributed").removeHandler(self)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_items_travel_in_their_chunks_task_and_results_come_back_as_numpy(monkeypatch):
    values = inputs()
    gathered = []
    result = engines.Cluster.result

    def recording(self, chunk):
        out = result(self, chunk)
        gathered.append(out)
        return out

    monkeypatch.setattr(engines.Cluster, "result", recording)
    with local_client() as client:
        client.register_plugin(Specs(), name="record-specs")
        before = scheduler_tasks(client)
        res = daskdag.sweep_grads(DAG, values, "E", batched=["x"], chunk_size=4, client=client)
        sizes = client.run_on_scheduler(task_sizes)
        wait_only_kept_left(client, before, what="the sweep")
    value, grad = expected(values)
    assert_tree_close(res.value, value, rtol=1e-5)
    assert_tree_close(res.grad["x"], grad, rtol=1e-5)
    assert isinstance(res.value, np.ndarray) and isinstance(res.grad["x"], np.ndarray)

    chunk_bytes = 4 * SIZE * 4  # the items of one chunk: 256 KB
    chunks = {k: n for k, n in sizes.items() if str(k).startswith("_run_chunk")}
    assert len(chunks) == ITEMS // 4
    # Each task carries its own items (and not the graph, sent once, nor the others' items).
    assert all(chunk_bytes <= n < 1.25 * chunk_bytes for n in chunks.values()), chunks
    assert not [k for k in sizes if str(k).startswith("daskdag-items")]  # nothing scattered
    # What the workers sent back: NumPy arrays (zero-copy frames), not JAX arrays.
    leaves = [leaf for out in gathered for leaf in jax.tree.leaves(out)]
    assert leaves and all(type(leaf) is np.ndarray for leaf in leaves)


def _kill_the_worker_of_the_first_chunk(monkeypatch, wait_for_it: bool) -> tuple[list, list]:
    """Patch the engine so that its first chunk's worker is SIGKILLed once the chunk runs (or at
    once); returns the chunks sent, in order, and the one killed."""
    killed, sends = [], []
    send = engines.Cluster._send

    def send_then_kill(self, chunks):
        send(self, chunks)
        sends.extend(c.chunk for c in chunks)
        if not killed:
            sent, client = chunks[0], self.client
            pid = client.run(os.getpid, workers=[sent.worker])[sent.worker]
            if wait_for_it:  # until an item of the chunk runs there
                eventually(lambda: os.path.exists(STARTED)
                           and str(pid) in open(STARTED).read().split(), 60,
                           f"an item of the first chunk running on its worker {sent.worker}")
            os.kill(pid, signal.SIGKILL)
            killed.append(sent.chunk)

    monkeypatch.setattr(engines.Cluster, "_send", send_then_kill)
    return sends, killed


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_a_chunk_killed_with_its_worker_runs_again_and_nothing_is_lost(monkeypatch):
    """The worker running a chunk is SIGKILLed: the scheduler holds the chunk's whole recipe,
    items included, so it runs it again on the other worker; the sweep sends nothing again,
    its results are right, and distributed loses no data it cannot recompute."""
    dag = {"H": (encode, ["x", "w"]), "E": (slow_energy, ["H"])}
    values = inputs(6)
    sends, killed = _kill_the_worker_of_the_first_chunk(monkeypatch, wait_for_it=True)
    with Logged() as log, local_client() as client:
        before = scheduler_tasks(client)
        res = daskdag.sweep_grads(dag, values, "E", batched=["x"], chunk_size=3, client=client)
        wait_only_kept_left(client, before, what="the sweep")
    assert sends.count(killed[0]) == 1, sends  # the scheduler ran it again, not the sweep
    assert not [line for line in log.lines if "lose scattered data" in line]
    value, grad = jax.vmap(jax.value_and_grad(lambda x: jnp.mean(encode(x, 0.5) ** 2)))(values["x"])
    assert_tree_close(res.value, value, rtol=1e-5)
    assert_tree_close(res.grad["x"], grad, rtol=1e-5)


@pytest.mark.cluster
@pytest.mark.timeout(240)
@pytest.mark.parametrize("chunk_size", [3, 1])
def test_a_chunk_lost_too_often_is_rerun_item_by_item_or_fails_the_sweep_clearly(monkeypatch,
                                                                                  chunk_size):
    """With distributed allowing no failure (``allowed-failures: 0``), a chunk whose worker dies
    under it is lost (``KilledWorker``): a chunk of several items is rerun item by item (smaller
    pieces stand a better chance), with the same results; a single item is sent again, up to
    ``RESENDS`` times (here none), then fails the sweep with a ClusterError naming it. Either
    way the sweep leaves nothing on the cluster."""
    monkeypatch.setattr(engines, "RESENDS", 0)
    dag = {"H": (encode, ["x", "w"]), "E": (slow_energy, ["H"])}
    values = inputs(6)
    sends, killed = _kill_the_worker_of_the_first_chunk(monkeypatch, wait_for_it=True)
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), local_client() as client:
        before = scheduler_tasks(client)
        if chunk_size > 1:
            res = daskdag.sweep_grads(dag, values, "E", batched=["x"], chunk_size=chunk_size,
                                      client=client)
            assert killed == [(0, 3)] and [s for s in sends if s[0] < 3] == [(0, 3), (0, 1), (1, 2),
                                                                            (2, 3)], sends
            value, grad = jax.vmap(jax.value_and_grad(
                lambda x: jnp.mean(encode(x, 0.5) ** 2)))(values["x"])
            assert_tree_close(res.value, value, rtol=1e-5)
            assert_tree_close(res.grad["x"], grad, rtol=1e-5)
        else:
            with pytest.raises(ClusterError, match=r"item [0-9] of the sweep was lost 1 times"):
                daskdag.sweep_grads(dag, values, "E", batched=["x"], chunk_size=chunk_size,
                                    client=client)
        wait_only_kept_left(client, before, what="the sweep")


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_a_chunk_lost_after_it_finished_is_collected_once_computed_again(monkeypatch):
    """A chunk's task finishes and its future says so, then its result is lost with its worker
    (SIGKILLed) before the sweep collects it: the scheduler computes it again, and its future
    finishes again with no callback this time. The sweep reads its state anyway: it completes,
    with the right results, instead of waiting for a callback forever."""
    arrived, killed = compute.Arrivals._arrived, []

    def kill_the_holder_first(self, future):
        if not killed and future.status == "finished" and "_run_chunk" in str(future.key):
            client = future.client
            holder = client.who_has([future])[future.key][0]
            os.kill(client.run(os.getpid, workers=[holder])[holder], signal.SIGKILL)
            killed.append(future.key)
            eventually(lambda: future.status == "lost", 60, "the chunk's result lost")
        arrived(self, future)

    monkeypatch.setattr(compute.Arrivals, "_arrived", kill_the_holder_first)
    dag = {"H": (encode, ["x", "w"]), "E": (slow_energy, ["H"])}
    values = inputs(6)
    with local_client() as client:
        before = scheduler_tasks(client)
        res = daskdag.sweep_grads(dag, values, "E", batched=["x"], chunk_size=3, client=client)
        wait_only_kept_left(client, before, what="the sweep")
    assert len(killed) == 1
    value, grad = jax.vmap(jax.value_and_grad(lambda x: jnp.mean(encode(x, 0.5) ** 2)))(values["x"])
    assert_tree_close(res.value, value, rtol=1e-5)
    assert_tree_close(res.grad["x"], grad, rtol=1e-5)


# -- a shared input lost with its worker ----------------------------------------------------------

def matmul_encode(x, w):
    return jnp.tanh(w @ x)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_shared_input_survives_its_holder_being_killed(monkeypatch):
    """The worker holding the shared input is SIGKILLed once it holds it, before any chunk ran,
    so no other worker has a copy: the scheduler has to compute it again."""
    dag = {"H": Node(matmul_encode, ["x", "w"]), "E": (lambda h: jnp.sum(h ** 2), ["H"])}
    xs = jax.random.normal(jax.random.key(0), (16, 3))
    w = jax.random.normal(jax.random.key(1), (3, 3)) / 2
    killed = []
    with local_client() as client:
        place = engines.place_shared

        def place_then_kill_holder(client_, name, value):
            fut = place(client_, name, value)
            fut.result()  # it is in memory on one worker
            (holder,) = client.who_has([fut])[fut.key]
            pid = client.run(os.getpid, workers=[holder])[holder]
            os.kill(pid, signal.SIGKILL)
            killed.append(fut.key)
            return fut

        monkeypatch.setattr(engines, "place_shared", place_then_kill_holder)
        res = daskdag.sweep_grads(dag, {"x": xs, "w": w}, "E", batched=["x"], chunk_size=2,
                                  client=client)
        story = client.run_on_scheduler(lambda dask_scheduler, key=killed[0]: [
            t[2] for t in dask_scheduler.story(key) if len(t) > 2])
    assert len(killed) == 1
    assert story.count("memory") >= 2, story  # computed, lost with its worker, computed again
    value, grad = jax.vmap(jax.value_and_grad(lambda x: jnp.sum(matmul_encode(x, w) ** 2)))(xs)
    assert_tree_close(res.value, value)
    assert_tree_close(res.grad["x"], grad)


# -- one chunk graph per sweep --------------------------------------------------------------------

def mean_square(h):
    return jnp.mean(h ** 2)


def expected_with_w(values, fn):
    """Per item: the value, and the gradients with respect to x and the shared w."""
    one = jax.value_and_grad(lambda x, w: fn(encode(x, w)), argnums=(0, 1))
    out = [one(x, values["w"]) for x in values["x"]]
    return (np.stack([v for v, _ in out]), np.stack([g[0] for _, g in out]),
            np.stack([g[1] for _, g in out]))


def counting_chunk_graphs(monkeypatch) -> list:
    """Record the sweep of each chunk graph built from now on."""
    made, chunk_graph = [], engines.chunk_graph

    def counting(sweep, shared):
        made.append(sweep)
        return chunk_graph(sweep, shared)

    monkeypatch.setattr(engines, "chunk_graph", counting)
    return made


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_two_sweeps_in_a_row_each_build_one_chunk_graph_and_their_last_chunk_is_shorter(monkeypatch):
    """10 items in chunks of 4 (4, 4 and 2 items), with w differentiated per item (broadcast
    into each chunk's items): every chunk, the shorter last one too, runs its sweep's one graph;
    a second sweep of another DAG right after, on the same client, gets a graph of its own;
    nothing stays on the cluster."""
    made = counting_chunk_graphs(monkeypatch)
    values = inputs(10)
    vmapped = {"H": daskdag.Node(encode, ["x", "w"], vmap=True),
               "E": daskdag.Node(mean_square, ["H"], vmap=True)}
    with local_client() as client:
        client.register_plugin(Specs(), name="record-specs")
        before = scheduler_tasks(client)
        eager = daskdag.sweep_grads(DAG, values, "E", batched=["x"], wrt=["x", "w"], chunk_size=4,
                                    client=client)
        vector = daskdag.sweep_grads(vmapped, values, "E", batched=["x"], wrt=["x", "w"],
                                     chunk_size=4, client=client)
        sizes = client.run_on_scheduler(task_sizes)
        wait_only_kept_left(client, before, what="the sweeps")
    assert len(made) == 2 and made[0] is not made[1]
    graphs = [k for k in sizes if is_graph(k)]
    chunks = [k for k in sizes if str(k).startswith("_run_chunk")]
    assert len(graphs) == 2 and len(chunks) == 6, sizes
    for res, fn in ((eager, energy), (vector, mean_square)):
        value, grad_x, grad_w = expected_with_w(values, fn)
        assert_tree_close(res.value, value, rtol=1e-5)
        assert_tree_close(res.grad["x"], grad_x, rtol=1e-5)
        assert_tree_close(res.grad["w"], grad_w, rtol=1e-5)


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_chunks_carry_no_graph_even_through_the_scheduler(monkeypatch):
    """With ``direct_to_workers=False`` (results pass through the scheduler too): the graph
    goes to the cluster once, and each chunk's task carries its items and not the graph; a
    chunk with a failing item keeps its other items' results (nothing is rerun: issue 39, item
    7), and the error names the item."""
    made = counting_chunk_graphs(monkeypatch)
    values = inputs(12)
    values["x"] = values["x"].at[FAILING].set(40.0)
    dag = {"H": (encode, ["x", "w"]), "E": (flaky, ["H"])}
    with local_client(client_options={"direct_to_workers": False}) as client:
        client.register_plugin(Specs(), name="record-specs")
        before = scheduler_tasks(client)
        res = daskdag.sweep_grads(dag, values, "E", batched=["x"], chunk_size=4, errors="collect",
                                  client=client)
        sizes = client.run_on_scheduler(task_sizes)
        wait_only_kept_left(client, before, what="the sweep")
    assert len(made) == 1
    (graph,) = [n for k, n in sizes.items() if is_graph(k)]
    chunks = {k: n for k, n in sizes.items() if str(k).startswith("_run_chunk")}
    assert len(chunks) == 3, sizes  # three chunks; the failing one's items are not rerun
    item = SIZE * 4
    assert all(item <= n < 4 * item + graph / 4 for n in chunks.values()), (graph, chunks)
    assert sorted(res.failed) == [FAILING] and res.failed[FAILING].item == FAILING
    value, grad = expected(values)
    ok = [i for i in range(12) if i != FAILING]
    assert_tree_close(res.value[ok], value[ok], rtol=1e-5)
    assert_tree_close(res.grad["x"][ok], grad[ok], rtol=1e-5)
    assert np.isnan(res.value[FAILING])


FAILING = 9  # the item flaky fails on (in the last chunk, items 8 to 11): its x is all 40


def flaky(h):
    if h[0] == 1.0:  # tanh(0.5 * 40) in float32; no normal item comes near
        raise FloatingPointError("diverged")
    return energy(h)


# -- how many items a chunk holds ------------------------------------------------------------------

def test_default_chunks_of_a_vectorized_sweep_within_bounds_of_memory():
    """An item-by-item sweep has about four chunks per parallel slot; a ``vmap=True``
    one too, but each of at least 16 MiB of items (a chunk is one program, with a fixed cost)
    unless a slot would have none, and at most 64 MiB."""
    from daskdag.sweeps import planning
    from daskdag.transport.transports import IN_PROCESS
    from daskdag.model.spec import parse

    def planned(vmap, n, width=4):
        dag = {"H": Node(lambda x: jnp.tanh(x), ["x"], vmap=vmap),
               "L": Node(lambda h: jnp.sum(h ** 2), ["H"], vmap=vmap)}
        xs = np.broadcast_to(np.float32(1), (n, width))  # (nbytes as if full, no memory)
        return planning.plan_sweep(parse(dag), ("L",), {"x": xs}, ["x"], ["x"], {}, n, IN_PROCESS)

    assert planning.default_chunk_size(planned(False, 1000), 2) == 125  # four per slot
    # 16-byte items: 16 MiB of them would be a million, more than a slot's share
    assert planning.default_chunk_size(planned(True, 1000), 2) == 500
    kib = 256  # 1 KiB items: four chunks per slot of 16 Ki items each, at least 16 MiB
    assert planning.default_chunk_size(planned(True, 2 ** 17, width=kib), 2) == 2 ** 14
    assert planning.default_chunk_size(planned(True, 2 ** 15, width=kib), 2) == 2 ** 14
    big = 2 ** 20  # 4 MiB items: 64 MiB of items per chunk at most
    assert planning.default_chunk_size(planned(True, 400, width=big), 2) == 16
    assert planning.default_chunk_size(planned(True, 1), 2) == 1
