"""Where a node runs, among the local devices of the process that runs it.

A node holds its ``device`` as a portable string, ``"platform:index"`` (the ``index``-th of
``jax.devices(platform)``), so that a node pickled to a worker names the device by what it is
there; :func:`resolve` finds the ``jax.Device`` in the process that runs it. A placed stage's
tasks :func:`put` the values they take on its device and run their eager ops :func:`on` it.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any

import jax

from daskdag.errors import DAGError

#: A node's device where it gives none, in a DAG where some node gives one (so that values meet
#: on one device): the default device of the process that runs it.
DEFAULT = "default"
#: The Dask worker resource a node on a device of these platforms asks for on a cluster.
RESOURCES = {"gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "tpu": "TPU"}
_FORM = re.compile(r"([a-z][a-z0-9_]*)(?::(\d+))?")


def normalised(device: Any, what: str) -> str | None:
    """``device`` as a node holds it: None; a ``jax.Device`` as ``"platform:index"``; a
    platform (``"cpu"``) as its first device (``"cpu:0"``); ``"platform:index"`` as it is.
    Anything else is a :class:`~daskdag.DAGError` naming ``what`` (``"node 'A'"``)."""
    if device is None or device == DEFAULT:
        return device
    if isinstance(device, jax.Device):
        return f"{device.platform}:{jax.devices(device.platform).index(device)}"
    found = _FORM.fullmatch(device) if isinstance(device, str) else None
    if found is None:
        raise DAGError(f"{what}: device must be a jax.Device, a platform ('cpu', 'gpu', "
                       f"'tpu') or 'platform:index' ('cpu:1'), or None, got {device!r}")
    return f"{found[1]}:{int(found[2] or 0)}"


def resources(device: str | None) -> dict[str, float]:
    """The Dask worker resources a node on ``device`` needs: ``{"GPU": 1}`` on a GPU,
    ``{"TPU": 1}`` on a TPU, none on a CPU or the default device."""
    platform = (device.platform if isinstance(device, jax.Device)
                else device.partition(":")[0] if isinstance(device, str) else None)
    return {RESOURCES[platform]: 1} if platform in RESOURCES else {}


def here() -> tuple[str, ...]:
    """This process's devices, as :func:`normalised` names them: its default backend's, then
    its CPUs."""
    return tuple(f"{platform}:{k}" for platform in dict.fromkeys((jax.default_backend(), "cpu"))
                 for k in range(len(_platform(platform))))


def _platform(platform: str) -> list:
    try:
        return jax.devices(platform)
    except RuntimeError:  # (no such backend in this process)
        return []


@functools.cache
def _resolved(device: str) -> jax.Device | None:
    platform, _, index = device.partition(":")
    devices = _platform(platform)
    return devices[int(index)] if int(index) < len(devices) else None


def resolve(device: str, node: str = "") -> jax.Device:
    """The ``jax.Device`` that ``device`` (:func:`normalised`) names in this process; a
    :class:`~daskdag.DAGError` naming ``node`` and this process's devices where it has none."""
    if device == DEFAULT:
        default = getattr(jax.config, "jax_default_device")  # (not in JAX's stubs)
        if default is None:
            return jax.devices()[0]
        return default if isinstance(default, jax.Device) else jax.devices(default)[0]
    found = _resolved(device)
    if found is None:
        who = f"node {node!r}: " if node else ""
        raise DAGError(f"{who}device {device!r} is not one of this process's devices "
                       f"({', '.join(here())}); on a cluster, a node runs on a worker that "
                       f"has its device")
    return found


def check(nodes: dict) -> None:
    """Refuse, before anything runs, a node among ``nodes`` (name -> node) on a device this
    process does not have."""
    for name, node in nodes.items():
        if node.device is not None:
            resolve(node.device, name)


def on(device: str | None, node: str = "") -> contextlib.AbstractContextManager:
    """Eager JAX ops in this context run on ``device`` (None: wherever JAX puts them)."""
    return contextlib.nullcontext() if device is None else jax.default_device(resolve(device, node))


def put(values: Any, device: str | None, node: str = "") -> Any:
    """``values`` (a pytree) with their JAX arrays not on ``device`` put there, in one
    asynchronous ``jax.device_put`` (none where ``device`` is None). NumPy arrays and numbers
    stay as they are: JAX takes them where its ops run."""
    if device is None:
        return values
    target = resolve(device, node)
    there = _sharding(target)
    leaves, treedef = jax.tree.flatten(values)
    moving = [k for k, x in enumerate(leaves) if isinstance(x, jax.Array)
              and not isinstance(x, jax.core.Tracer) and x.sharding != there]
    if not moving:
        return values
    moved = jax.device_put([leaves[k] for k in moving], target)
    for k, x in zip(moving, moved):
        leaves[k] = x
    return treedef.unflatten(leaves)


@functools.cache
def _sharding(device: jax.Device) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device)


def beside(x: Any, y: Any) -> Any:
    """``y`` where it can meet ``x`` in one op: put on ``x``'s device when both are arrays
    committed to different devices (JAX refuses to combine those), else itself."""
    if (isinstance(x, jax.Array) and isinstance(y, jax.Array)
            and not isinstance(x, jax.core.Tracer) and not isinstance(y, jax.core.Tracer)
            and x.committed and y.committed and x.sharding != y.sharding):
        return jax.device_put(y, x.sharding)
    return y


def free_memory(device: jax.Device) -> int | None:
    """``device``'s free memory as its ``memory_stats()`` says (an accelerator's); None where
    it says none (the host's CPU)."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return max(0, stats["bytes_limit"] - stats.get("bytes_in_use", 0))
