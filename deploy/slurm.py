"""daskdag on a Slurm cluster with dask-jobqueue: CPU jobs and GPU jobs under one TLS scheduler.

Run it on a login node (or any host the compute nodes reach) in an environment with daskdag and
the versions the jobs use (``pip install -c deploy/constraints.txt -e '.[deploy]'`` on a shared
filesystem), with certificates where the jobs can read them::

    daskdag certs ~/.daskdag/certs                        # once (python -m daskdag.cli certs ...)
    python deploy/slurm.py --print-scripts --account ACCT # the two job scripts, nothing submitted
    python deploy/slurm.py --account ACCT                 # 2 CPU + 1 GPU jobs, a DAG, gradients

From Python, with ``deploy/`` on ``sys.path``::

    client = slurm.connect("~/.daskdag/certs", cpu_jobs=2, gpu_jobs=1, account="ACCT")
    res = daskdag.compute_grads(dag, x, ["D", "E"], client=client)

How it fits together: dask-jobqueue runs the Dask scheduler inside this Python process and
submits each worker as a batch job whose script runs ``python -m distributed.cli.dask_worker
tls://<this host>:<port> ... --tls-ca-file ... --tls-cert ... --tls-key ...``. Every connection
(client, scheduler, workers) is mutual TLS with the files of ``daskdag certs``, which must lie on
a filesystem the compute nodes share (the key's mode 0600 suffices: jobs run as you). The
dashboard listens on this host's loopback only, over HTTPS: ``ssh -L 8787:localhost:8787 LOGIN``.

One scheduler holds both kinds of job. dask-jobqueue's ``SLURMCluster`` submits jobs of one kind;
two of them would be two schedulers, and one ``compute_grads`` call needs its CPU and GPU workers
on the same one. So :class:`CPUGPUCluster` keeps a ``SLURMCluster`` (the scheduler, and the CPU
job template) and a GPU job template (``--gres=gpu:1``, workers started with ``--resources
GPU=1``), and :meth:`CPUGPUCluster.scale` sets how many jobs of each kind run. Use it, rather
than ``SLURMCluster.scale`` or ``adapt``, which know one kind only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import dask
from dask_jobqueue import SLURMCluster
from distributed import Client, Security

from daskdag.cli import tls

CERTS = "~/.daskdag/certs"

# One worker process per job. CPU jobs: threads = cores, JAX kept off any GPU the node has.
CPU_JOB = dict(
    job_name="daskdag-cpu",
    cores=8,
    memory="32GB",
    processes=1,
    walltime="02:00:00",
    job_script_prologue=["export JAX_PLATFORMS=cpu"],
)

# GPU jobs: one GPU, one worker thread (JAX queues work on the device; one node at a time keeps
# memory predictable), 8 cores booked for the host side of the work. The worker advertises the
# Dask resource GPU=1, so daskdag's nodes marked device="gpu" run on it and nowhere else.
GPU_JOB = dict(
    job_name="daskdag-gpu",
    cores=1,
    job_cpu=8,
    memory="64GB",
    processes=1,
    walltime="02:00:00",
    job_extra_directives=["--gres=gpu:1"],
    worker_extra_args=["--resources", "GPU=1"],
    job_script_prologue=["export JAX_PLATFORMS=cuda", "export XLA_PYTHON_CLIENT_PREALLOCATE=false"],
)


def security(certs=CERTS) -> Security:
    """Mutual TLS for every role (the scheduler here, the workers in the jobs, the client), all
    with the one certificate ``daskdag certs`` writes."""
    return tls.security(certs, roles=tls.ROLES)


@dataclass
class CPUGPUCluster:
    """A Dask scheduler in this process with two kinds of Slurm jobs: CPU and GPU workers."""

    slurm: SLURMCluster  # the scheduler, and the template of the CPU jobs
    gpu_spec: dict = field(repr=False)  # the template of the GPU jobs, for the same scheduler
    _stop_keeping: threading.Event | None = field(default=None, repr=False)

    def scale(self, cpu_jobs: int, gpu_jobs: int) -> None:
        """Run ``cpu_jobs`` CPU jobs and ``gpu_jobs`` GPU jobs: submit or cancel the difference.
        Jobs that ended (time limit reached, cancelled, node lost) count as gone: calling it
        again with the same numbers replaces them (:meth:`keep` does so every few seconds)."""
        spec = self.slurm.worker_spec
        for name in self.ended():
            del spec[name]
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
        """The jobs submitted that Slurm no longer lists (``squeue``), by worker name."""
        started = {name: job.job_id for name, job in self.slurm.workers.items()
                   if name in self.slurm.worker_spec and getattr(job, "job_id", None)}
        if not started:
            return []
        listed = subprocess.run(["squeue", "--noheader", "--format=%i"], capture_output=True,
                                text=True, timeout=30)
        if listed.returncode:  # (Slurm not answering: nothing is known to have ended)
            return []
        alive = set(listed.stdout.split())
        return [name for name, job_id in started.items() if job_id not in alive]

    def keep(self, cpu_jobs: int, gpu_jobs: int, every: float = 10.0) -> None:
        """Keep ``cpu_jobs`` CPU jobs and ``gpu_jobs`` GPU jobs running until :meth:`close`:
        every ``every`` seconds, jobs that ended (their ``--time`` reached) are replaced by new
        ones. A sweep with a ``store=`` goes on through the change of jobs, computing again only
        the chunks that were running in the jobs that ended."""
        self.scale(cpu_jobs, gpu_jobs)
        stop = threading.Event()
        self._stop_keeping = stop

        def keeping():
            while not stop.wait(every):
                try:
                    if self.ended():
                        self.slurm.loop.add_callback(self.scale, cpu_jobs, gpu_jobs)
                except Exception as e:  # (squeue hung, or the cluster closing): next time
                    print(f"CPUGPUCluster.keep: {e!r}", file=sys.stderr)

        threading.Thread(target=keeping, daemon=True, name="slurm-keep").start()

    def _is_gpu(self, name) -> bool:
        return self.slurm.worker_spec[name] is self.gpu_spec

    def job_scripts(self) -> dict[str, str]:
        """The batch scripts of a CPU job and of a GPU job, as ``sbatch`` would get them (with
        the worker name ``dummy-name``, which each submitted job replaces by its own)."""
        gpu_job = self.gpu_spec["cls"](self.slurm.scheduler_address, name="dummy-name",
                                       **self.gpu_spec["options"])
        return {"cpu": self.slurm.job_script(), "gpu": gpu_job.job_script()}

    def client(self) -> Client:
        return Client(self.slurm)  # connects with the cluster's Security

    def close(self) -> None:
        """Cancel every job and stop the scheduler."""
        if self._stop_keeping is not None:
            self._stop_keeping.set()
        self.slurm.close()


def make_cluster(certs=CERTS, *, account=None, queue=None, gpu_queue=None, interface=None,
                 cpu_job=None, gpu_job=None, scheduler_options=None) -> CPUGPUCluster:
    """Start the scheduler here, over TLS; submit nothing yet (see :meth:`CPUGPUCluster.scale`).

    account, queue: Slurm's ``-A`` and ``-p`` for every job; ``gpu_queue`` the partition of GPU
    jobs if it differs. interface: the network interface (``ib0``, ``eth0``) that scheduler and
    workers use. cpu_job, gpu_job: overrides of :data:`CPU_JOB` and :data:`GPU_JOB` (any
    ``SLURMCluster`` job keyword). scheduler_options: overrides of the scheduler's options.
    """
    sec = security(certs)
    cert = sec.tls_scheduler_cert
    cpu = {**CPU_JOB, **(cpu_job or {})}
    gpu = {**GPU_JOB, **(gpu_job or {})}
    options = {"dashboard_address": "127.0.0.1:8787", **(scheduler_options or {})}
    # The dashboard serves HTTPS with the same certificate (Dask reads this when it starts).
    with dask.config.set({"distributed.scheduler.dashboard.tls.cert": cert,
                          "distributed.scheduler.dashboard.tls.key": sec.tls_scheduler_key}):
        slurm = SLURMCluster(security=sec, protocol="tls://", interface=interface,
                             account=account, queue=queue, scheduler_options=options, **cpu)
    # The GPU template: what dask-jobqueue resolved for the CPU jobs' connection (TLS files as
    # the workers see them, protocol, interface, config) with the GPU job's settings.
    resolved = {k: v for k, v in slurm.new_spec["options"].items()
                if k in ("security", "protocol", "interface", "config_name")}
    gpu_options = {**resolved, "account": account, "queue": gpu_queue or queue, **gpu}
    return CPUGPUCluster(slurm, {"cls": slurm.job_cls, "options": gpu_options})


def connect(certs=CERTS, cpu_jobs: int = 2, gpu_jobs: int = 1, wait: bool = True, **kw) -> Client:
    """Start the cluster (:func:`make_cluster` keywords), submit the jobs, return a client.

    The cluster stops, cancelling its jobs, when this process ends, or on
    ``client.cluster.close()``. With ``wait``, returns once every job's worker has connected.
    """
    cluster = make_cluster(certs, **kw)
    cluster.scale(cpu_jobs, gpu_jobs)
    client = cluster.client()
    if wait:
        client.wait_for_workers(cpu_jobs + gpu_jobs)
    return client


def _demo(client) -> float:
    """A DAG with a GPU node; returns the largest gradient difference to plain JAX."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import daskdag

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--certs", default=CERTS)
    p.add_argument("--account")
    p.add_argument("--queue")
    p.add_argument("--gpu-queue")
    p.add_argument("--interface")
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
