"""Values kept from one call to the next: the nodes of a prepared call that no gradient passes
through (a trunk over fixed data) run again only when their inputs changed since the call before.

Which nodes may be kept is ``daskdag.reuse``: ``"jit"`` (the default), the ``jit=True`` nodes,
pure by contract; ``"all"``, every node (eager nodes known to be pure); ``"none"``. A node is
kept only with every node it takes values from. What a call's program relies on is checked by
the program itself (:mod:`daskdag.running.programs`: a change makes a new program, which keeps
nothing yet); the inputs are compared here (:class:`Seen`), once a call.

The last call's values are kept, at most ``daskdag.reuse-bytes`` of them; NumPy arrays among
them are made read-only, so that a node changing one in place fails, naming itself, instead of
changing what the next call reuses. A lazy call reuses them likewise, else keeps its own once
computed, wherever Dask finishes it (:meth:`Kept.lazily`).
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
    """``plan`` cut where ``daskdag.reuse`` says: ``(kept, rest)``, ``kept`` computing the
    values of the nodes that may be kept which the others take (its outputs), ``rest`` the plan
    without them, taking those values as inputs; None where there are none. Outputs, nodes in
    ``wrt`` and nodes that read an input in ``moving`` (carrying a call's tangents), directly
    or not, are never kept (an output's gradients flow through its value)."""
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
    """What a call's inputs were, to compare another call's with (``==``): their structure, and
    per leaf a JAX array itself (compared by identity), any other leaf its content's token."""

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
    """A program's nodes whose values are kept between its calls: their ``plan``
    (:func:`kept_part`), computed by :meth:`values` (or not)."""

    def __init__(self, plan: Plan, transport: Transport) -> None:
        self.plan, self.transport = plan, transport
        self._last: tuple[Seen, dict] | None = None
        self._lock = threading.Lock()

    def values(self, inputs: dict, client, local: str | None,
               progress: bool) -> tuple[dict, bool]:
        """The values of the plan's outputs for these ``inputs`` (all of the call's), and
        whether they are the last call's (its inputs the same); else computed now, on
        ``client``'s cluster or Dask's ``local`` scheduler, and kept for the next call."""
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
        """The graph of the plan's outputs' values for these ``inputs``."""
        return build(self.plan, self._mine(inputs), GradientSeeding({}), self.transport,
                     stop=stop)

    def remember(self, inputs: dict, values: dict) -> dict:
        """``values``, computed for ``inputs``, kept for the next call (the module's docstring)."""
        if sizeof(values) > dask.utils.parse_bytes(config.get("reuse-bytes")):
            with self._lock:
                self._last = None
            return values
        values = jax.tree.map(_read_only, values)
        with self._lock:
            self._last = (Seen(self._mine(inputs)), values)
        return values

    def _mine(self, inputs: dict) -> dict:
        return {i: inputs[i] for i in self.plan.spec.inputs}

    def lazily(self, inputs: dict, finish: Callable[[dict], Any]) -> Remembering:
        """``finish`` of a lazy call whose graph computes the kept nodes' values for these
        ``inputs`` (under :data:`KEPT`), keeping them for the next call (:class:`Remembering`)."""
        call = uuid.uuid4().hex
        _pending.put(call, (self, inputs))
        return Remembering(finish, call, os.getpid())


#: Where a lazy call's graph holds the values of the nodes kept between calls, beside its
#: outputs' (no output of a DAG has this name: it is no string).
KEPT = ("kept",)
#: Lazy calls not computed yet, by id: their program's kept nodes and their inputs.
_pending: Cache = Cache("lazy calls' kept nodes, until computed", 64)


class Remembering:
    """A lazy call's ``finish``, which also keeps the values of its program's kept nodes
    (:meth:`Kept.lazily`). Dask runs it where it finishes the collection: in the process that
    made the call, it keeps them at once; elsewhere (a cluster's worker), it returns its result
    inside a :class:`Receipt`, which keeps them as it arrives back here."""

    def __init__(self, finish: Callable[[dict], Any], call: str, pid: int):
        self.finish, self.call, self.pid = finish, call, pid

    def __call__(self, computed: dict) -> Any:
        values = computed.pop(KEPT)[1]
        result = self.finish(computed)
        if os.getpid() == self.pid:
            return received(result, self.call, values)
        return Receipt(result, self.call, values)


class Receipt:
    """A lazy call's result finished in another process, with the values its program keeps:
    unpickled (back in the process that made the call), it is the result, the values kept."""

    def __init__(self, result: Any, call: str, values: dict):
        self.result, self.call, self.values = result, call, values

    def __reduce__(self):
        return received, (self.result, self.call, self.values)


def received(result: Any, call: str, values: dict) -> Any:
    """``result``, the kept nodes' ``values`` given to the program that made lazy call
    ``call``, where it is one of this process's."""
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
