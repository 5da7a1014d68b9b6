"""daskdag on a Slurm cluster with dask-jobqueue: CPU jobs and GPU jobs under one TLS scheduler.

On a login node, ``python -m daskdag.deploy.slurm --account ACCT [--print-scripts]`` runs a DAG
on 2 CPU and 1 GPU jobs, or prints their job scripts (docs/guides/deployment.md, "Slurm"). The
scheduler runs in this process, each worker in a batch job; every connection is mutual TLS with
the files of ``daskdag certs``, and the dashboard serves HTTPS on this host's loopback only.

Job sizes: keyword arguments win over dask-jobqueue's config (``jobqueue.slurm`` for CPU jobs,
``jobqueue.slurm-gpu`` for GPU jobs, a key it leaves out or null taken from ``jobqueue.slurm``),
which wins over :data:`CPU_JOB` and :data:`GPU_JOB`. Unless a job's settings already say them,
daskdag adds ``export JAX_PLATFORMS=cpu`` (or ``=cuda``) at the top of the prologue, and
``--resources GPU=1`` to the GPU workers (``device="gpu"`` nodes run only on workers offering it).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import dask
import jax
import jax.numpy as jnp
import numpy as np
from dask_jobqueue import SLURMCluster
from distributed import Client, Security, Status
from distributed.deploy.adaptive import Adaptive

import daskdag
from daskdag.cli import tls

CERTS = "~/.daskdag/certs"

# daskdag's defaults, in jobqueue.yaml's spelling, where the config leaves a key unset (null).
# CPU jobs: one worker process per job, threads = cores.
CPU_JOB: dict[str, Any] = {"cores": 8, "memory": "32GB", "processes": 1}

# GPU jobs (the ``jobqueue.slurm-gpu`` section): one GPU, one worker thread (JAX queues work on
# the device; one node at a time keeps memory predictable), 8 cores booked for the host side.
GPU_JOB: dict[str, Any] = {
    "name": "daskdag-gpu", "cores": 1, "job-cpu": 8, "memory": "64GB", "processes": 1,
    "job-extra-directives": ["--gres=gpu:1"],
    "job-script-prologue": ["export XLA_PYTHON_CLIENT_PREALLOCATE=false"],
}

# Keys of a jobqueue section that configure the cluster (its scheduler), not a job.
_CLUSTER_KEYS = {"scheduler-options", "shared-temp-directory", "interface"}


def security(certs: str = CERTS) -> Security:
    """Mutual TLS for every role (the scheduler here, the workers in the jobs, the client), all
    with the one certificate that ``daskdag certs`` wrote into ``certs``."""
    return tls.security(certs, roles=tls.ROLES)


def _kwarg(key: str) -> str:
    """A jobqueue.yaml key as dask-jobqueue's keyword (``job-cpu`` -> ``job_cpu``)."""
    return "job_name" if key == "name" else key.replace("-", "_")


def _section(name: str) -> dict[str, Any]:
    section = dask.config.get(f"jobqueue.{name}", default=None) or {}
    return {k.replace("_", "-"): v for k, v in section.items()}


def _with_jax_platform(prologue: list[str] | None, platform: str) -> list[str]:
    prologue = list(prologue or [])
    if any("JAX_PLATFORMS" in line for line in prologue):
        return prologue
    return [f"export JAX_PLATFORMS={platform}", *prologue]


def cpu_job_options(config_name: str = "slurm", **job: Any) -> dict[str, Any]:
    """The ``SLURMCluster`` keywords of the CPU jobs: ``job`` over the jobqueue section
    ``config_name`` over :data:`CPU_JOB` (the module's "Job sizes")."""
    config = _section(config_name)
    options = {_kwarg(k): v for k, v in CPU_JOB.items() if config.get(k) is None}
    options.update(job)
    prologue = options.get("job_script_prologue", config.get("job-script-prologue"))
    options["job_script_prologue"] = _with_jax_platform(prologue, "cpu")
    return options


def gpu_job_options(config_name: str = "slurm-gpu", **job: Any) -> dict[str, Any]:
    """The keywords of the GPU jobs: ``job`` over the jobqueue section ``config_name`` over
    :data:`GPU_JOB` (the module's "Job sizes")."""
    config = {**GPU_JOB, **{k: v for k, v in _section(config_name).items() if v is not None}}
    options = {_kwarg(k): v for k, v in config.items() if k not in _CLUSTER_KEYS}
    options.update(job)
    options["job_script_prologue"] = _with_jax_platform(options.get("job_script_prologue"),
                                                        "cuda")
    args = list(options.get("worker_extra_args") or [])
    if not any(a.startswith("--resources") for a in args):
        args += ["--resources", "GPU=1"]
    options["worker_extra_args"] = args
    return options


@dataclass
class CPUGPUCluster:
    """A Dask scheduler in this process with two kinds of Slurm jobs, CPU and GPU workers: one
    call needs both on one scheduler, and a ``SLURMCluster`` submits jobs of one kind. Size it
    with its ``scale``, ``keep`` or ``adapt``, not :attr:`slurm`'s, which knows one kind only."""

    slurm: SLURMCluster  # the scheduler, and the template of the CPU jobs
    gpu_spec: dict = field(repr=False)  # the template of the GPU jobs, for the same scheduler
    _stop_keeping: threading.Event | None = field(default=None, repr=False)
    _adaptive: CPUGPUAdaptive | None = field(default=None, repr=False)

    def scale(self, cpu_jobs: int, gpu_jobs: int) -> None:
        """Run ``cpu_jobs`` CPU jobs and ``gpu_jobs`` GPU jobs: submit or cancel the difference.
        Jobs that ended count as gone: calling it again replaces them. Stops :meth:`adapt` and
        :meth:`keep`."""
        self._stop_sizing()
        self._set(cpu_jobs, gpu_jobs, self.ended())

    def _set(self, cpu_jobs: int, gpu_jobs: int, ended: Iterable[str] = ()) -> None:
        """Forget the jobs ``ended``, then submit or cancel jobs to run that many; nothing once
        the cluster closes (a look of :meth:`adapt` or :meth:`keep` still under way then would
        submit jobs that its close has already passed)."""
        if self.slurm.status in (Status.closing, Status.closed):
            return
        spec = self.slurm.worker_spec
        for name in ended:
            spec.pop(name, None)
        gpu = [n for n in spec if self._is_gpu(n)]
        cpu = [n for n in spec if not self._is_gpu(n)]
        for name in cpu[cpu_jobs:] + gpu[gpu_jobs:]:
            del spec[name]
        for _ in range(cpu_jobs - len(cpu)):
            spec.update(self.slurm.new_worker_spec())
        i = 0
        for _ in range(gpu_jobs - len(gpu)):
            while f"{self.slurm.name}-gpu-{i}" in spec:
                i += 1
            spec[f"{self.slurm.name}-gpu-{i}"] = self.gpu_spec
        self.slurm.scale(jobs=len(spec))  # the spec is complete: this submits and cancels jobs

    def ended(self) -> list[str]:
        """The worker names of the jobs Slurm no longer lists (``squeue``); none where Slurm
        does not answer."""
        started = {name: job.job_id for name, job in self.slurm.workers.items()
                   if name in self.slurm.worker_spec and getattr(job, "job_id", None)}
        if not started:
            return []
        listed = subprocess.run(["squeue", "--noheader", "--format=%i"], check=False,
                                capture_output=True, text=True, timeout=30)
        if listed.returncode:  # (Slurm not answering: nothing is known to have ended)
            return []
        alive = set(listed.stdout.split())
        return [name for name, job_id in started.items() if job_id not in alive]

    def keep(self, cpu_jobs: int, gpu_jobs: int, every: float = 10.0) -> None:
        """Keep that many CPU and GPU jobs running, replacing those that end (Slurm's queue
        looked at ``every`` seconds), until :meth:`close`, :meth:`scale` or :meth:`adapt`. A
        sweep with a ``store=`` goes on, computing again only the chunks of the jobs that ended.
        """
        self.scale(cpu_jobs, gpu_jobs)
        stop = threading.Event()
        self._stop_keeping = stop

        def keeping():
            while not stop.wait(every):
                try:
                    ended = self.ended()
                    if ended and self.slurm.loop is not None:
                        self.slurm.loop.add_callback(self._set, cpu_jobs, gpu_jobs, ended)
                except Exception as e:  # noqa: BLE001 (squeue hung, or closing: try again)
                    print(f"CPUGPUCluster.keep: {e!r}", file=sys.stderr)

        threading.Thread(target=keeping, daemon=True, name="slurm-keep").start()

    def adapt(self, minimum: int = 0, maximum: int = 10, *, gpu_minimum: int = 1,
              gpu_maximum: int = 1, **kwargs: Any) -> CPUGPUAdaptive:
        """Size both kinds of job by the load, until :meth:`scale`, :meth:`keep` or :meth:`close`;
        returns the running :class:`CPUGPUAdaptive` (``.stop()`` leaves the jobs as they are).

        CPU jobs follow distributed's adaptive rule (``adaptive_target``) within ``minimum`` and
        ``maximum``; GPU jobs number the tasks needing a GPU that are ready or running, within
        ``gpu_minimum`` and ``gpu_maximum``. A job is cancelled after ``wait_count`` looks in a
        row found it idle and above its kind's target; ended jobs are forgotten, and replaced if
        the load still asks for them. ``kwargs``: distributed's ``Adaptive`` keywords
        (``interval``, ``wait_count``, ``target_duration``).

        A daskdag call refuses at once when no worker offers a node's resources: for
        ``device="gpu"`` nodes keep ``gpu_minimum`` at 1 or more and let the GPU job start first
        (:meth:`wait_for_workers`); ``gpu_minimum=0`` suits plain Dask tasks, which wait.
        """
        self._stop_sizing()
        self._adaptive = CPUGPUAdaptive(self, minimum=minimum, maximum=maximum,
                                        gpu_minimum=gpu_minimum, gpu_maximum=gpu_maximum,
                                        **kwargs)
        return self._adaptive

    def wait_for_workers(self, cpu: int = 0, gpu: int = 0, timeout: float | None = None) -> None:
        """Wait until at least ``cpu`` CPU workers and ``gpu`` GPU workers have connected;
        ``TimeoutError`` after ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            names = [w["name"] for w in self.slurm.scheduler_info.get("workers", {}).values()]
            found_gpu = sum(1 for n in names if self._is_gpu(n))
            if found_gpu >= gpu and len(names) - found_gpu >= cpu:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{len(names) - found_gpu} CPU and {found_gpu} GPU workers "
                                   f"after {timeout:g} s; waited for {cpu} and {gpu}")
            time.sleep(0.2)

    def _stop_sizing(self) -> None:
        if self._adaptive is not None:
            self._adaptive.stop(reason="scaled by hand")
            self._adaptive = None
        if self._stop_keeping is not None:
            self._stop_keeping.set()
            self._stop_keeping = None

    def _is_gpu(self, name: Any) -> bool:
        spec = self.slurm.worker_spec.get(name)
        return spec is self.gpu_spec or str(name).startswith(f"{self.slurm.name}-gpu-")

    def job_scripts(self) -> dict[str, str]:
        """``{"cpu": script, "gpu": script}``: the batch scripts as ``sbatch`` would get them,
        with the worker name ``dummy-name``, which each submitted job replaces by its own."""
        gpu_job = self.gpu_spec["cls"](self.slurm.scheduler_address, name="dummy-name",
                                       **self.gpu_spec["options"])
        return {"cpu": self.slurm.job_script(), "gpu": gpu_job.job_script()}

    def client(self) -> Client:
        """A client of this cluster's scheduler, with the cluster's ``Security``."""
        return Client(self.slurm)

    def close(self) -> None:
        """Cancel every job and stop the scheduler."""
        self._stop_sizing()
        self.slurm.close()


class CPUGPUAdaptive(Adaptive):
    """distributed's ``Adaptive`` for the CPU jobs of a :class:`CPUGPUCluster`, and a target of
    GPU jobs from the tasks that need a GPU (see :meth:`CPUGPUCluster.adapt`)."""

    def __init__(self, jobs: CPUGPUCluster, *, gpu_minimum: int = 1, gpu_maximum: int = 1,
                 **kwargs: Any) -> None:
        self.jobs = jobs
        self.gpu_minimum, self.gpu_maximum = gpu_minimum, gpu_maximum
        self.gpu_close_counts: defaultdict[str, int] = defaultdict(int)
        super().__init__(jobs.slurm, **kwargs)

    def _cpu(self, names: Any) -> set:
        return {n for n in names if not self.jobs._is_gpu(n)}

    # The CPU workers only: what distributed's rule sees of the cluster.
    plan = property(lambda self: self._cpu(self.cluster.plan))
    requested = property(lambda self: self._cpu(self.cluster.requested))
    observed = property(lambda self: self._cpu(self.cluster.observed))

    @property
    def _scheduler(self) -> Any:  # (the Scheduler object: dask-jobqueue runs it in this process)
        return self.jobs.slurm.scheduler

    def _gpu_workers(self) -> list:
        return [ws for ws in self._scheduler.workers.values() if self.jobs._is_gpu(ws.name)]

    async def target(self) -> int:
        """CPU jobs wanted: the scheduler's adaptive target less the GPU workers it counted."""
        n = await self.scheduler.adaptive_target(target_duration=self.target_duration)
        return n - len(self._gpu_workers())

    async def workers_to_close(self, target: int) -> list[str]:
        """Idle CPU workers to retire to come down to ``target``, least data first (the
        scheduler's own choice would offer GPU workers)."""
        cpu = [ws for ws in self._scheduler.workers.values() if not self.jobs._is_gpu(ws.name)]
        idle = sorted((ws for ws in cpu if not ws.processing and not ws.long_running),
                      key=lambda ws: ws.nbytes)
        return [ws.name for ws in idle[:max(0, len(cpu) - target)]]

    async def scale_up(self, n: int) -> None:  # type: ignore[override]
        """Run ``n`` CPU jobs, the GPU jobs as they are."""
        gpu = sum(1 for name in self.jobs.slurm.worker_spec if self.jobs._is_gpu(name))
        self.jobs._set(n, gpu)

    def gpu_target(self) -> int:
        """GPU jobs wanted: the tasks needing a GPU that are ready or run, within the bounds.
        Tasks still waiting for their inputs do not count: a chain of GPU nodes asks for one
        job, GPU nodes that can run side by side for one each."""
        wanted = len([ts for ts in self._scheduler.tasks.values()
                      if (ts.resource_restrictions or {}).get("GPU")
                      and ts.state in ("no-worker", "queued", "processing")])
        return max(self.gpu_minimum, min(self.gpu_maximum, wanted))

    async def adapt(self) -> None:
        """One look: forget ended jobs, size the CPU jobs, then the GPU jobs."""
        spec = self.jobs.slurm.worker_spec
        for name in await asyncio.to_thread(self.jobs.ended):
            spec.pop(name, None)
        await super().adapt()
        names = [n for n in spec if self.jobs._is_gpu(n)]
        target = self.gpu_target()
        if target > len(names):
            self.gpu_close_counts.clear()
            self.jobs._set(len(spec) - len(names), target)
            return
        arrived = {ws.name: ws for ws in self._gpu_workers()}
        # Not yet started jobs go first, then idle workers; a busy GPU worker is kept.
        idle = [n for n in names if n not in arrived] + [
            n for n in names if n in arrived and not arrived[n].processing]
        # A job closes after wait_count looks in a row found it among those to close.
        counts = {n: self.gpu_close_counts[n] + 1 for n in idle[:len(names) - target]}
        firm = [n for n, c in counts.items() if c >= self.wait_count]
        self.gpu_close_counts = defaultdict(int, {n: c for n, c in counts.items()
                                                  if c < self.wait_count})
        if firm:
            started = [n for n in firm if n in arrived]
            if started:
                await self.scheduler.retire_workers(names=started, remove=True,
                                                    close_workers=True)
            await self.jobs.slurm.scale_down(firm)


def make_cluster(certs: str = CERTS, *, account: str | None = None, queue: str | None = None,
                 gpu_queue: str | None = None, interface: str | None = None,
                 cpu_job: dict[str, Any] | None = None, gpu_job: dict[str, Any] | None = None,
                 scheduler_options: dict[str, Any] | None = None, config_name: str = "slurm",
                 gpu_config_name: str = "slurm-gpu") -> CPUGPUCluster:
    """Start the scheduler here, over TLS; submit no job yet (see :meth:`CPUGPUCluster.scale`).

    Args:
        certs: the directory of ``daskdag certs``, on a filesystem the jobs share.
        account, queue: Slurm's ``-A`` and ``-p`` for every job (else the config's).
        gpu_queue: the partition of the GPU jobs, where it differs from ``queue``.
        interface: the network interface (``ib0``, ``eth0``) of the scheduler and workers.
        cpu_job: ``SLURMCluster`` job keywords of the CPU jobs (``cores``, ``memory``,
            ``walltime``, ...); they win over the config's ``jobqueue.<config_name>`` section.
        gpu_job: the same for the GPU jobs, over ``jobqueue.<gpu_config_name>``.
    """
    sec: Any = security(certs)
    cpu = cpu_job_options(config_name, **(cpu_job or {}))
    options = {"dashboard_address": "127.0.0.1:8787", **(scheduler_options or {})}
    # The dashboard serves HTTPS with the same certificate (Dask reads this when it starts).
    with dask.config.set({"distributed.scheduler.dashboard.tls.cert": sec.tls_scheduler_cert,
                          "distributed.scheduler.dashboard.tls.key": sec.tls_scheduler_key}):
        slurm = SLURMCluster(security=sec, protocol="tls://", interface=interface,
                             account=account, queue=queue, scheduler_options=options,
                             config_name=config_name, **cpu)
    # The GPU template: the CPU jobs' resolved connection and section (read for what the GPU
    # section leaves unset), with the GPU jobs' settings.
    resolved = {k: v for k, v in slurm.new_spec["options"].items()
                if k in ("security", "protocol", "interface", "config_name")}
    gpu = gpu_job_options(gpu_config_name, **(gpu_job or {}))
    for key, value in (("account", account), ("queue", gpu_queue or queue)):
        if value is not None:
            gpu[key] = value
    return CPUGPUCluster(slurm, {"cls": slurm.job_cls, "options": {**resolved, **gpu}})


def connect(certs: str = CERTS, cpu_jobs: int = 2, gpu_jobs: int = 1, wait: bool = True,
            **kw: Any) -> Client:
    """Start the cluster (:func:`make_cluster`, with ``kw``), submit ``cpu_jobs`` and
    ``gpu_jobs`` jobs, and return a client, once every job's worker has connected if ``wait``.
    The cluster stops, cancelling its jobs, when this process ends, or on
    ``client.cluster.close()``."""
    cluster = make_cluster(certs, **kw)
    cluster.scale(cpu_jobs, gpu_jobs)
    client = cluster.client()
    if wait:
        client.wait_for_workers(cpu_jobs + gpu_jobs)
    return client


def _demo(client: Client) -> float:
    """A DAG with a GPU node; returns the largest gradient difference to plain JAX."""
    def heavy(a, w):
        return jnp.tanh(a @ w)

    dag = {"A": (jnp.sin, ["x"]),
           "H": daskdag.Node(heavy, ["A", "w"], device="gpu"),
           "D": (jnp.sum, ["H"]),
           "E": (lambda h: jnp.max(h), ["H"])}
    x, w = jnp.linspace(-1, 1, 64), jnp.eye(64) / 2
    res = daskdag.compute_grads(dag, {"x": x, "w": w}, ["D", "E"], client=client)
    ref = jax.grad(lambda x: jnp.sum(heavy(jnp.sin(x), w)))(x)
    return float(np.max(np.abs(np.asarray(res["D"].grad["x"]) - np.asarray(ref))))


def main(argv: list[str] | None = None) -> int:
    """``python -m daskdag.deploy.slurm`` with the arguments ``argv`` (default: this
    process's): print the job scripts, or run a DAG on the jobs; 0 when its gradients agree
    with plain JAX."""
    p = argparse.ArgumentParser(prog="python -m daskdag.deploy.slurm",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--certs", default=CERTS)
    for option in ("--account", "--queue", "--gpu-queue", "--interface"):
        p.add_argument(option)
    p.add_argument("--cpu-jobs", type=int, default=2)
    p.add_argument("--gpu-jobs", type=int, default=1)
    p.add_argument("--print-scripts", action="store_true",
                   help="print the CPU and GPU job scripts and exit, submitting nothing")
    a = p.parse_args(argv)
    cluster = make_cluster(a.certs, account=a.account, queue=a.queue, gpu_queue=a.gpu_queue,
                           interface=a.interface)
    try:
        if a.print_scripts:
            for kind, script in cluster.job_scripts().items():
                print(f"# ---- {kind} job ----\n{script}")
            return 0
        cluster.scale(a.cpu_jobs, a.gpu_jobs)
        with cluster.client() as client:
            client.wait_for_workers(a.cpu_jobs + a.gpu_jobs)
            err = _demo(client)
        print(f"largest gradient difference to plain JAX: {err:.2e}")
        return 0 if err < 1e-4 else 1
    finally:
        cluster.close()


if __name__ == "__main__":
    sys.exit(main())
