"""The rules of a node outside JAX (:class:`~daskdag.model.spec.Custom`: ``vjp=``,
``fwd=``/``bwd=``, ``jvp=``), run on NumPy values, never tracers. A cotangent handed to the
user's rule has the output's structure, ``None`` at leaves held constant; what the rule returns
is checked (one cotangent per dep, shaped like it; ``None``: zeros), else an error naming the
dep and what was expected."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from daskdag.model.leaves import is_differentiable, is_numeric, on_differentiable
from daskdag.model.spec import Custom, as_numpy
from daskdag.rules.vjp import Pullback, register
from daskdag.transport.packing import pack, unpack, unwrap


def linearize(custom: Custom, node, args: Sequence[Any], active: tuple[bool, ...]):
    """``(out, pullback)``: the node run once, and what its backward pass needs."""
    if not custom.reverse:
        raise TypeError("it has no VJP (it gives jvp= only): give vjp= or fwd=/bwd= to "
                        "differentiate it in reverse mode")
    args = as_numpy(args)
    if custom.fwd is not None:
        out, residuals = _pair(custom.fwd(*args), "fwd", "(value, residuals)")
    else:
        out, residuals = custom.fn(*args), None  # type: ignore[misc]
    return out, CustomPullback(node.fn, tuple(node.deps), active, out, residuals)


def push(custom: Custom, node, args: Sequence[Any], tangents: Sequence[Any],
         active: tuple[bool, ...]):
    """``(out, tangent)`` by the user's ``jvp`` rule: ``tangents`` (per dep a flat tuple, None
    where not ``active``) handed to it in the deps' structures, its tangent checked, flat."""
    if custom.jvp is None:
        raise TypeError("it has no jvp= rule, which forward mode needs: give "
                        "Node(..., jvp=lambda args, tangents: (out, out_tangent))")
    args = as_numpy(tuple(args))
    structured = tuple(on_differentiable(a, t) if on else None
                       for a, t, on in zip(args, as_numpy(tuple(tangents)), active))
    out, tangent = _pair(custom.jvp(args, structured), "jvp", "(value, tangent)")
    return out, flat_leaves("jvp", "the output", out, tangent, kind="tangent")


class CustomPullback(Pullback):
    """The backward half of a :class:`Custom` node at one point: its residuals (``fwd``'s, or
    for ``vjp=`` the output). ``fn``: the node's function as the node holds it (packed)."""

    batching = None  # the user's code takes one cotangent at a time, untraced
    traceable = False

    def __init__(self, fn, deps: tuple[str, ...], active: tuple[bool, ...], out, residuals):
        self.fn, self.deps, self.active = fn, deps, active
        leaves, self.out_def = jax.tree.flatten(out)
        self.mask = tuple(map(is_differentiable, leaves))
        self.residuals = residuals if unwrap(fn).fwd is not None else out

    def __call__(self, ct: tuple, inputs: Sequence[Any], dropped=None) -> tuple:
        custom, inputs = unwrap(self.fn), as_numpy(tuple(inputs))
        it = iter(as_numpy(tuple(ct)))
        ct_tree = self.out_def.unflatten([next(it) if m else None for m in self.mask])
        if custom.fwd is not None:
            given, rule = custom.bwd(self.residuals, ct_tree), "bwd"
        else:
            given, rule = custom.vjp(ct_tree, self.residuals, *inputs), "vjp"
        if not isinstance(given, (tuple, list)) or len(given) != len(self.deps):
            got = (f"a {type(given).__name__} of {len(given)}" if isinstance(given, (tuple, list))
                   else f"a {type(given).__name__}")
            raise ValueError(f"its {rule} returned {got}; expected a tuple of {len(self.deps)} "
                             f"cotangent(s), one per dep {list(self.deps)}" +
                             (" (for one dep, return (ct,))" if len(self.deps) == 1 else ""))
        return tuple(flat_leaves(rule, f"dep {dep!r}", value, c) if on else None
                     for dep, value, c, on in zip(self.deps, inputs, given, self.active))

    def residual_nbytes(self) -> int:
        return sum(int(getattr(a, "nbytes", 0)) for a in jax.tree.leaves(self.residuals))

    def __getstate__(self):  # (residuals travel packed, as inputs do)
        return self.fn, self.deps, self.active, pack((self.out_def, self.mask, self.residuals),
                                                     hashed=False)

    def __setstate__(self, state) -> None:
        self.fn, self.deps, self.active, packed = state
        self.out_def, self.mask, self.residuals = unpack(packed)


def flat_leaves(rule: str, what: str, value, ct, kind: str = "cotangent") -> tuple:
    """The ``kind`` (cotangent, tangent) ``ct`` that ``rule`` gave for ``what`` (``"dep 'A'"``),
    whose value is ``value``, checked and flat over its differentiable leaves (None: zeros)."""
    leaves, treedef = jax.tree.flatten(value)
    if ct is None:
        given = [None] * len(leaves)
    else:
        try:
            given = treedef.flatten_up_to(ct)
        except (ValueError, TypeError) as e:
            raise ValueError(f"its {rule} returned a {kind} for {what} structured "
                             f"{jax.tree.structure(ct)}, expected {treedef} as its value "
                             f"({e})") from None
    out = []
    for k, (leaf, c) in enumerate(zip(leaves, given)):
        if not is_differentiable(leaf):
            continue
        shape, dtype = np.shape(leaf), np.result_type(leaf)
        if c is None:
            out.append(np.zeros(shape, dtype))
            continue
        where = what + (f" (leaf {k})" if len(leaves) > 1 else "")
        if not is_numeric(c):
            raise ValueError(f"its {rule} returned a {type(c).__name__} as the {kind} for "
                             f"{where}, expected an array of shape {tuple(shape)}")
        if np.shape(c) != shape:
            raise ValueError(f"its {rule} returned a {kind} of shape {tuple(np.shape(c))} for "
                             f"{where}, expected {tuple(shape)} as its value")
        if np.iscomplexobj(c) and not np.issubdtype(dtype, np.complexfloating):
            raise ValueError(f"its {rule} returned a complex {kind} for {where}, which is "
                             f"real ({dtype})")
        out.append(np.asarray(c, dtype))
    return tuple(out)


def _pair(result, rule: str, expected: str) -> tuple:
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError(f"its {rule} returned a {type(result).__name__}, expected a pair "
                         f"{expected}")
    return result


register(Custom, linearize=linearize, push=push)
