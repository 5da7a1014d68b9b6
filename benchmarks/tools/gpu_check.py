"""GPU check: one GPU worker, one CPU-only worker, a DAG with a heavy GPU node, gradients vs JAX.

Run on a machine with an NVIDIA GPU and JAX's CUDA build (``pip install 'jax[cuda13]'``):

    python benchmarks/tools/gpu_check.py

It starts a scheduler and two worker processes on 127.0.0.1: ``gpu`` (``JAX_PLATFORMS=cuda``,
advertising ``GPU=1``) and ``cpu`` (``JAX_PLATFORMS=cpu``). The DAG's heavy node is marked
``device='gpu'``; the others are unannotated. It prints, for each node, the workers its forward
and backward tasks ran on and that worker's JAX device; checks that every task of the GPU node
ran on the GPU worker; compares values and gradients with plain JAX in this process; and exits
non-zero on any failure. ``--cpu-only`` runs the same script where there is no GPU (the ``gpu``
worker is then a CPU worker that advertises ``GPU=1``), to check the script itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Worker processes are spawned, and import this file first: JAX must not be imported at its top
# level, or it would read JAX_PLATFORMS there before each worker's own environment is applied.

# Set before JAX starts, here and in the workers: the same float32 matmul precision everywhere
# (GPUs default to TF32), and no process grabbing most of the GPU's memory up front.
ENV = {"JAX_DEFAULT_MATMUL_PRECISION": "highest", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
N = 4096  # the heavy node multiplies N x N matrices


def model():
    """The node functions, and the DAG. Defined here so they travel by value to the workers."""
    import jax.numpy as jnp
    from daskdag import Node
    def prepare(x):
        return jnp.tanh(x) / jnp.sqrt(x.shape[0])

    def heavy(a, w):
        h = a
        for _ in range(8):
            h = jnp.tanh(h @ w)
        return h

    def loss(h):
        return jnp.mean(h ** 2)

    def spread(h):
        return jnp.std(h)

    dag = {"A": (prepare, ["x"]),
           "H": Node(heavy, ["A", "w"], device="gpu"),
           "L": (loss, ["H"]),
           "S": (spread, ["H"])}
    def composed(head):
        return lambda x, w: head(heavy(prepare(x), w))

    return dag, {"L": composed(loss), "S": composed(spread)}


def start_cluster(cpu_only: bool):
    from distributed import Nanny, Scheduler, SpecCluster

    common = {"nthreads": 1, "host": "127.0.0.1"}
    gpu_env = {**ENV, "JAX_PLATFORMS": "cpu" if cpu_only else "cuda"}
    return SpecCluster(
        scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}},
        workers={"gpu": {"cls": Nanny, "options": {**common, "env": gpu_env, "resources": {"GPU": 1}}},
                 "cpu": {"cls": Nanny, "options": {**common, "env": {**ENV, "JAX_PLATFORMS": "cpu"}}}})


def worker_device() -> str:
    import jax

    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind}"


def main() -> int:
    os.environ.update({k: os.environ.get(k, v) for k, v in ENV.items()})
    import distributed
    import jax
    import jax.numpy as jnp
    import numpy as np
    from distributed import Client

    import daskdag

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-only", action="store_true", help="no GPU: check the script itself")
    parser.add_argument("--n", type=int, default=N, help="matrix size of the heavy node")
    args = parser.parse_args()
    if not args.cpu_only and not any(d.platform == "gpu" for d in jax.devices()):
        print("no GPU visible to JAX here; install JAX's CUDA build, or pass --cpu-only",
              file=sys.stderr)
        return 2

    rng = np.random.default_rng(0)
    inputs = {"x": jnp.asarray(rng.standard_normal((256, args.n), np.float32)),
              "w": jnp.asarray(rng.standard_normal((args.n, args.n), np.float32) / np.sqrt(args.n))}
    dag, composed = model()
    start = time.perf_counter()
    with start_cluster(args.cpu_only) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=120)
        info = client.sync(client.scheduler.identity, n_workers=-1)["workers"]  # (now)
        names = {addr: w["name"] for addr, w in info.items()}
        devices = client.run(worker_device)
        with distributed.get_task_stream(client) as ts:
            res = daskdag.compute_grads(dag, inputs, ["L", "S"], wrt=["x"], client=client)
        elapsed = time.perf_counter() - start

    ok = True
    print(f"{'node':<5} {'forward ran on':<28} {'backward ran on':<28}")
    if not all(devices[w].startswith("cpu:") for w, n in names.items() if n == "cpu"):
        print("FAIL: the CPU-only worker sees a GPU (its JAX_PLATFORMS was not applied)")
        ok = False
    for node in dag:
        fwd = {t["worker"] for t in ts.data if t["key"].startswith(f"fwd:{node}-")}
        bwd = {t["worker"] for t in ts.data if t["key"].startswith(f"bwd:{node}[")}
        show = lambda ws: ", ".join(f"{names[w]} ({devices[w]})" for w in sorted(ws)) or "-"
        print(f"{node:<5} {show(fwd):<28} {show(bwd):<28}")
        if node == "H" and {names[w] for w in fwd | bwd} != {"gpu"}:
            print("  FAIL: the device='gpu' node ran off the GPU worker")
            ok = False

    for name, r in res.items():
        value, grad = jax.value_and_grad(composed[name])(inputs["x"], inputs["w"])
        diff = float(jnp.max(jnp.abs(r.grad["x"] - grad)) / jnp.max(jnp.abs(grad)))
        vdiff = abs(float(r.value - value)) / max(abs(float(value)), 1e-30)
        good = diff < 1e-4 and vdiff < 1e-5
        ok &= good
        print(f"{name}: value {float(r.value):.6g} (rel. diff {vdiff:.1e}), "
              f"grad rel. diff {diff:.1e} {'ok' if good else 'FAIL'}")
    print(f"cluster start + compute: {elapsed:.1f} s; {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
