"""A sweep's progress bar (daskdag.sweeps.progress), its counts read from inside: when some items
fail, the last count is exact (every item counted, none twice); and it looks as a call's bar
(Dask's), counting items."""

import logging
import re
import time

import jax.numpy as jnp
import pytest

import daskdag
from daskdag.sweeps import progress

from .support.clusters import eventually, local_client
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


DASK_BAR = re.compile(r"\[#{40}\] \| 100% Completed \|")  # Dask's text bar, at its end


def test_a_sweeps_bar_looks_as_a_calls_bar_and_counts_items(capsys):
    """One look: a call's bar is Dask's (``dask.diagnostics.ProgressBar`` here), a sweep's bar
    is drawn the same way, and also says how many items are done."""
    dag = {"H": (encode, ["x", "w"]), "L": (lambda h: jnp.sum(h ** 2), ["H"])}
    xs = jnp.linspace(-1.0, 1.0, 10)[:, None] * jnp.ones((10, 3))
    daskdag.compute_grads(dag, {"x": xs[0], "w": jnp.eye(3)}, "L", progress=True)
    call = capsys.readouterr()
    daskdag.sweep_grads(dag, {"x": xs, "w": jnp.eye(3)}, "L", batched=["x"], chunk_size=4,
                        progress=True)
    sweep = capsys.readouterr()
    assert DASK_BAR.search(call.out), call
    assert DASK_BAR.search(sweep.err), sweep
    assert "| 10/10 items |" in sweep.err


def _tell(topic: str, message: list) -> None:
    from distributed import get_worker

    get_worker().log_event(topic, message)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_events_reach_each_listener_while_it_listens(caplog):
    """What tasks tell their client (daskdag.running.compute.listening): each listener of a
    topic hears its events while it listens, and none after; one told when no one listens is
    dropped, with no error logged by distributed."""
    from daskdag.running.compute import listening

    with local_client(1) as client, caplog.at_level(logging.INFO, logger="distributed"):
        first, second = [], []
        with listening(client, "daskdag-test", first.append):
            with listening(client, "daskdag-test", second.append):
                client.submit(_tell, "daskdag-test", ["both"], pure=False).result()
            client.submit(_tell, "daskdag-test", ["first"], pure=False).result()
        client.submit(_tell, "daskdag-test", ["no one"], pure=False).result()
        eventually(lambda: len(first) == 2, 30, "the events told while listening")
        time.sleep(0.5)  # (time for the last one to arrive, if it were to)
    assert [list(m) for m in first] == [["both"], ["first"]] and [list(m) for m in second] == [["both"]]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
