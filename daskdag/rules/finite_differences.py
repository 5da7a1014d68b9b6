"""Derivatives against central finite differences, the numerics of :mod:`daskdag.checks`: one
node's VJP checked (:func:`check_node`), and what ``check_totals`` shares with it: random
directions, inputs perturbed in each leaf's own dtype, ``<u, J v>`` compared with the VJP's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.errors import node_errors
from daskdag.model import devices
from daskdag.model.leaves import PyTree, differentiable_leaves, is_differentiable, partition
from daskdag.rules.vjp import linearizer

if TYPE_CHECKING:
    from daskdag.model.spec import Node

PROJECTIONS = 2  # random (u, v) pairs per node and dep
ROUNDING = 4.0  # the outputs' rounding allowed for, in machine epsilons (several ops' worth)


def check_node(name: str, node: Node, active: tuple[bool, ...], eps: float | None,
               rtol: float | None, *deps: Any) -> tuple[tuple[float, dict | None], Any]:
    """The check task of node ``name`` at its deps' values, on the node's device:
    ``((largest relative error, failure), the node's value)``. ``failure``: None, or for the
    first failing dep (its worst projection) :class:`~daskdag.GradientCheckError`'s keyword
    arguments less ``node``, ``dep`` and ``others``."""
    with devices.on(node.device, name):
        return _check_node(name, node, active, eps, rtol,
                           *devices.put(deps, node.device, name))


def _check_node(name: str, node: Node, active: tuple[bool, ...], eps: float | None,
                rtol: float | None, *deps: Any) -> tuple[tuple[float, dict | None], Any]:
    inputs = list(deps)
    with node_errors(name, "forward"):
        primal, pullback = linearizer(node)(inputs, active)
    outs = differentiable_leaves(primal)
    leaves = {k: differentiable_leaves(inputs[k]) for k, on in enumerate(active) if on}
    leaves = {k: ls for k, ls in leaves.items() if ls}
    if not outs or not leaves:  # nothing differentiable flows through this node
        return (0.0, None), primal
    machine = max(float(jnp.finfo(dtype_of(leaf)).eps)
                  for leaf in [*outs, *(leaf for ls in leaves.values() for leaf in ls)])
    eps = float(eps) if eps is not None else machine ** (1 / 3)
    rtol = float(rtol) if rtol is not None else 2 * machine ** (1 / 3)
    fn, rng = node.callable(), np.random.default_rng(0)
    f = [wide(o) for o in outs]
    failures: dict
    worst, failures = 0.0, {}
    for _ in range(PROJECTIONS):
        # (u in the outputs' own dtypes, as the VJP gets it; conj as jax.test_util.check_vjp)
        ct = tuple(jnp.asarray(np.conj(u).astype(dtype_of(o)))
                   for u, o in zip(unit(rng, outs), outs))
        u = [np.conj(wide(c)) for c in ct]
        with node_errors(name, "backward"):
            pulled = pullback(ct, inputs)
        noise = ROUNDING * machine / eps * np.sqrt(sum(np.sum(np.abs(a * b) ** 2)
                                                       for a, b in zip(u, f)))
        for k, dep_leaves in leaves.items():
            # (each leaf's elements scaled to its RMS magnitude, so that the step moves each by
            # about eps of its size: a unit vector would drown a large leaf's step in rounding)
            size = np.sqrt(sum(np.size(leaf) for leaf in dep_leaves))
            v = [t * size * magnitude(leaf) for t, leaf in zip(unit(rng, dep_leaves), dep_leaves)]
            plus, minus, v = perturbed(inputs[k], v, eps)
            with node_errors(name, "finite-difference"):
                up, down = (_outputs_like(primal, fn(*inputs[:k], x, *inputs[k + 1:]))
                            for x in (plus, minus))
            jv = [(wide(a) - wide(b)) / (2 * eps) for a, b in zip(up, down)]
            fd = inner(jv, u)
            shares = pulled[k] if pulled[k] is not None else [np.zeros_like(t) for t in v]
            ad = inner(v, [np.conj(wide(s)) for s in shares])
            relative, failure = compare(fd, ad, jv, f, rtol, noise)
            if failure is not None and (k not in failures or relative > failures[k][0]):
                failures[k] = (relative, dict(position=k, eps=eps, **failure))
            worst = max(worst, float(relative))
    return (worst, failures[min(failures)][1] if failures else None), primal


def compare(fd: float, ad: float, jv: list, f: list, rtol: float, noise: float
             ) -> tuple[float, dict | None]:
    """``<u, J v>`` by finite differences (``fd``; ``jv``: ``J v``) against the VJP's (``ad``),
    ``f`` the outputs: ``(error / tolerance * rtol, the failure's fd, ad, error and tolerance,
    or None where it passed)``."""
    n = sum(a.size * (2 if np.iscomplexobj(a) else 1) for a in f)
    scale = max(abs(fd), abs(ad), np.sqrt(sum(np.sum(np.abs(a) ** 2) for a in jv) / n))
    tolerance = rtol * scale + noise
    error = abs(fd - ad)
    relative = error / (tolerance / rtol) if tolerance > 0 else 0.0 if error == 0 else np.inf
    if error <= tolerance:
        return relative, None
    return (np.inf if np.isnan(relative) else relative,  # (NaN fails)
            {"fd": float(fd), "ad": float(ad), "error": float(error),
             "tolerance": float(tolerance)})


def dtype_of(leaf: Any) -> np.dtype:
    """The dtype a leaf is computed in: an array's own; a Python number's as JAX takes it."""
    return np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.dtype(jnp.result_type(leaf))


def wide(a: Any) -> np.ndarray:
    """``a`` as float64 (complex128) NumPy, for sums that add no rounding of their own."""
    a = np.asarray(a)
    return a.astype(np.complex128 if np.iscomplexobj(a) else np.float64)


def unit(rng: np.random.Generator, leaves: Sequence[Any]) -> list[np.ndarray]:
    """Random normal arrays shaped like ``leaves`` (complex where they are), of norm 1 in all."""
    out = []
    for leaf in leaves:
        shape = np.shape(leaf)
        r = rng.standard_normal(shape)
        out.append(r + 1j * rng.standard_normal(shape) if np.iscomplexobj(leaf) else r)
    norm = np.sqrt(sum(np.sum(np.abs(r) ** 2) for r in out))
    return [r / norm for r in out] if norm > 0 else out


def magnitude(leaf: Any) -> float:
    """A leaf's RMS magnitude, the scale of its step; 1 where it is all zeros (or not finite)."""
    a = wide(leaf)
    rms = float(np.sqrt(np.mean(np.abs(a) ** 2))) if a.size else 0.0
    return rms if rms > 0 and np.isfinite(rms) else 1.0


def perturbed(tree: PyTree, v: list[np.ndarray], eps: float) -> tuple[PyTree, PyTree, list]:
    """``tree`` at ``+eps v`` and ``-eps v`` on its differentiable leaves, each in the leaf's own
    dtype and kind; and the step that really happened, ``(plus - minus) / (2 eps)`` (rounding
    included), in float64."""
    (held, diff), combine = partition(tree, is_differentiable)
    plus, minus, happened = [], [], []
    for leaf, direction in zip(diff, v):
        dtype = dtype_of(leaf)
        x, step = np.asarray(leaf, dtype), np.asarray(eps * direction).astype(dtype)
        up, down = x + step, x - step
        happened.append((wide(up) - wide(down)) / (2 * eps))
        plus.append(_like(leaf, up))
        minus.append(_like(leaf, down))
    return combine(held, plus), combine(held, minus), happened


def _like(leaf: Any, a: np.ndarray) -> Any:
    if isinstance(leaf, jax.Array):
        return jnp.asarray(a)
    if isinstance(leaf, np.ndarray):
        return a
    if isinstance(leaf, np.generic):
        return a[()]
    return type(leaf)(a[()])  # a Python float or complex


def _outputs_like(primal: PyTree, out: PyTree) -> list:
    """``out``'s differentiable leaves, checked to be shaped as ``primal``'s."""
    got, want = differentiable_leaves(out), differentiable_leaves(primal)
    if [np.shape(a) for a in got] != [np.shape(a) for a in want]:
        raise ValueError(f"at a perturbed input it returned differentiable leaves shaped "
                         f"{[np.shape(a) for a in got]}, where its linearization returned "
                         f"{[np.shape(a) for a in want]}")
    return got


def inner(a: list, b: list) -> float:
    """``real(sum(conj(a) * b))`` over lists of arrays, as ``jax.test_util``'s inner product."""
    return float(sum(np.real(np.sum(np.conj(x) * y)) for x, y in zip(a, b)))
