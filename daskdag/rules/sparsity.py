"""The sparsity pattern of a JAX function's Jacobian, read off its jaxpr: per active argument, a
boolean ``(n_out, n_arg)`` CSR array over differentiable leaves (flattened C-order), True where
an output element may depend on an argument element. It must be sound: a superset of the
nonzeros at any point.

The jaxpr, traced on abstract arguments, is interpreted carrying per variable a boolean matrix
``D`` (a row per element, a column per input element) and, for variables that depend on no
argument, the value. Rules, exact only where they see structure: elementwise ops take the union
of the operands' rows; data movement runs the primitive on each element's number to see what it
copies; reductions, cumulative ops and ``dot_general`` map elements by index arithmetic; calls
interpret their sub-jaxpr. Anything else (control flow, sort, an index that depends on the
arguments) gives every output element the union of all its operands' rows. Integer and boolean
values carry no derivative.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from daskdag.model.leaves import dtype_is, is_differentiable, is_numeric, trace

if TYPE_CHECKING:
    import scipy.sparse as sp

#: Above this many (output, lhs, rhs) triples, dot_general takes the sound fallback.
MAX_TRIPLES = 2**25


def _size(aval) -> int:
    return prod(aval.shape)


def _empty(rows: int, n: int) -> sp.csr_array:
    import scipy.sparse as sp
    return sp.csr_array((rows, n), dtype=bool)


def _csr(rows, cols, shape) -> sp.csr_array:
    import scipy.sparse as sp
    return sp.csr_array((np.ones(len(rows), bool), (rows, cols)), shape=shape)


# Rules: rule(eqn, ops, n) -> one D per output; ops: per operand (D, value or None).

def _fallback(eqn, ops, n):
    """Every output element depends on all that any operand depends on."""
    cols = np.unique(np.concatenate([d.indices for d, _ in ops] + [np.zeros(0, np.int32)]))
    return [_csr(np.repeat(np.arange(_size(v.aval)), len(cols)), np.tile(cols, _size(v.aval)),
                 (_size(v.aval), n)) for v in eqn.outvars]


def _elementwise(eqn, ops, n):
    """Element i of the output from element i of each operand, broadcast NumPy-style."""
    import scipy.sparse as sp
    shape = eqn.outvars[0].aval.shape
    out = _empty(prod(shape), n)
    for (d, _), var in zip(ops, eqn.invars):
        if var.aval.shape != shape:
            try:
                d = d[np.broadcast_to(np.arange(d.shape[0]).reshape(var.aval.shape), shape).ravel()]
            except ValueError:
                return _fallback(eqn, ops, n)
        out = out + d
    return [sp.csr_array(out)] * len(eqn.outvars)


#: Data movement: per primitive, which operands are data (None: all); the others are indices.
MOVES: dict[str, tuple[int, ...] | None]
MOVES = {"broadcast_in_dim": (0,), "reshape": (0,), "transpose": (0,), "squeeze": (0,),
         "expand_dims": (0,), "rev": (0,), "slice": (0,), "dynamic_slice": (0,),
         "gather": (0,), "concatenate": None, "pad": (0, 1), "dynamic_update_slice": (0, 1),
         "split": (0,), "tile": (0,)}


def _moves(eqn, ops, n):
    """The primitive run on each data element's number (1 + its place among all data
    operands' elements): each output element says which one it copies (0: none)."""
    import scipy.sparse as sp
    data: Sequence[int] | None = MOVES[eqn.primitive.name]
    data = range(len(ops)) if data is None else data
    args, offset = [], 0
    for i, ((d, value), var) in enumerate(zip(ops, eqn.invars)):
        if i in data:
            number = np.arange(d.shape[0], dtype=np.int32) + offset + 1
            args.append(number.reshape(var.aval.shape))
            offset += d.shape[0]
        elif value is None:                   # an index that depends on the arguments
            return _fallback(eqn, ops, n)
        else:
            args.append(value)
    params = dict(eqn.params)
    if "fill_value" in params:
        params["fill_value"] = 0
    if offset >= np.iinfo(np.int32).max:
        return _fallback(eqn, ops, n)
    outs = eqn.primitive.bind(*args, **params)
    outs = outs if eqn.primitive.multiple_results else [outs]
    stacked = sp.vstack([ops[i][0] for i in data], format="csr")
    result = []
    for out in outs:
        source = np.asarray(out).ravel().astype(np.intp)
        rows = np.flatnonzero(source)
        result.append(_csr(rows, source[rows] - 1, (len(source), offset)) @ stacked)
    return result


def _reduce(eqn, ops, n):
    shape, axes = eqn.invars[0].aval.shape, eqn.params["axes"]
    kept = tuple(1 if a in axes else s for a, s in enumerate(shape))
    target = np.broadcast_to(np.arange(prod(kept)).reshape(kept), shape).ravel()
    (d, _), = ops
    return [_csr(target, np.arange(len(target)), (prod(kept), len(target))) @ d]


def _cumulative(eqn, ops, n):
    import scipy.sparse as sp
    shape, axis = eqn.invars[0].aval.shape, eqn.params["axis"]
    m = shape[axis]
    rows, cols = np.triu_indices(m) if eqn.params["reverse"] else np.tril_indices(m)
    along = _csr(rows, cols, (m, m))
    before = sp.eye_array(prod(shape[:axis]), dtype=bool)
    after = sp.eye_array(prod(shape[axis + 1:]), dtype=bool)
    (d, _), = ops
    return [sp.csr_array(sp.kron(sp.kron(before, along), after)) @ d]


def _may_be_nonzero(d, value) -> np.ndarray:
    """Per element: it depends on an argument, or is a nonzero constant."""
    if value is None:
        return np.ones(d.shape[0], bool)
    return (np.diff(d.indptr) > 0) | (np.asarray(value).ravel() != 0)


def _dot_general(eqn, ops, n):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ls, rs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    lf = [a for a in range(len(ls)) if a not in lc and a not in lb]
    rf = [a for a in range(len(rs)) if a not in rc and a not in rb]
    out_size, k = _size(eqn.outvars[0].aval), prod(ls[a] for a in lc)
    if out_size * k > MAX_TRIPLES or max(prod(ls), prod(rs)) >= 2**31:
        return _fallback(eqn, ops, n)
    # Axes of the enumeration: batch, lhs free, rhs free, contracted.
    nb, nl, nr, nk = len(lb), len(lf), len(rf), len(lc)
    lhs = np.arange(prod(ls), dtype=np.int32).reshape(ls).transpose([*lb, *lf, *lc])
    lhs = lhs.reshape(lhs.shape[:nb + nl] + (1,) * nr + lhs.shape[nb + nl:])
    rhs = np.arange(prod(rs), dtype=np.int32).reshape(rs).transpose([*rb, *rf, *rc])
    rhs = rhs.reshape(rhs.shape[:nb] + (1,) * nl + rhs.shape[nb:])
    out = np.arange(out_size, dtype=np.int32).reshape(eqn.outvars[0].aval.shape + (1,) * nk)
    out, lhs, rhs = (a.ravel() for a in np.broadcast_arrays(out, lhs, rhs))
    (dl, vl), (dr, vr) = ops
    result = _empty(out_size, n)
    if dl.nnz:                                # lhs element: where its rhs partner may be nonzero
        keep = _may_be_nonzero(dr, vr)[rhs]
        result = result + _csr(out[keep], lhs[keep], (out_size, dl.shape[0])) @ dl
    if dr.nnz:
        keep = _may_be_nonzero(dl, vl)[lhs]
        result = result + _csr(out[keep], rhs[keep], (out_size, dr.shape[0])) @ dr
    return [result]


ELEMENTWISE = """add sub mul div neg sin cos tan tanh exp exp2 log log1p expm1 logistic sqrt
    rsqrt cbrt pow integer_pow square abs sign max min select_n convert_element_type erf erfc
    erf_inv atan2 asin acos atan sinh cosh asinh acosh atanh real imag conj complex clamp
    nextafter rem floor ceil round is_finite stop_gradient copy copy_p reduce_precision lgamma
    digamma igamma igammac polygamma zeta bessel_i0e bessel_i1e""".split()

RULES = {name: _elementwise for name in ELEMENTWISE}
RULES.update({name: _moves for name in MOVES})
RULES.update({name: _reduce for name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")})
RULES.update({name: _cumulative
              for name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")})
RULES["dot_general"] = _dot_general

#: Calls: their sub-jaxpr (under one of SUBJAXPRS) takes the operands and gives the outputs.
CALLS = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
         "custom_vjp_call_jaxpr", "checkpoint", "remat", "remat2", "custom_lin"}
SUBJAXPRS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _call(eqn, ops, n):
    """Per output (D, value) from the sub-jaxpr, or None where there is none to interpret."""
    for key in SUBJAXPRS:
        sub = eqn.params.get(key)
        if isinstance(sub, jcore.ClosedJaxpr):
            jaxpr, consts = sub.jaxpr, sub.consts
        elif isinstance(sub, jcore.Jaxpr) and not sub.constvars:
            jaxpr, consts = sub, []
        else:
            continue
        if len(jaxpr.invars) == len(ops) and len(jaxpr.outvars) == len(eqn.outvars):
            return _interpret(jaxpr, consts, ops, n)
    return None


def _evaluate(eqn, values):
    """The outputs' values when every operand's is known and it has no effects, else None each."""
    if eqn.effects or any(v is None for v in values):
        return [None] * len(eqn.outvars)
    try:
        outs = eqn.primitive.bind(*values, **eqn.params)
    except Exception:                         # e.g. a call primitive that wants its function
        return [None] * len(eqn.outvars)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _equation(eqn, ops, n):
    results = _call(eqn, ops, n) if eqn.primitive.name in CALLS else None
    if results is None:
        values = _evaluate(eqn, [value for _, value in ops])
        if all(d.nnz == 0 for d, _ in ops):
            ds = [_empty(_size(v.aval), n) for v in eqn.outvars]
        else:
            try:
                ds = RULES.get(eqn.primitive.name, _fallback)(eqn, ops, n)
            except Exception:                 # a rule that could not apply: the sound one
                ds = _fallback(eqn, ops, n)
        results = list(zip(ds, values))
    return [(d if dtype_is(v.aval.dtype, jnp.inexact) else _empty(_size(v.aval), n), value)
            for v, (d, value) in zip(eqn.outvars, results)]


def _interpret(jaxpr, consts, ins, n):
    env: dict[Any, Any] = {}

    def read(v: Any):
        if isinstance(v, jcore.Literal):
            value = np.asarray(v.val, dtype=v.aval.dtype)  # type: ignore[attr-defined]
            return _empty(_size(v.aval), n), value
        return env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = (_empty(_size(v.aval), n), c)
    env.update(zip(jaxpr.invars, ins))
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, _equation(eqn, [read(v) for v in eqn.invars], n)))
    return [read(v) for v in jaxpr.outvars]


def _abstract(leaf):
    """A numeric leaf's shape and dtype, a Python number's weakly typed, as JAX traces it."""
    weak = isinstance(leaf, (int, float, complex)) and not isinstance(leaf, bool)
    return jax.ShapeDtypeStruct(np.shape(leaf), jnp.result_type(leaf), weak_type=weak)


def differentiable(leaf) -> bool:
    """A differentiable leaf (:func:`~daskdag.model.leaves.is_differentiable`), or its shapes."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return dtype_is(leaf.dtype, jnp.inexact)
    return is_differentiable(leaf)


def jaxpr_pattern(fn, args: Sequence[Any],
                  active: Sequence[bool]) -> list[sp.csr_array | None] | None:
    """Per argument, the pattern of ``fn``'s Jacobian in it (None where not ``active``); None
    when ``fn`` cannot be traced with abstract arguments."""
    import scipy.sparse as sp
    abstract = [jax.tree.map(lambda leaf: _abstract(leaf) if is_numeric(leaf) else leaf, a)
                for a in args]  # (other leaves are static)
    _, traced = trace(fn, abstract, jaxpr=True)
    if traced is None:
        return None
    closed, invars = traced.jaxpr, traced.jaxpr.jaxpr.invars
    sizes = [_size(v.aval) for v in invars]
    moving = [active[i] and dtype_is(v.aval.dtype, jnp.inexact)
              for i, v in zip(traced.deps, invars)]
    starts = np.cumsum([0, *(s * m for s, m in zip(sizes, moving))]).tolist()
    n, widths = starts[-1], [0] * len(args)  # (each argument's columns, in turn)
    for i, s, m in zip(traced.deps, sizes, moving):
        widths[i] += s * m
    ins = [(sp.eye_array(s, n, k=k, dtype=bool, format="csr") if m else _empty(s, n), None)
           for s, m, k in zip(sizes, moving, starts)]
    outs = _interpret(closed.jaxpr, closed.consts, ins, n)
    rows = [d for v, (d, _) in zip(closed.jaxpr.outvars, outs)
            if dtype_is(v.aval.dtype, jnp.inexact)]
    total = sp.csr_array(sp.vstack(rows, format="csr")) if rows else _empty(0, n)
    bounds = np.cumsum([0, *widths]).tolist()
    return [sp.csr_array(total[:, a:b], dtype=bool) if on else None
            for on, a, b in zip(active, bounds, bounds[1:])]
