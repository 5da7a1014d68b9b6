"""Values kept from one call to the next: nodes no gradient passes through run again only when
their inputs changed (:class:`Seen`). ``daskdag.reuse``: which nodes may be kept (``"jit"``,
``"all"``, ``"none"``), each only with every node it takes values from. At most
``daskdag.reuse-bytes`` are kept, NumPy arrays made read-only (a node writing one fails).
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any, Callable

import dask
import jax
import numpy as np
from dask.base import tokenize
from dask.sizeof import sizeof

import daskdag.config as config
from daskdag.caches import Cache
from daskdag.cancel import Stop
from daskdag.graph.build import GradientSeeding, build
from daskdag.model.plan import Plan, make_plan
from daskdag.running.compute import compute
from daskdag.transport.transports import Transport

POLICIES = ("jit", "all", "none")


def kept_part(plan: Plan, moving: tuple[str, ...] = ()) -> tuple[Plan, Plan] | None:
    """``(kept, rest)``, ``plan`` cut where ``daskdag.reuse`` says, or None. Outputs, ``wrt``
    nodes, and nodes reading an input in ``moving`` (tangents), directly or not, are not kept."""
    policy = config.get("reuse")
    if policy not in POLICIES:
        raise ValueError(f"daskdag.reuse must be one of {list(POLICIES)}, got {policy!r}")
    if policy == "none":
        return None
    skip = set(plan.outputs) | set(plan.wrt) | plan.active | set(moving)
    kept: list[str] = []
    for n in plan.needed:
        node = plan.spec.nodes[n]
        if any(d in skip for d in node.deps):
            skip.add(n)
        if n not in skip and (policy == "all" or node.jit) and all(
                d in kept or d not in plan.spec.nodes for d in node.deps):
            kept.append(n)
    if not kept:
        return None
    part, taken, rest = plan.cut(kept)
    if not taken:
        return None
    return make_plan(part, taken, ()), make_plan(rest, plan.outputs, plan.wrt)


class Seen:
    """A call's inputs, comparable: JAX arrays by identity, other leaves by token."""

    def __init__(self, values: dict) -> None:
        self.structure = {k: jax.tree.structure(v) for k, v in values.items()}
        self.leaves = [leaf if isinstance(leaf, jax.Array) else tokenize(leaf)
                       for v in values.values() for leaf in jax.tree.leaves(v)]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Seen) and self.structure == other.structure
                and len(self.leaves) == len(other.leaves)
                and all(a is b if isinstance(a, jax.Array) or isinstance(b, jax.Array)
                        else a == b for a, b in zip(self.leaves, other.leaves)))


class Kept:
    """A program's nodes whose values are kept between its calls: their ``plan``."""

    def __init__(self, plan: Plan, transport: Transport) -> None:
        self.plan, self.transport = plan, transport
        self._last: tuple[Seen, dict] | None = None
        self._lock = threading.Lock()

    def values(self, inputs: dict, client, local: str | None,
               progress: bool) -> tuple[dict, bool]:
        """``(values, reused)``: the last call's values for the same ``inputs``, else computed
        now and kept."""
        found = self.last(inputs)
        if found is not None:
            return found, True
        stop = Stop() if client is None else None
        computed = compute(self.graph(inputs, stop), client, progress, stop, local, self.plan)
        return self.remember(inputs, {n: computed[n][0] for n in self.plan.outputs}), False

    def last(self, inputs: dict) -> dict | None:
        """The last call's values, where its inputs were these ``inputs``; else None."""
        with self._lock:
            last = self._last
        return last[1] if last is not None and last[0] == Seen(self._mine(inputs)) else None

    def graph(self, inputs: dict, stop=None) -> dict:
        return build(self.plan, self._mine(inputs), GradientSeeding({}), self.transport, stop=stop)

    def remember(self, inputs: dict, values: dict) -> dict:
        """``values``, computed for ``inputs``, kept for the next call."""
        last = None
        if sizeof(values) <= dask.utils.parse_bytes(config.get("reuse-bytes")):
            values = jax.tree.map(_read_only, values)
            last = (Seen(self._mine(inputs)), values)
        with self._lock:
            self._last = last
        return values

    def _mine(self, inputs: dict) -> dict:
        return {i: inputs[i] for i in self.plan.spec.inputs}

    def lazily(self, inputs: dict, finish: Callable[[dict], Any]) -> Remembering:
        """``finish`` of a lazy call, keeping the values it computes under :data:`KEPT`."""
        call = uuid.uuid4().hex
        _pending.put(call, (self, inputs))
        return Remembering(finish, call, os.getpid())


KEPT = ("kept",)  # where a lazy call's results hold the kept values (no string: no output)
_pending: Cache = Cache("lazy calls' kept nodes, until computed", 64)


class Remembering:
    """A lazy call's ``finish`` that keeps its program's values here, at once or on receipt."""

    def __init__(self, finish: Callable[[dict], Any], call: str, pid: int):
        self.finish, self.call, self.pid = finish, call, pid

    def __call__(self, computed: dict) -> Any:
        values = computed.pop(KEPT)[1]
        result = self.finish(computed)
        if os.getpid() == self.pid:
            return received(result, self.call, values)
        return Receipt(result, self.call, values)


class Receipt:
    """A result finished elsewhere: unpickled here, it is the result, its values kept."""

    def __init__(self, result: Any, call: str, values: dict):
        self.result, self.call, self.values = result, call, values

    def __reduce__(self):
        return received, (self.result, self.call, self.values)


def received(result: Any, call: str, values: dict) -> Any:
    """``result``, the ``values`` kept by the program of lazy call ``call``, if it is here."""
    pending = _pending.pop(call)
    if pending is not None:
        kept, inputs = pending
        kept.remember(inputs, values)
    return result


def _read_only(leaf):
    if isinstance(leaf, np.ndarray) and leaf.flags.writeable:
        leaf = leaf.view()
        leaf.flags.writeable = False
    return leaf
