"""What daskdag reads of Dask that Dask does not document (in :mod:`daskdag.running.local`,
and the prefix Dask takes of daskdag's keys): each checked against the installed Dask, so that
a release that changes it fails here."""

import concurrent.futures
import operator

import dask
import dask.threaded
from dask.callbacks import Callback
from dask.task_spec import Task, TaskRef
from dask.utils import key_split

from daskdag.graph.assembly import key, kind_of
from daskdag.running.local import batch_tasks, running, threads_of


class Recording(concurrent.futures.ThreadPoolExecutor):
    """A pool that notes what ``dask.local`` submits to it."""

    def __init__(self):
        super().__init__(2)
        self.batches = []

    def submit(self, fn, *args):
        self.batches.append(batch_tasks(args))
        return super().submit(fn, *args)


def test_the_threaded_schedulers_batches_and_state_read_as_daskdag_reads_them():
    dsk = {"a": Task("a", operator.add, 1, 2), "b": Task("b", operator.mul, TaskRef("a"), 10)}
    pool, seen = Recording(), []
    with Callback(start_state=lambda d, state: seen.append(running(state))):
        assert dask.threaded.get(dsk, ["b"], pool=pool) == (30,)
    submitted = [pair for batch in pool.batches for pair in batch]
    assert sorted(k for k, _ in submitted) == ["a", "b"]
    assert all(isinstance(task, Task) and task.key == k for k, task in submitted)
    assert seen == [0]  # (the state as the scheduler starts: nothing running yet)
    assert threads_of(pool) == 2
    pool.shutdown()


def test_dask_takes_a_keys_prefix_as_daskdag_names_it():
    """Dask learns durations and balances tasks by a key's prefix (``key_split``): for
    daskdag's keys, the stage it runs; a node name with ``-`` before a word that is not all
    letters is cut there (:func:`daskdag.graph.assembly.key`)."""
    for label in ("B+C", "n0+998more+n999", "layer_2", "pre-processing"):
        k = key("fwd", label, "0123abcd")
        assert kind_of(k) == "fwd"
        assert key_split(k) == f"fwd:{label}", (k, key_split(k))
    assert key_split(key("fwd", "x-1", "0123abcd")) == "fwd:x"
