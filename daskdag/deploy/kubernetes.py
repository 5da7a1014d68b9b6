"""daskdag's Kubernetes cluster from Python, through the dask-kubernetes operator's ``KubeCluster``.

The resources of ``deploy/kubernetes/`` (tests/test_deploy.py checks they are equal), built as
dicts: a ``DaskCluster`` (scheduler, Service, default CPU worker group), a ``DaskWorkerGroup`` of
GPU workers, a ``DaskAutoscaler``. Pods run as uid 1000; every Dask connection is mutual TLS with
the Secret ``certs_secret`` (``ca.pem``, ``cert.pem``, ``key.pem``) mounted at ``/etc/dask/tls``.
:func:`make_cluster` starts them (docs/guides/deployment.md, "Kubernetes") as a
:class:`TLSKubeCluster`: ``KubeCluster`` speaks plain ``tcp://`` to its scheduler, this one
``tls://``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import dask_kubernetes.operator.kubecluster.kubecluster as _kubecluster
import dask_kubernetes.operator.networking as _networking
from dask_kubernetes.operator import KubeCluster
from distributed import Security
from distributed.core import rpc

import daskdag
from daskdag.cli import security as _security

__all__ = ["TLSKubeCluster", "autoscaler", "cluster_spec", "gpu_worker_spec", "make_cluster",
           "worker_group"]

TLS_MOUNT = "/etc/dask/tls"
SCHEDULER_PORT = 8786
DASHBOARD_PORT = 8787
WORKER_DASHBOARD_PORT = 8788
IMAGE = f"daskdag:{daskdag.__version__}"
GPU_IMAGE = f"daskdag:{daskdag.__version__}-gpu"

# The scheduler's default HTTP routes (distributed.yaml) and the API the operator calls, as a Dask
# config value in an environment variable (a Python literal: Dask reads it with ast.literal_eval).
SCHEDULER_HTTP_ROUTES = ["distributed.http.scheduler.prometheus", "distributed.http.scheduler.info",
                         "distributed.http.scheduler.json", "distributed.http.health",
                         "distributed.http.proxy", "distributed.http.statics",
                         "distributed.http.scheduler.api"]
SCHEDULER_API_ENV = {"name": "DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES",
                     "value": repr(SCHEDULER_HTTP_ROUTES)}

_POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000}
_GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
_TLS_ARGS = ("--tls-ca-file", f"{TLS_MOUNT}/ca.pem", "--tls-cert", f"{TLS_MOUNT}/cert.pem",
             "--tls-key", f"{TLS_MOUNT}/key.pem")


def _resource(kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kubernetes.dask.org/v1", "kind": kind,
            "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "daskdag"}},
            "spec": spec}


def _pod(container: str, *, image: str, image_pull_policy: str, certs_secret: str,
         resources: Mapping[str, Any], gpu: bool = False, **fields: Any) -> dict[str, Any]:
    """A pod running as uid 1000 with the one container ``container`` (its ``fields``), which
    mounts the TLS Secret; a GPU pod tolerates the GPU node taint."""
    pod: dict[str, Any] = {"securityContext": dict(_POD_SECURITY)}
    if gpu:
        pod["tolerations"] = [dict(t) for t in _GPU_TOLERATIONS]
    pod["containers"] = [{
        "name": container, "image": image, "imagePullPolicy": image_pull_policy, **fields,
        "resources": {k: dict(v) for k, v in resources.items()},
        "volumeMounts": [{"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True}],
    }]
    pod["volumes"] = [{"name": "tls",
                       "secret": {"secretName": certs_secret, "defaultMode": 0o440}}]
    return pod


def _worker_spec(scheduler: str, *, n_workers: int, nthreads: int, gpu: bool,
                 env: Mapping[str, str], **pod: Any) -> dict[str, Any]:
    args = ["dask", "worker", scheduler, "--name", "$(DASK_WORKER_NAME)",
            "--nthreads", str(nthreads)]
    if gpu:
        args += ["--resources", "GPU=1"]
    args += ["--dashboard-address", str(WORKER_DASHBOARD_PORT), *_TLS_ARGS]
    base_env = {"DASK_SCHEDULER_ADDRESS": scheduler,
                "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "true"}
    base_env.update({"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"} if gpu
                    else {"JAX_PLATFORMS": "cpu"})
    variables = [{"name": k, "value": v} for k, v in {**base_env, **env}.items()]
    ports = [{"name": "http-dashboard", "containerPort": WORKER_DASHBOARD_PORT, "protocol": "TCP"}]
    return {"replicas": n_workers, "spec": _pod("worker", gpu=gpu, args=args, env=variables,
                                                ports=ports, **pod)}


def _scheduler_address(name: str) -> str:
    return f"tls://{name}-scheduler:{SCHEDULER_PORT}"


def cluster_spec(name: str = "daskdag", *, image: str = IMAGE, certs_secret: str = "daskdag-tls",
                 n_workers: int = 2, nthreads: int = 2,
                 worker_resources: Mapping[str, Any] | None = None,
                 scheduler_resources: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, scheduler_api: bool = True,
                 image_pull_policy: str = "IfNotPresent") -> dict[str, Any]:
    """The ``DaskCluster`` of ``deploy/kubernetes/daskcluster.yaml`` (equal to it with the
    defaults), for ``kubectl apply`` or ``KubeCluster(custom_cluster_spec=...)``: the scheduler
    (TLS on port 8786, Service ``<name>-scheduler``, port ``tcp-comm``; dashboard on 8787, plain
    HTTP inside the cluster, its health probes) and a default group of ``n_workers`` CPU workers
    of ``nthreads`` threads, all from ``image`` (deploy/Dockerfile's target ``cpu``), mounting
    the Secret ``certs_secret`` (``ca.pem``, ``cert.pem``, ``key.pem``).

    ``worker_resources`` and ``scheduler_resources`` are Kubernetes ``resources`` (default: 2
    CPUs and 8 GiB per worker; 1 CPU and 2 GiB requested, 4 GiB limit, for the scheduler).
    ``env`` adds environment variables to the workers (``{"EXTRA_PIP_PACKAGES": "optax"}``: the
    image's entrypoint installs them at start). ``scheduler_api`` serves the scheduler's HTTP
    API (``/api/v1``, on the dashboard's port), which the operator needs to autoscale and to
    retire workers gracefully; without it, it deletes worker pods to scale down.
    """
    scheduler = _scheduler_address(name)
    sched_env = [{"name": "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION", "value": "true"}]
    if scheduler_api:
        sched_env.append(dict(SCHEDULER_API_ENV))
    probe = {"httpGet": {"port": "http-dashboard", "path": "/health"}}
    scheduler_pod = _pod(
        "scheduler", image=image, image_pull_policy=image_pull_policy, certs_secret=certs_secret,
        args=["dask", "scheduler", "--protocol", "tls", "--port", str(SCHEDULER_PORT),
              "--dashboard-address", f":{DASHBOARD_PORT}", *_TLS_ARGS],
        env=sched_env,
        ports=[{"name": "tls-comm", "containerPort": SCHEDULER_PORT, "protocol": "TCP"},
               {"name": "http-dashboard", "containerPort": DASHBOARD_PORT, "protocol": "TCP"}],
        readinessProbe={**probe, "initialDelaySeconds": 5, "periodSeconds": 10},
        livenessProbe={**probe, "initialDelaySeconds": 15, "periodSeconds": 20},
        resources=scheduler_resources or {"requests": {"cpu": "1", "memory": "2Gi"},
                                          "limits": {"memory": "4Gi"}})
    service = {"type": "ClusterIP",
               "selector": {"dask.org/cluster-name": name, "dask.org/component": "scheduler"},
               "ports": [{"name": "tcp-comm", "protocol": "TCP", "port": SCHEDULER_PORT,
                          "targetPort": "tls-comm"},
                         {"name": "http-dashboard", "protocol": "TCP", "port": DASHBOARD_PORT,
                          "targetPort": "http-dashboard"}]}
    worker = _worker_spec(scheduler, image=image, certs_secret=certs_secret, n_workers=n_workers,
                          nthreads=nthreads, gpu=False, env=env or {},
                          resources=worker_resources or {"requests": {"cpu": "2", "memory": "8Gi"},
                                                         "limits": {"cpu": "2", "memory": "8Gi"}},
                          image_pull_policy=image_pull_policy)
    return _resource("DaskCluster", name,
                     {"scheduler": {"spec": scheduler_pod, "service": service}, "worker": worker})


def gpu_worker_spec(cluster: str = "daskdag", *, image: str = GPU_IMAGE,
                    certs_secret: str = "daskdag-tls", n_workers: int = 1,
                    resources: Mapping[str, Any] | None = None,
                    env: Mapping[str, str] | None = None,
                    image_pull_policy: str = "IfNotPresent") -> dict[str, Any]:
    """The GPU workers of ``deploy/kubernetes/gpu-workergroup.yaml`` (its ``spec.worker``,
    ``{"replicas": ..., "spec": PodSpec}``), for ``KubeCluster.add_worker_group(name,
    custom_spec=...)``: ``n_workers`` pods of the GPU ``image`` (deploy/Dockerfile's target
    ``gpu``) connecting to ``<cluster>-scheduler``, each with one GPU (default ``resources``: 4
    CPUs, 16 GiB and 1 GPU), tolerating the usual GPU node taint; one thread, the Dask resource
    ``GPU=1`` so that nodes marked ``device="gpu"`` run there, ``JAX_PLATFORMS=cuda``. The
    other arguments are :func:`cluster_spec`'s."""
    gpu = {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}
    return _worker_spec(_scheduler_address(cluster), image=image, certs_secret=certs_secret,
                        n_workers=n_workers, nthreads=1, gpu=True, env=env or {},
                        resources=resources or {"requests": dict(gpu), "limits": dict(gpu)},
                        image_pull_policy=image_pull_policy)


def worker_group(cluster: str, group: str, worker: Mapping[str, Any]) -> dict[str, Any]:
    """The ``DaskWorkerGroup`` ``<cluster>-<group>`` (``group`` a short name: ``"gpu"``), as
    ``KubeCluster.add_worker_group(group, custom_spec=worker)`` creates it; ``worker`` is its
    ``worker`` field, e.g. :func:`gpu_worker_spec`'s."""
    return _resource("DaskWorkerGroup", f"{cluster}-{group}",
                     {"cluster": cluster, "worker": dict(worker)})


def autoscaler(cluster: str = "daskdag", minimum: int = 1, maximum: int = 10) -> dict[str, Any]:
    """The ``DaskAutoscaler`` ``cluster`` (``deploy/kubernetes/autoscaling/autoscaler.yaml``),
    as ``KubeCluster.adapt(minimum, maximum)`` creates it: it scales the default (CPU) worker
    group of the ``DaskCluster`` ``cluster`` to what the scheduler asks for, within
    ``[minimum, maximum]``; GPU groups are not autoscaled."""
    if not 0 <= minimum <= maximum:
        raise ValueError(f"need 0 <= minimum <= maximum, got minimum={minimum}, maximum={maximum}")
    return _resource("DaskAutoscaler", cluster,
                     {"cluster": cluster, "minimum": minimum, "maximum": maximum})


# KubeCluster connects to its scheduler with `rpc` (its module's, and its networking module's in
# wait_for_scheduler_comm) without connection arguments: plain TCP only. _tls_comms replaces both
# by _rpc, which adds those of the TLSKubeCluster connecting in this coroutine, if any.
_connection_args: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "daskdag_kube_connection_args", default=None)


def _rpc(address: Any, **kwargs: Any) -> rpc:
    args = _connection_args.get()
    if args is not None:
        kwargs.setdefault("connection_args", args)
    return rpc(address, **kwargs)


@contextlib.contextmanager
def _tls_comms(security: Security) -> Iterator[None]:
    """Within: KubeCluster's connections from this coroutine use ``security``."""
    _kubecluster.rpc = _networking.rpc = _rpc
    token = _connection_args.set(security.get_connection_args("client"))
    try:
        yield
    finally:
        _connection_args.reset(token)


class TLSKubeCluster(KubeCluster):
    """``dask_kubernetes.operator.KubeCluster`` (``kwargs`` its arguments) for a scheduler that
    speaks only TLS: it connects with ``security`` (e.g. ``daskdag.cli.security("certs")``), and
    a ``Client(cluster)`` takes the same (``cluster.security``)."""

    def __init__(self, *, security: Security, **kwargs: Any) -> None:
        self.security = security
        super().__init__(**kwargs)

    async def _get_scheduler_address(self) -> str:
        address: str = await super()._get_scheduler_address()
        return "tls://" + address.split("://", 1)[-1]

    async def _start(self) -> None:
        with _tls_comms(self.security):
            await super()._start()


def make_cluster(name: str = "daskdag", *, certs: str | os.PathLike[str],
                 image: str = IMAGE, gpu_image: str = GPU_IMAGE,
                 certs_secret: str = "daskdag-tls", n_workers: int = 2, gpu_workers: int = 0,
                 namespace: str | None = None, env: Mapping[str, str] | None = None,
                 adapt: Sequence[int] | None = None, **kwargs: Any) -> TLSKubeCluster:
    """daskdag's cluster on Kubernetes, started: the :func:`cluster_spec` ``DaskCluster`` and,
    if ``gpu_workers``, a ``<name>-gpu`` worker group of :func:`gpu_worker_spec`; a
    ``Client(cluster)`` connects over TLS. Needs a kubeconfig that reaches the cluster, the
    operator, and the Secret ``certs_secret`` made from the files of ``certs``.
    ``cluster.scale(n)`` sets the CPU workers, ``cluster.scale(n, worker_group="gpu")`` the GPU
    ones; ``cluster.close()`` deletes everything.

    Args:
        certs: the directory of ``daskdag certs`` this client connects with.
        gpu_image, gpu_workers: :func:`gpu_worker_spec`'s ``image`` and ``n_workers`` (0: no GPU
            worker group).
        image, certs_secret, n_workers, env: :func:`cluster_spec`'s.
        namespace: the namespace; default the kubeconfig's.
        adapt: ``(minimum, maximum)``: autoscale the CPU workers from the start.
        **kwargs: more ``KubeCluster`` arguments (``resource_timeout``, ``shutdown_on_close``,
            ``port_forward_cluster_ip``, ...).
    """
    spec = cluster_spec(name, image=image, certs_secret=certs_secret, n_workers=n_workers, env=env)
    cluster = TLSKubeCluster(security=_security(certs), custom_cluster_spec=spec,
                             namespace=namespace, **kwargs)
    try:
        if gpu_workers:
            cluster.add_worker_group("gpu", custom_spec=gpu_worker_spec(
                name, image=gpu_image, certs_secret=certs_secret, n_workers=gpu_workers, env=env))
        if adapt is not None:
            minimum, maximum = adapt
            cluster.adapt(minimum=minimum, maximum=maximum)
    except BaseException:
        cluster.close()
        raise
    return cluster
