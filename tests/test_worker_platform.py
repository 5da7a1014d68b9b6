"""Hosts with an accelerator and several processes: Dask's worker processes run JAX on their CPU
unless one is meant to own a device (daskdag.worker-platform), so that they do not all open the
one TPU chip or preallocate the GPU's memory.

- Which worker runs JAX on its CPU, as a function of its resources, its environment and the
  setting (:func:`daskdag.running.workers.decide`).
- The child processes of Dask's multiprocessing scheduler run JAX on their CPU, and the user's
  ``multiprocessing.initializer`` still runs.
- On a LocalCluster, workers that advertise no GPU or TPU run JAX on their CPU; a worker that
  cannot hold its platform is a clear error naming it (the accelerator's side faked here).
"""

import asyncio
import json
import os

import dask
import jax
import jax.numpy as jnp
import pytest
from distributed import Client, LocalCluster

import daskdag
from daskdag import ClusterError, DAGError
from daskdag.running import workers as worker_setup
from daskdag.running.workers import decide

from .support.clusters import local_client
from .support.numbers import assert_tree_close

# Workers started as a user's are: their environment read, and JAX not imported, at their start.
pytestmark = pytest.mark.spawn

X = jnp.linspace(0.1, 1.0, 4)


@pytest.mark.parametrize("setting, resources, environ, on_cpu", [
    ("auto", {}, {}, True),
    ("auto", {"GPU": 1}, {}, False),
    ("auto", {"TPU": 1}, {}, False),
    ("auto", {"GPU": 0}, {}, True),
    ("auto", {"memory": 4}, {}, True),
    ("auto", {}, {"CUDA_VISIBLE_DEVICES": "1"}, False),  # one worker per GPU, no resource
    ("auto", {}, {"TPU_VISIBLE_CHIPS": "0"}, False),
    ("auto", {}, {"JAX_PLATFORMS": "cuda"}, False),
    ("auto", {}, {"CUDA_VISIBLE_DEVICES": ""}, True),  # (empty: chose nothing)
    ("cpu", {}, {"CUDA_VISIBLE_DEVICES": "1"}, True),  # (a batch system's, for every process)
    ("cpu", {"TPU": 1}, {}, False),
    ("any", {}, {}, False),
])
def test_which_workers_run_jax_on_their_cpu(setting, resources, environ, on_cpu):
    decided, why = decide(setting, resources, environ)
    assert decided is on_cpu
    named = [*resources, *environ] if not on_cpu and setting != "any" else []
    assert all(name in why for name in named), why


def _record(path):
    def node(x):  # (where it runs: its process, its environment and JAX's platform there)
        with open(path, "a") as f:
            f.write(json.dumps([os.getpid(), os.environ.get("JAX_PLATFORMS"),
                                jax.config.jax_platforms, jax.default_backend()]) + "\n")
        return jnp.sin(x) * 2
    return node


def _runs(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _dag(path):
    return {"A": (_record(path), ["x"]), "B": (jnp.sum, ["A"])}


def _marks(marker_dir):
    return sorted(p.name for p in marker_dir.iterdir())


def user_initializer():  # (a module's function: the child process imports it)
    open(os.path.join(os.environ["DASKDAG_TEST_MARKERS"], str(os.getpid())), "w").close()


@pytest.mark.timeout(180)
@pytest.mark.subprocess
def test_processes_scheduler_children_run_jax_on_their_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # (the children's environment is this one's)
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("DASKDAG_TEST_MARKERS", str(markers))
    want = jax.grad(lambda x: jnp.sum(jnp.sin(x) * 2))(X)
    for setting, platform in (("auto", "cpu"), ("any", None)):
        runs = tmp_path / setting
        with dask.config.set({"scheduler": "processes", "num_workers": 2,
                              "multiprocessing.initializer": user_initializer,
                              "daskdag.worker-platform": setting}):
            res = daskdag.compute_grads(_dag(runs), X, "B")
        assert_tree_close(res.grad, want)
        (pid, env, config, backend), = _runs(runs)
        assert pid != os.getpid()
        assert (env, config, backend) == (platform, platform, "cpu"), setting
        assert str(pid) in _marks(markers)  # the user's initializer ran there too


def test_a_bad_setting_is_named():
    with dask.config.set({"scheduler": "processes", "daskdag.worker-platform": "gpu"}):
        with pytest.raises(DAGError, match="daskdag.worker-platform is 'gpu'.*'auto', 'cpu', 'any'"):
            daskdag.compute_grads({"B": (jnp.sum, ["x"])}, X, "B")


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_workers_without_an_accelerator_resource_run_jax_on_their_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # (the workers' environment is this one's)
    with local_client(2) as client:
        res = daskdag.compute_grads(_dag(tmp_path / "runs"), X, "B", client=client)
        assert_tree_close(res.grad, jax.grad(lambda x: jnp.sum(jnp.sin(x) * 2))(X))
        (pid, env, config, backend), = _runs(tmp_path / "runs")
        assert pid != os.getpid() and (env, config, backend) == ("cpu", "cpu", "cpu")
        seen = client.run(lambda dask_worker: (
            dask_worker.plugins[worker_setup.PLATFORM].on_cpu,
            dask_worker.plugins[worker_setup.PLATFORM].reason,
            os.environ.get("JAX_PLATFORMS"), __import__("jax").config.jax_platforms))
        assert len(seen) == 2
        assert all(s == (True, "it advertises no GPU or TPU resource", "cpu", "cpu")
                   for s in seen.values()), seen


class _Worker:  # (what the plugin reads of a worker)
    address = "tcp://10.0.0.7:4321"

    def __init__(self, resources):
        self.state = type("State", (), {"total_resources": resources})()


def _plugin_from_elsewhere(setting):
    """A Platform plugin as a worker process receives it: made in another process."""
    plugin = worker_setup.Platform(setting)
    plugin.made_in = ("another host", -1)
    return plugin


def _names_of(plugin) -> dict:
    """The globals the plugin's ``setup`` reads: its module's, or, once a plugin of its class
    was unpickled in this process (the class travels by value: cloudpickle then sets the
    class's methods anew), a copy of them."""
    return type(plugin).setup.__globals__


def _no_device_chosen(monkeypatch):
    """This process's environment as a worker's that chose no platform or device."""
    for name in worker_setup.CHOSEN_BY:
        monkeypatch.delenv(name, raising=False)


def test_a_worker_for_the_cpu_already_on_an_accelerator_is_named(monkeypatch):
    _no_device_chosen(monkeypatch)
    plugin = _plugin_from_elsewhere("auto")
    monkeypatch.setitem(_names_of(plugin), "jax_on_cpu", lambda: "tpu")
    with pytest.raises(RuntimeError, match=r"worker tcp://10.0.0.7:4321 already runs JAX on 'tpu'"
                                           r".*no GPU or TPU resource.*--resources TPU=1"):
        asyncio.run(plugin.setup(_Worker({})))


def test_a_worker_that_cannot_open_its_tpu_is_named(monkeypatch):
    """Two processes on one TPU host both meant to own the chip: the second cannot open it."""
    def held_elsewhere():
        raise RuntimeError("Unable to initialize backend 'tpu': ABORTED: Internal error when "
                           "accessing libtpu multi-process lockfile.")
    _no_device_chosen(monkeypatch)
    plugin = _plugin_from_elsewhere("auto")
    monkeypatch.setitem(_names_of(plugin), "_open_jax", held_elsewhere)
    with pytest.raises(RuntimeError, match=r"worker tcp://10.0.0.7:4321 keeps its accelerator "
                                           r"\(it advertises the resource TPU\).*lockfile.*"
                                           r"one worker process per device"):
        asyncio.run(plugin.setup(_Worker({"TPU": 1})))
    assert plugin.on_cpu is False


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_worker_that_cannot_open_its_accelerator_stops_the_call():
    # A worker meant to own a TPU, on a machine where JAX cannot open one.
    with local_client(1, resources={"TPU": 1},
                      env={"JAX_PLATFORMS": "tpu"}) as client:
        for _ in range(2):  # (at every call, until the cluster is fixed)
            with pytest.raises(ClusterError, match=r"worker tcp://127.0.0.1:\d+ keeps its "
                                                   r"accelerator.*Unable to initialize backend 'tpu'"):
                daskdag.compute_grads({"B": (jnp.sum, ["x"])}, X, "B", client=client)


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_a_worker_in_the_clients_process_shares_its_jax(monkeypatch):
    """LocalCluster(processes=False): the worker is this process, whose JAX is the user's."""
    _no_device_chosen(monkeypatch)
    before = jax.config.jax_platforms
    with LocalCluster(n_workers=1, processes=False, threads_per_worker=1,
                      dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as client:
        res = daskdag.compute_grads(_dag_plain(), X, "B", client=client)
        assert_tree_close(res.grad, jax.grad(lambda x: jnp.sum(jnp.sin(x) * 2))(X))
        (state,) = client.run(lambda dask_worker: (
            dask_worker.plugins[worker_setup.PLATFORM].on_cpu,
            dask_worker.plugins[worker_setup.PLATFORM].reason)).values()
    assert state == (False, "it runs in the client's process, sharing its JAX")
    assert jax.config.jax_platforms == before and "JAX_PLATFORMS" not in os.environ


def _dag_plain():
    return {"A": (lambda x: jnp.sin(x) * 2, ["x"]), "B": (jnp.sum, ["A"])}
