"""A sweep on this process's devices (:class:`Devices`), where ``daskdag.sweep-devices`` names
them and every node that carries items is ``vmap=True``: chunks as large as the devices' memory
allows (:func:`chunk_size`), each chunk's items padded to a multiple of the devices' count and
sharded over a 1-D mesh of them; the shared inputs put once, replicated. Chunks are dispatched
from the calling thread, so the next chunk's items travel while one computes.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import daskdag.config as config
from daskdag.caches import ByObject
from daskdag.errors import DAGError
from daskdag.model.devices import free_memory
from daskdag.model.leaves import UNKNOWN, is_array
from daskdag.sweeps.engines import Done, Here, InProcess, kept_chunk_graph
from daskdag.sweeps.planning import Sweep
from daskdag.sweeps.results import item_avals, item_shapes

AXIS = "items"  # the mesh axis a chunk's items are sharded along
DEPTH = 2  # chunks in flight at once: one computing, the next one's items on their way
FRACTION = 0.5  # of the devices' free memory, what the chunks in flight may take
FALLBACK_BYTES = 4 * 2 ** 30  # an accelerator's free memory per device, where JAX does not say
RESIDUALS = 3  # copies of a node's value kept while a chunk computes (value, residuals, cotangent)


@dataclass(frozen=True)
class Placement:
    """The devices a sweep's chunks run on: a mesh of them, axis :data:`AXIS`."""

    devices: tuple

    @cached_property
    def mesh(self) -> jax.sharding.Mesh:
        return jax.make_mesh((len(self.devices),), (AXIS,), (AxisType.Auto,),
                             devices=self.devices)

    @cached_property
    def items(self) -> NamedSharding:
        """A chunk's items: their leading axis split over the devices."""
        return NamedSharding(self.mesh, PartitionSpec(AXIS))

    @property
    def count(self) -> int:
        return len(self.devices)

    @property
    def platform(self) -> str:
        return self.devices[0].platform

    @property
    def accelerator(self) -> bool:
        return self.platform != "cpu"

    def where(self) -> str:
        """Where a sweep on them runs, in words."""
        n = self.count
        return (f"this process ({n} {self.platform} device{'s' if n > 1 else ''}, the items "
                f"sharded over {'them' if n > 1 else 'it'})")

    def padded(self, count: int, width: int) -> int:
        """The items a chunk of ``count`` runs: ``width`` where that at most doubles it, to reuse
        the other chunks' program; else ``count`` up to a multiple of the devices'."""
        return width if width < 2 * count else -(-count // self.count) * self.count

    def put(self, values: dict, count: int, padded: int) -> dict:
        """A chunk's ``count`` items, padded to ``padded`` with copies of the last one, put on
        the devices along :data:`AXIS` (asynchronously)."""
        return _put(values, self.items, lambda a: is_array(a) and np.ndim(a),
                    lambda a: _pad(a, padded - count))

    def replicate(self, value):
        """A shared input, its arrays on every device."""
        return _put(value, NamedSharding(self.mesh, PartitionSpec()))


def _put(tree, sharding, which=is_array, prepare=lambda a: a):
    """``tree`` with its leaves for which ``which(leaf)`` put on ``sharding``, each as
    ``prepare(leaf)``, in one ``jax.device_put``."""
    leaves, treedef = jax.tree.flatten(tree)
    at = [k for k, a in enumerate(leaves) if which(a)]
    for k, a in zip(at, jax.device_put([prepare(leaves[k]) for k in at], sharding)):
        leaves[k] = a
    return jax.tree.unflatten(treedef, leaves)


def _pad(a, extra: int):
    """``a`` with ``extra`` more rows, copies of its last."""
    if not extra:
        return a
    if isinstance(a, jax.Array):
        return jnp.concatenate([a, jnp.repeat(a[-1:], extra, axis=0)])
    return np.concatenate([a, np.repeat(a[-1:], extra, axis=0)])


def placement(sweep: Sweep, client, local: str | None) -> Placement | None:
    """The devices ``sweep`` runs its chunks on (``daskdag.sweep-devices``), or None: on a
    cluster, Dask's processes scheduler, or where a node carrying items is not ``vmap=True``."""
    if client is not None or local == "processes" or not sweep.vectorized:
        return None
    devices = chosen(config.get("sweep-devices"))
    return None if devices is None else _placement(devices)


def chosen(setting) -> tuple | None:
    """The devices ``daskdag.sweep-devices`` names: local devices of JAX's default platform."""
    if setting in ("none", None, False):
        return None
    devices = jax.local_devices()
    if setting == "auto":
        return tuple(devices) if jax.default_backend() != "cpu" else None
    if setting == "all":
        return tuple(devices)
    if isinstance(setting, str) and setting.isdigit():
        setting = int(setting)
    if isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1:
        if setting > len(devices):
            raise DAGError(f"daskdag.sweep-devices is {setting}, but this process has "
                           f"{len(devices)} {jax.default_backend()} device"
                           f"{'s' if len(devices) > 1 else ''}: {list(devices)}")
        return tuple(devices[:setting])
    raise DAGError(f"daskdag.sweep-devices is 'auto', 'all', 'none' or a number of devices, "
                   f"not {setting!r}")


_placement = functools.lru_cache(maxsize=8)(Placement)  # one mesh for the same devices


def free_bytes(on: Placement) -> int:
    """The devices' free memory, together, as ``Device.memory_stats()`` says; where it does
    not, on CPU the host's available memory, else :data:`FALLBACK_BYTES` a device."""
    free = [f for f in map(free_memory, on.devices) if f is not None]
    if len(free) == len(on.devices):
        return sum(free)
    if not on.accelerator:
        import psutil  # (distributed's requirement)
        return int(psutil.virtual_memory().available)
    return FALLBACK_BYTES * on.count


_item_bytes: ByObject[tuple[int, int]] = ByObject("sweeps' bytes per item", 64)


def item_bytes(sweep: Sweep) -> tuple[int, int]:
    """One item's bytes on the devices: ``(while its chunk computes, its results)``, from the
    shapes of its inputs, node values (each counted :data:`RESIDUALS` times; at least twice the
    inputs' where a node cannot be traced) and results, traced abstractly. Kept by plan."""
    hit = _item_bytes.get(sweep.plan)
    if hit is not None:
        return hit
    plan = sweep.plan
    avals = item_avals(sweep)
    inputs = sum(_nbytes(avals[i]) for i in sweep.carried())
    values = sum(_nbytes(avals[n]) for n in plan.needed
                 if n in sweep.carrying and avals[n] is not UNKNOWN)
    shapes = item_shapes(sweep, avals)
    results = sum(_nbytes(v) for v in shapes[0].values() if v is not None) + sum(
        _nbytes(g) for grads in shapes[1].values() for g in grads.values())
    working = inputs + max(RESIDUALS * values, 2 * inputs) + results
    return _item_bytes.put(plan, (working, results))


def _nbytes(tree) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)
               if isinstance(a, jax.ShapeDtypeStruct))


def results_on_device(sweep: Sweep, on: Placement | None) -> bool:
    """Whether the sweep's results stay jax.Arrays (``daskdag.sweep-results``)."""
    setting = config.get("sweep-results")
    if setting in ("device", "host"):
        return setting == "device"
    if setting != "auto":
        raise DAGError(f"daskdag.sweep-results is 'auto', 'device' or 'host', not {setting!r}")
    return on is not None and on.accelerator and \
        sweep.size * item_bytes(sweep)[1] <= free_bytes(on) / 2


def chunk_size(sweep: Sweep, on: Placement, on_device: bool) -> int:
    """Items per chunk, a multiple of the devices' count: all of them where :data:`FRACTION` of
    the devices' free memory (less the results, where they stay there) holds them; else as
    many as :data:`DEPTH` chunks at once leave room for, in chunks of equal size."""
    working, results = item_bytes(sweep)
    budget = FRACTION * free_bytes(on) - (sweep.size * results if on_device else 0)
    chunks = 1 if sweep.size * working <= budget else \
        math.ceil(sweep.size * working * DEPTH / max(budget, 1.0))
    per = math.ceil(sweep.size / chunks)
    return max(on.count, -(-per // on.count) * on.count)


class Devices(InProcess):
    """The engine of a sweep on ``on``'s devices: each chunk dispatched from the calling thread
    as it is submitted, once fewer than :data:`DEPTH` are in flight. ``width``: the sweep's
    chunk size; ``host``: results copied to the host as they come and returned as NumPy
    arrays, else left where they are."""

    def __init__(self, on: Placement, shared: dict, bar, width: int, host: bool):
        super().__init__(bar)
        self.on, self.host = on, host
        self.width = -(-width // on.count) * on.count
        self.shared = {name: on.replicate(value) for name, value in shared.items()}
        self.flying: deque = deque()  # the results of the chunks in flight, oldest first

    def _submit(self, sweep, chunk: tuple[int, int], steps: int):
        while len(self.flying) >= DEPTH:
            jax.block_until_ready(self.flying.popleft())
        return Here().submit(self._dispatch, sweep, chunk, steps)

    def _dispatch(self, sweep, chunk: tuple[int, int], steps: int) -> tuple[Done, int, frozenset]:
        start, stop = chunk
        count = stop - start
        values = self.on.put(sweep.items(start, stop), count, self.on.padded(count, self.width))
        graph = kept_chunk_graph(sweep)
        done = self._run(chunk, steps, graph, graph.values(sweep, values))
        if done.computed is not None:
            self.flying.append(done.computed)
            if self.host:
                to_host(done.computed)
        return done, count, sweep.carrying

    def result(self, future) -> Done:
        """The chunk's :class:`~daskdag.sweeps.engines.Done`, its padding dropped."""
        done, count, carrying = future.result()
        if done.computed is None:
            return done

        def trim(a):  # an array leaf with the item axis
            if not is_array(a):
                return a
            return np.asarray(a)[:count] if self.host else a[:count] if len(a) != count else a

        def whole(a):  # the same for every item
            return np.asarray(a) if self.host and is_array(a) else a

        computed = {o: (jax.tree.map(trim if o in carrying else whole, value),
                        jax.tree.map(trim, grads)) for o, (value, grads) in done.computed.items()}
        return Done(computed, done.failed, done.seconds)

    def close(self):
        self.stop.set()
        self.flying.clear()


def to_host(tree) -> None:
    """Start copying the jax.Array leaves of ``tree`` to the host, while the devices go on."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            leaf.copy_to_host_async()
