"""daskdag's worker plugin (``daskdag/running/workers.py``) measured: a sweep on one default nanny
worker, with and without the plugin, against the same ``jax.vjp`` loop in this process.

    python -m benchmarks.tools.worker_malloc [--reps 5]

Workload: the DAG of ``benchmarks/scenarios/sweeps.py`` (eager nodes, ``tanh`` of matmuls, a
Python branch on a value, two scalar outputs) over 48 items of x float32[400, 256] (400 KB
each), w float32[256, 256], default chunk size. Methods, timed interleaved, medians:

- loop:          ``sweeps.loop``, the hand-written ``jax.vjp`` loop, in this process.
- plugin:        ``sweep_grads`` on a default ``LocalCluster(n_workers=1, threads_per_worker=1,
                 processes=True)``; the first call registered the plugin.
- no_plugin:     the same on a second such cluster, called with ``daskdag.tune-workers: False``.
- env_unset:     a third, started without ``MALLOC_TRIM_THRESHOLD_`` (glibc fully adaptive):
                 the reference the plugin tries to reach.

One run on the 2-core development machine, loaded by other users (5 reps; loop 2.48 s),
loop / method: plugin 0.75, no_plugin 0.59, env_unset 0.66; an earlier run (7 reps, whose
env_unset cluster still had the variable, see below) gave plugin 0.87, no_plugin 0.57. The run
that chose the thresholds (one worker, toggled with mallopt): nanny's setting 0.65, mmap
threshold 32 MiB alone 0.72, trim threshold 64 MiB alone 0.72, both 0.86, 4 / 8 MiB 0.75,
1 / 2 MiB 0.71. The loop's own time varied by 1.6x between reps: read ratios, not times.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import dask
import distributed

from daskdag.running import workers as worker_setup
from .. import common
from ..scenarios import sweeps
CFG = sweeps.Config(items=48, rows=400, width=256, reps=5, chunk_size=0)


def _cluster(stack, env_unset=False):
    config = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None} if env_unset else {}
    with dask.config.set(config):  # each nanny reads it once, when made
        local = stack.enter_context(distributed.LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
            host="127.0.0.1"))
    return stack.enter_context(distributed.Client(local, set_as_default=False))


def _applied(dask_worker, name=worker_setup.NAME):
    import os
    return (os.environ.get("MALLOC_TRIM_THRESHOLD_"),
            getattr(dask_worker.plugins.get(name), "applied", None))


def main(reps: int) -> dict:
    inputs, dag = sweeps.make_inputs(CFG), sweeps.make_dag()
    with contextlib.ExitStack() as stack:
        # First: a nanny also sets its pre-spawn variables in this process's os.environ, where
        # later nannies find them and pass them on whatever the config says.
        unset = _cluster(stack, env_unset=True)
        on, off = _cluster(stack), _cluster(stack)

        def sweep(client, tune=True):
            def run():
                with dask.config.set({"daskdag.tune-workers": tune}):
                    return sweeps.with_sweep(inputs, dag, None, client)
            return run

        methods = {"loop": lambda: sweeps.loop(inputs), "plugin": sweep(on),
                   "no_plugin": sweep(off, tune=False), "env_unset": sweep(unset, tune=False)}
        for run in methods.values():  # warm-up: compiles, imports, registers the plugin on `on`
            run()
        applied = {name: list(c.run(_applied).values())
                   for name, c in (("plugin", on), ("no_plugin", off), ("env_unset", unset))}
        times = common.interleaved(methods, reps)
    med = {m: statistics.median(t) for m, t in times.items()}
    ratios = {f"loop/{m}": med["loop"] / med[m] for m in med if m != "loop"}
    return {"median_s": med, "ratios": ratios, "applied": applied}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=CFG.reps)
    result = main(parser.parse_args().reps)
    print(result)
