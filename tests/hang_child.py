"""Cluster tests that hang on purpose until pytest-timeout ends them: a task that sleeps until
its test ends, on the conftest's clusters (a ``LocalCluster``; the ``dask`` commands). Run by
tests/test_hang_stacks.py in a pytest of its own (``pytest tests/hang_child.py::<test>``), which
checks that the failure shows the stacks of every process. Not collected by a plain ``pytest``
(its name does not start with ``test_``)."""

import pytest

CLUSTER = {"n_workers": 1}  # (the conftest's module cluster: one worker)

#: The timeout of each test, the call alone (the cluster is a fixture, already there).
TIMEOUT = 15


def _sleeper(stop: str):
    """A task that sleeps until the file ``stop`` is there (its test's end): by value (a local
    function), for workers that cannot import this module."""

    def sleep_forever():
        import os
        import time

        while not os.path.exists(stop):
            time.sleep(0.1)

    return sleep_forever


def _hang(client, tmp_path):
    stop = tmp_path / "stop"
    try:
        client.submit(_sleeper(str(stop)), pure=False).result()
    finally:
        stop.touch()


@pytest.mark.cluster
@pytest.mark.timeout(TIMEOUT, func_only=True)
def test_a_task_on_a_local_cluster_never_ends(client, tmp_path):
    _hang(client, tmp_path)


@pytest.mark.cluster
@pytest.mark.timeout(TIMEOUT, func_only=True)
def test_a_task_on_dask_cli_processes_never_ends(cli_client, tmp_path):
    _hang(cli_client, tmp_path)
