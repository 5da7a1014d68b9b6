"""The user's DAG, ``{name: (fn, [deps])}``, ``Node(...)`` or ``Implicit(...)`` entries,
validated into a :class:`Spec`: the nodes, the free inputs (deps that are no node's), an order;
a node outside JAX as a :class:`Custom` function, whose rules :mod:`daskdag.rules.custom` runs.
"""

from __future__ import annotations

import graphlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np
from dask.sizeof import sizeof

import daskdag.config as config
from daskdag.errors import DAGError
from daskdag.model import devices
from daskdag.model.implicit import Implicit
from daskdag.transport.packing import Function, current, pack, unwrap
from daskdag.transport.protocol import token_kept, travels


class Custom:
    """One node's functions: ``fn`` (or ``fwd``) and its rules ``vjp``, ``bwd``, ``jvp``, as
    :class:`Node` documents them. Called, it returns the node's value."""

    def __init__(self, fn: Callable | None = None, vjp: Callable | None = None,
                 fwd: Callable | None = None, bwd: Callable | None = None,
                 jvp: Callable | None = None):
        self.fn, self.vjp, self.fwd, self.bwd, self.jvp = fn, vjp, fwd, bwd, jvp

    @property
    def reverse(self) -> bool:
        """It has a VJP: it can be differentiated in reverse mode."""
        return self.vjp is not None or self.bwd is not None

    def __call__(self, *args: Any) -> Any:
        args = as_numpy(args)
        return self.fn(*args) if self.fn is not None else self.fwd(*args)[0]  # type: ignore[misc]

    def __reduce__(self) -> tuple:
        return Custom, (self.fn, self.vjp, self.fwd, self.bwd, self.jvp)


def as_numpy(tree: Any) -> Any:
    """``tree`` with its JAX array leaves as NumPy arrays (zero-copy on the CPU): what the user's
    own functions get."""
    return jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a, tree)


def is_custom(fn: Any) -> bool:
    """``fn`` (maybe packed) is a :class:`Custom` function."""
    return isinstance(unwrap(fn), Custom)


@travels(lambda node: sizeof(node.fn))
@token_kept(lambda node: all(f is None or isinstance(f, Function) for f in (
    node.fn, node.vjp, node.fwd, node.bwd, node.jvp)))  # (packed: their content is fixed)
@dataclass(frozen=True)
class Node:
    """One node: ``fn(*values of deps)``. A DAG entry ``(fn, deps)`` is ``Node(fn, deps)``.

    Attributes:
        fn: the node's function, called with its deps' values.
        deps: the names of its deps: nodes, or free inputs (any name that is no node's).
        jit: run ``fn`` under ``jax.jit`` (faster for small ops; ``fn`` must then be
            traceable). The default runs it eagerly, so Python control flow on values, prints
            and other side effects work.
        vmap: in sweeps, run the node once per chunk of items as ``jax.jit(jax.vmap(fn))``,
            forward and backward, instead of item by item; ``fn`` must then be traceable, and
            its Python side effects run only when it is traced (once per shapes).
        device: where the node's forward and backward passes run, in the process that runs
            them (this one, or a cluster's worker): a ``jax.Device``, a platform (``'cpu'``,
            ``'gpu'``, ``'tpu'``: its first device), or ``'platform:index'`` (``'cpu:1'``: the
            index-th of ``jax.devices(platform)``). Its inputs and cotangents are put there,
            its eager ops run and its residuals stay there; nodes on different devices never
            share a compiled program. ``None`` (the default): ``dask.config``'s
            ``daskdag.eager-device`` for an eager node (no ``jit=True``), else JAX's default
            device (put there where another node has a device, so that values meet on one).
            On a cluster a GPU or TPU device asks for the worker resource ``GPU`` or ``TPU``
            (``dask worker --resources GPU=1``): the node runs only on such workers. A device
            this process lacks (on a cluster: every worker) is refused before anything runs.
        resources: ``{'NAME': amount}``: Dask resources the node's tasks need on a worker.
        vjp: for a node outside JAX (NumPy, SciPy, a simulator: it then gets NumPy values,
            never tracers): ``vjp(ct, out, *args)``, returning one cotangent per dep. With
            ``vmap=True`` in a sweep, every value has a leading item axis.
        fwd: with ``bwd``, instead of ``vjp``: ``fwd(*args) -> (out, residuals)``.
        bwd: ``bwd(residuals, ct)``, returning one cotangent per dep.
        jvp: for forward mode, ``jvp(args, tangents) -> (out, out_tangent)``.
        remat: keep no residuals between the node's forward and backward tasks: the backward
            task runs the forward pass again (under the node's rule) and pulls the cotangent
            back at once, as ``jax.checkpoint`` does, trading a forward pass for the memory.
            ``None`` (the default): ``dask.config``'s ``daskdag.remat`` (default False) when
            the DAG is parsed. A remat node is a stage (a task) of its own.

    Examples of each kind of node: the guides, "Gradients" and "Nodes outside JAX".
    """

    fn: Callable[..., Any] | None = None
    deps: Sequence[str] = ()
    jit: bool = False
    vmap: bool = False
    device: str | jax.Device | None = None
    resources: Mapping[str, float] | None = None
    vjp: Callable[..., Any] | None = None
    fwd: Callable[..., Any] | None = None
    bwd: Callable[..., Any] | None = None
    jvp: Callable[..., Any] | None = None
    remat: bool | None = None

    @property
    def needs(self) -> dict[str, float]:
        """The Dask resources this node's tasks need on a worker (empty: any worker)."""
        return {**devices.resources(self.device), **(self.resources or {})}

    def callable(self) -> Callable[..., Any]:
        # (jax caches compilations by function: a packed one is jitted as the one object its
        # process keeps for its content)
        return jax.jit(current(self.fn)) if self.jit else unwrap(self.fn)

    def __reduce__(self) -> tuple:
        # (its functions travel packed, whoever pickles it)
        fn = self.fn if isinstance(self.fn, Function) else pack(self.fn, as_function=True)
        rules = (self.vjp, self.fwd, self.bwd, self.jvp)
        return Node, (fn, self.deps, self.jit, self.vmap, self.device, self.resources,
                      *(pack(r, as_function=True) if r is not None else None for r in rules),
                      self.remat)


@dataclass(frozen=True)
class Spec:
    nodes: dict[str, Node]
    inputs: tuple[str, ...]  # free inputs, in order of first appearance
    order: tuple[str, ...]  # node names, each after all its deps
    uses: dict[str, tuple[tuple[str, int], ...]]  # name -> (consumer, position) of each use

    @classmethod
    def of(cls, nodes: dict[str, Node], order: tuple[str, ...]) -> Spec:
        """The spec of ``nodes`` in ``order`` (each after its deps): its inputs are the names
        they take that are no node's."""
        inputs = tuple(dict.fromkeys(d for n in nodes.values() for d in n.deps if d not in nodes))
        return cls(nodes, inputs, order, _uses(nodes, order))

    def bare(self) -> Spec:
        """The spec without its nodes' functions: what a call's results are made with, wherever
        Dask makes them, with nothing of the user's code."""
        return Spec({n: Node(None, node.deps) for n, node in self.nodes.items()}, self.inputs,
                    self.order, self.uses)

    def part(self, names: Iterable[str]) -> Spec:
        """The spec of the nodes ``names`` alone: the names they take from others are its
        inputs."""
        keep = set(names)
        return Spec.of({n: self.nodes[n] for n in self.order if n in keep},
                       tuple(n for n in self.order if n in keep))

    def ancestors(self, names: Iterable[str]) -> set[str]:
        """Nodes and inputs that ``names`` depend on, ``names`` included."""
        seen, stack = set(), list(names)
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(self.nodes[n].deps if n in self.nodes else ())
        return seen


def parse(dag: Mapping, hold: Callable[[Any], Any] | None = None) -> Spec:
    """``dag`` validated as a :class:`Spec`, else a :class:`DAGError` naming the culprit.
    ``hold``: how the spec holds each of the user's functions (a prepared call's: weakly),
    else as they are."""
    if not isinstance(dag, Mapping):
        raise DAGError(f"the DAG must be a dict {{name: (fn, [deps])}}, got {type(dag).__name__}")
    if not dag:
        raise DAGError("the DAG is empty")
    nodes = {name: _node(name, entry, hold) for name, entry in dag.items()}
    if any(node.device is not None for node in nodes.values()):  # (values meet on one device)
        nodes = {name: node if node.device is not None else replace(node, device=devices.DEFAULT)
                 for name, node in nodes.items()}
    try:
        order = tuple(n for n in graphlib.TopologicalSorter(
            {name: node.deps for name, node in nodes.items()}).static_order() if n in nodes)
    except graphlib.CycleError as e:
        cycle = e.args[1]  # [a, b, ..., a], each a dep of the next
        raise DAGError(f"the DAG has a cycle: {' -> '.join(cycle)} (each feeds the next); "
                       f"nodes that depend on each other are solved together when declared "
                       f"as one group: daskdag.coupled({{name: (fn, deps), ...}}, "
                       f"guess={{name: value, ...}})") from None
    return Spec.of(nodes, order)


def _uses(nodes: Mapping[str, Node], order: tuple[str, ...]) -> dict:
    """Each name's uses: ``(consumer, position)`` of each, consumers in ``order``."""
    uses: dict[str, tuple[tuple[str, int], ...]] = {}
    for name in order:
        for i, d in enumerate(nodes[name].deps):
            uses[d] = uses.get(d, ()) + ((name, i),)
    return uses


def _node(name: Any, entry: Any, hold: Callable[[Any], Any] | None = None) -> Node:
    if not isinstance(name, str):
        raise DAGError(f"node names must be strings, got {name!r} ({type(name).__name__})")
    if isinstance(entry, Implicit):
        entry = Node(entry.solve(name, hold), entry.deps, jit=entry.jit, vmap=entry.vmap,
                     device=entry.device, resources=entry.resources, remat=entry.remat)
        hold = None  # (its Solve holds the user's functions as hold says)
    if isinstance(entry, Node):
        fn, deps = _function(name, entry, hold), entry.deps
        opts = {k: getattr(entry, k) for k in ("jit", "vmap", "device", "resources", "remat")}
    elif isinstance(entry, (tuple, list)) and len(entry) == 2:
        (fn, deps), opts = entry, {}
    else:
        raise DAGError(f"node {name!r}: expected (fn, [deps]) or daskdag.Node(fn, deps), "
                       f"got {entry!r}")
    if not callable(fn):
        raise DAGError(f"node {name!r}: fn is not callable: {fn!r}")
    if isinstance(deps, str) or not isinstance(deps, Sequence):
        raise DAGError(f"node {name!r}: deps must be a list of names, got {deps!r}"
                       + (f" (did you mean [{deps!r}]?)" if isinstance(deps, str) else ""))
    for d in deps:
        if not isinstance(d, str):
            raise DAGError(f"node {name!r}: dep {d!r} is not a string")
    device = devices.normalised(opts.get("device"), f"node {name!r}")
    if device is None and not opts.get("jit"):
        device = devices.normalised(config.get("eager-device"),
                                    "the setting daskdag.eager-device")
    resources = opts.get("resources")
    if resources is not None and not (isinstance(resources, Mapping) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and v > 0
            for k, v in resources.items())):
        raise DAGError(f"node {name!r}: resources must be a dict {{'NAME': positive amount}}, "
                       f"got {resources!r}")
    remat = config.get("remat") if opts.get("remat") is None else opts["remat"]
    if not isinstance(remat, bool):
        raise DAGError(f"node {name!r}: remat must be True, False or None (daskdag.remat), "
                       f"got {remat!r}")
    if hold is not None and not isinstance(fn, Custom):
        fn = hold(fn)
    return Node(fn, tuple(deps), **{**opts, "remat": remat, "device": device})


def _function(name: str, node: Node, hold: Callable[[Any], Any] | None = None
              ) -> Callable[..., Any] | None:
    """The node's function: ``fn``, or with the user's own derivatives a checked
    :class:`Custom`."""
    rules = {"vjp": node.vjp, "fwd": node.fwd, "bwd": node.bwd, "jvp": node.jvp}
    if all(r is None for r in rules.values()):
        return node.fn
    for what, r in rules.items():
        if r is not None and not callable(r):
            raise DAGError(f"node {name!r}: {what} is not callable: {r!r}")
    if node.fwd is not None or node.bwd is not None:
        if node.fwd is None or node.bwd is None:
            raise DAGError(f"node {name!r}: give fwd and bwd together (fwd(*args) -> (value, "
                           f"residuals), bwd(residuals, ct) -> one cotangent per dep), or "
                           f"fn with vjp=")
        if node.fn is not None or node.vjp is not None:
            raise DAGError(f"node {name!r}: give either fn (with vjp=) or fwd and bwd, not both")
    elif node.fn is None:
        raise DAGError(f"node {name!r}: vjp= and jvp= need the node's fn")
    if node.jit:
        raise DAGError(f"node {name!r}: jit=True does not apply to a node with its own "
                       f"derivatives: its functions run as plain Python on NumPy values")
    keep = hold or (lambda f: f)
    return Custom(*(None if f is None else keep(f)
                    for f in (node.fn, node.vjp, node.fwd, node.bwd, node.jvp)))
