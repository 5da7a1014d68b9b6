"""Forward mode as values: a node lifted to ``(x, dx) -> (f(x), J(x) dx)`` on :class:`Pair`
values, the tangent pushed by the node's rule (:func:`daskdag.rules.jvp.jvp_rule`). Every
call that pushes tangents (JVPs, a Jacobian's columns, Hessian-vector products) runs its DAG
lifted, a DAG like any other; a reverse pass over it gives Hessian-vector products. A node named
in ``wrt`` takes one more dep, the tangent added at its value.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp

from daskdag.caches import Cache
from daskdag.errors import DAGError
from daskdag.model.leaves import differentiable_leaves, zeros, zeros_like
from daskdag.model.spec import Node, Spec
from daskdag.rules.jvp import directions as in_directions
from daskdag.rules.jvp import jvp_rule
from daskdag.rules.vjp import seed
from daskdag.transport.packing import current
from daskdag.transport.protocol import travels, tree_size


@travels(tree_size)
@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Pair:
    """A lifted value: the ``primal`` and its ``tangent``, flat over its differentiable leaves
    (each with a leading axis of directions where the call pushes several)."""

    primal: Any
    tangent: tuple


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class OnTangent:
    """An output's cotangent ``ct`` (None: 1 for a real scalar), seeded on its tangent alone.
    Never None itself, so no stage takes it for a plain scalar's seed of 1."""

    ct: Any = None


@seed.register
def _(value: Pair, output: str, ct: OnTangent, batched: bool = False) -> tuple:
    on_primal = tuple(zeros_like(leaf) for leaf in differentiable_leaves(value.primal))
    return on_primal + seed(value.primal, output, ct.ct, batched)


class Lift:
    """A node's function lifted: called with its deps' values, a :class:`Pair` where ``active``,
    and last, where ``added``, the tangent added at its value. ``directions``: tangents carry a
    leading axis of directions, pushed together, at most ``chunk`` at a time."""

    def __init__(self, node: Node, active: tuple[bool, ...], directions: bool = False,
                 chunk: int | None = None, added: bool = False):
        self.node, self.active, self.directions = node, active, directions
        self.chunk, self.added = chunk, added

    def __call__(self, *args) -> Pair:
        args, extra = (args[:-1], args[-1]) if self.added else (args, None)
        on = tuple(a and isinstance(d, Pair) for a, d in zip(self.active, args))
        primals = [d.primal if o else d for d, o in zip(args, on)]
        if not any(on):
            primal, tangent = self.node.callable()(*primals), None
        else:
            tangents = [d.tangent if o else None for d, o in zip(args, on)]
            rule = jvp_rule(self.node)
            if not self.directions:
                primal, tangent = rule(primals, tangents, on)
            else:
                count = next(len(t[0]) for t in tangents if t)
                primal, tangent = in_directions(rule, primals, tangents, on, count, self.chunk)
        if extra:
            _check_added(primal, extra, self.directions)
            tangent = extra if tangent is None else tuple(a + b for a, b in zip(tangent, extra))
        if tangent is None:  # (nothing reaches it but a tangent not given: zeros)
            tangent = zeros(primal, len(extra[0]) if extra and self.directions else None)
        return Pair(primal, tuple(tangent))

    def __reduce__(self):
        return Lift, (self.node, self.active, self.directions, self.chunk, self.added)

    def _key(self) -> tuple:
        return (current(self.node.fn), self.node.jit, self.node.vmap, self.node.remat,
                self.active, self.directions, self.chunk, self.added)

    def __eq__(self, other: object) -> bool:  # (so that jax.jit compiles equal lifts once)
        return type(other) is Lift and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _check_added(primal: Any, added: tuple, directions: bool) -> None:
    """Refuse a tangent given for a node not shaped like its value's differentiable leaves."""
    want = [tuple(jnp.shape(leaf)) for leaf in differentiable_leaves(primal)]
    got = [tuple(jnp.shape(t))[1 if directions else 0:] for t in added]
    if want != got:
        raise DAGError(f"the tangent given for this node has leaves shaped {got}, but its "
                       f"value's floating-point leaves are shaped {want}"
                       + (" (with batched=True, after the directions' axis)" if directions
                          else ""))


# a lift -> the first equal one made, so that caches keyed by a function's identity hit
_lifts: Cache = Cache("lifted node functions", 1024)


def lift(spec: Spec, moving: set[str], added: dict[str, str], directions: bool = False,
         chunk: int | None = None) -> Spec:
    """``spec`` with every node a tangent reaches lifted, keeping its options: those that take
    a name in ``moving`` (inputs carrying tangents) or a lifted node, and those in ``added``
    (``{node: the input holding the tangent added at its value}``, its last dep)."""
    lifted: set[str] = set(moving)
    nodes = {}
    for n in spec.order:
        node = spec.nodes[n]
        active = tuple(d in lifted for d in node.deps)
        if any(active) or n in added:
            deps = (*node.deps, added[n]) if n in added else tuple(node.deps)
            fn = Lift(node, active, directions, chunk, n in added)
            node = replace(node, fn=_lifts.setdefault(fn, lambda: fn), deps=deps)
            lifted.add(n)
        nodes[n] = node
    return Spec.of({n: nodes[n] for n in spec.nodes}, spec.order)
