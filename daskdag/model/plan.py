"""What one call needs (a :class:`Plan` of a spec, its outputs and ``wrt``): which nodes run,
which run under ``jax.vjp``, which feed each gradient; :func:`ship` packs its functions to travel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from daskdag.model import devices
from daskdag.model.spec import Spec
from daskdag.transport.packing import Function
from daskdag.transport.transports import Transport


@dataclass(frozen=True)
class Plan:
    spec: Spec
    outputs: tuple[str, ...]
    wrt: tuple[str, ...]  # inputs and nodes whose gradients are asked for
    needed: tuple[str, ...]  # nodes some output needs, in topological order
    active: frozenset[str]  # needed nodes that depend on a wrt input: these run under jax.vjp
    backward: dict[str, tuple[str, ...]]  # output -> active nodes on a path to it, topological

    def consumers(self, name: str, output: str) -> list[tuple[str, int]]:
        """(node, position) of each use of ``name`` on a path to ``output``."""
        on_path = self._on_path[output]
        return [(c, i) for c, i in self.spec.uses.get(name, ()) if c in on_path]

    def cut(self, first) -> tuple[Spec, tuple[str, ...], Spec]:
        """The plan cut in two: ``(part, taken, rest)``: the spec of the needed nodes ``first``
        (which take nothing from the others), those of them the others take, and the spec of
        the others, which take the values of ``taken`` as inputs."""
        chosen = set(first)
        first = [n for n in self.needed if n in chosen]
        others = [n for n in self.needed if n not in chosen]
        taken = tuple(n for n in first if any(c in others for c, _ in self.spec.uses.get(n, ())))
        return self.spec.part(first), taken, self.spec.part(others)

    def bare(self) -> Plan:
        """The plan over its spec without functions (:meth:`~daskdag.model.spec.Spec.bare`)."""
        return replace(self, spec=self.spec.bare())

    @cached_property
    def _on_path(self) -> dict[str, frozenset[str]]:
        return {o: frozenset(nodes) for o, nodes in self.backward.items()}


def make_plan(spec: Spec, outputs: tuple[str, ...], wrt: tuple[str, ...]) -> Plan:
    """``wrt`` may name nodes as well as inputs (a node's gradient is its cotangent); such a
    node runs even where no output needs it."""
    needed_set = spec.ancestors((*outputs, *(w for w in wrt if w in spec.nodes)))
    needed = tuple(n for n in spec.order if n in needed_set)
    active: set[str] = set()
    for n in needed:  # topological, so every dep is settled before its consumer
        if any(d in wrt or d in active for d in spec.nodes[n].deps):
            active.add(n)
    backward = {}
    for o in outputs:
        on_path = spec.ancestors([o])
        backward[o] = tuple(n for n in needed if n in active and n in on_path)
    return Plan(spec, outputs, wrt, needed, frozenset(active), backward)


def ship(plan, transport: Transport, prints: dict | None = None):
    """``plan`` with the function of every node it runs packed where ``transport`` packs it,
    each distinct function, and each array they share, once (by id: they live through the
    call). ``prints``: fingerprints already taken in this call, by id (added to). Where
    ``transport`` runs the plan here, a node on a device this process lacks is refused."""
    if not transport.packs:
        devices.check({n: plan.spec.nodes[n] for n in plan.needed})
    packed: dict[int, object] = {}
    tokens: dict[int, str] = {}
    prints = {} if prints is None else prints
    nodes = dict(plan.spec.nodes)
    for n in plan.needed:
        fn = nodes[n].fn
        if not transport.packs_function(nodes[n].jit) or isinstance(fn, Function):
            continue  # (a function packed already, for this transport, is as it was then)
        if id(fn) not in packed:
            packed[id(fn)] = transport.pack_function(f"node {n!r}: its function", fn, tokens,
                                                     prints)
        nodes[n] = replace(nodes[n], fn=packed[id(fn)])
    return replace(plan, spec=replace(plan.spec, nodes=nodes))
