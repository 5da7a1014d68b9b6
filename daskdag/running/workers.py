"""Worker set-up, as worker plugins that travel by value: JAX on the CPU in every worker not
meant to own an accelerator (:class:`Platform`), daskdag's serializers (:class:`Serializers`),
and glibc's malloc tuned for JAX (:class:`TuneMalloc`, opt-in: ``daskdag.tune-workers``).

One process at a time can hold a TPU chip, and each JAX process on a GPU preallocates most of
its memory: so only a worker that advertises the resource ``GPU`` or ``TPU``, or (under
``daskdag.worker-platform: auto``) whose environment chose its device, opens the accelerator
(:func:`decide`), and the children of Dask's multiprocessing scheduler run on the CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import sys
from typing import Any

import cloudpickle

from daskdag.transport.malloc import tune_for_good

NAME = "daskdag-tune-malloc"
SERIALIZERS = "daskdag-serializers"
PLATFORM = "daskdag-worker-platform"

SETTINGS = ("auto", "cpu", "any")  # the values of daskdag.worker-platform (see daskdag.yaml)
DEVICES = ("GPU", "TPU")  # the worker resources that mean a worker owns an accelerator
#: Environment variables by which a worker's JAX platform or device was chosen for it.
CHOSEN_BY = ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
             "ROCR_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS")

# The plugins travel by value, needing only the standard library and distributed, so that a
# worker with another daskdag, or none, still starts: this module imports only
# daskdag.transport.malloc, which travels by value too.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def __getattr__(name: str):
    # The plugin classes are made when first asked for: a call on threads never imports distributed.
    if name not in ("TuneMalloc", "Serializers", "Platform"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _made:
        from distributed import WorkerPlugin
        _made.update(_plugin_classes(WorkerPlugin))
    return _made[name]


_made: dict[str, type] = {}


def _plugin_classes(WorkerPlugin: Any) -> dict[str, type]:
    class TuneMalloc(WorkerPlugin):
        """Raise glibc's mmap and trim thresholds in a worker started by a nanny. After
        ``setup``, ``applied`` is ``{"M_MMAP_THRESHOLD": bytes, "M_TRIM_THRESHOLD": bytes}``
        or ``None``, and ``reason`` says why. It never raises."""

        idempotent = True  # the scheduler keeps the first registration; later clients add nothing
        name = NAME

        def __init__(self):
            self.applied: dict[str, int] | None = None
            self.reason = "not set up"

        def setup(self, worker=None):
            self.applied, self.reason = tune_for_good()

    class Serializers(WorkerPlugin):
        """Register daskdag's serializers in the worker, if it has daskdag; after ``setup``,
        ``registered`` says whether it did."""

        idempotent = True
        name = SERIALIZERS

        def __init__(self):
            self.registered = False

        def setup(self, worker=None):
            try:  # (by name: this travels by value, to workers with or without daskdag)
                importlib.import_module("daskdag.transport.protocol").with_distributed()
            except ImportError:  # nothing of daskdag's can run in this worker
                return
            self.registered = True

    class Platform(WorkerPlugin):
        """Run JAX on the worker's CPU where :func:`decide` says so under ``setting``; after
        ``setup``, ``on_cpu`` says whether it did and ``reason`` why. A worker that keeps its
        accelerator opens it in ``setup``, so that one that cannot fails there, clearly."""

        name = PLATFORM

        def __init__(self, setting: str):
            self.setting = setting
            self.made_in = _here()
            self.on_cpu: bool | None = None
            self.reason = "not set up"

        async def setup(self, worker=None):
            resources = dict(worker.state.total_resources) if worker is not None else {}
            where = f"worker {worker.address}" if worker is not None else "this worker"
            if self.made_in == _here():
                # (a worker in the client's own process: LocalCluster(processes=False))
                self.on_cpu, self.reason = False, "it runs in the client's process, sharing its JAX"
                return
            self.on_cpu, self.reason = decide(self.setting, resources, os.environ)
            if self.on_cpu:
                held = jax_on_cpu()
                if held is not None:
                    raise RuntimeError(
                        f"{where} already runs JAX on {held!r}, but {self.reason}: under "
                        f"daskdag.worker-platform {self.setting!r} it would run JAX on its CPU, "
                        f"leaving the accelerator to a worker meant for it. Restart it; or start "
                        f"it with `--resources {'TPU' if held == 'tpu' else 'GPU'}=1` if it is "
                        f"meant to own the device, or set daskdag.worker-platform to 'any'")
            elif self.setting != "any" and importlib.util.find_spec("jax") is not None:
                import asyncio
                try:  # (off the event loop: opening a TPU takes seconds)
                    await asyncio.get_running_loop().run_in_executor(None, _open_jax)
                except Exception as e:
                    raise RuntimeError(
                        f"{where} keeps its accelerator ({self.reason}) but JAX cannot open it "
                        f"there: {type(e).__name__}: {e}. One process at a time can hold a TPU "
                        f"chip, and each JAX process on a GPU preallocates most of its memory: "
                        f"run one worker process per device (`CUDA_VISIBLE_DEVICES=i dask worker "
                        f"ADDRESS --nworkers 1 --resources GPU=1`; on a TPU host `dask worker "
                        f"ADDRESS --nworkers 1 --resources TPU=1`), the other workers without that "
                        f"resource (they run JAX on their CPU), and the client's own JAX on the "
                        f"CPU where it runs on that host (JAX_PLATFORMS=cpu)") from e

    made = {"TuneMalloc": TuneMalloc, "Serializers": Serializers, "Platform": Platform}
    for name, cls in made.items():
        cls.__qualname__ = name
    return made


def _here() -> tuple[str, int]:
    """This process's host and id (a worker that finds its Platform's runs in the client's)."""
    return socket.gethostname(), os.getpid()


def decide(setting: str, resources: dict, environ) -> tuple[bool, str]:
    """``(on_cpu, why)``: whether a worker runs JAX on its CPU under ``setting``, and why."""
    if setting == "any":
        return False, "daskdag.worker-platform is 'any'"
    owned = [r for r in DEVICES if resources.get(r, 0) > 0]
    if owned:
        return False, f"it advertises the resource {owned[0]}"
    chosen = [v for v in CHOSEN_BY if environ.get(v)]
    if setting == "auto" and chosen:
        return False, f"its environment sets {chosen[0]}={environ[chosen[0]]}"
    return True, f"it advertises no {' or '.join(DEVICES)} resource"


def jax_on_cpu() -> str | None:
    """Make this process's JAX, and its children's, run on the CPU; returns None, or the
    platform JAX already runs on where its backend had started on another."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    jax.config.update("jax_platforms", "cpu")
    backend = jax.default_backend()  # (starts it: on the CPU where it had not started)
    return None if backend == "cpu" else backend


def child_on_cpu(then=None) -> None:
    """A child of Dask's multiprocessing scheduler: JAX on its CPU, then the user's ``then``."""
    held = jax_on_cpu()
    if held is not None:
        raise RuntimeError(f"this child process of Dask's multiprocessing scheduler (pid "
                           f"{os.getpid()}) runs JAX on {held!r} already: it must run on the CPU")
    if then is not None:
        then()


def _open_jax() -> None:
    import jax
    jax.devices()
