"""Full Jacobians, as a kind: pulled back row by row (reverse mode) or pushed forward column by
column (forward mode), one pass per colour for a sparse one. The result is laid out from one
matrix over every differentiated name's elements (NumPy, ``scipy.sparse``, or tracers inside a
program) in ``jax.jacrev``'s layout (the output's structure of the inputs' structures), or as
``scipy.sparse`` blocks per name; from a sweep, each item's stacked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.errors import DAGError
from daskdag.graph.sparsity import detect, shapes, size
from daskdag.graph.tasks import Rows
from daskdag.model import colouring
from daskdag.model.colouring import Colours, pattern_key, user_patterns
from daskdag.model.leaves import (UNKNOWN, PyTree, Traced, aval, differentiable_leaves, is_array,
                                  is_differentiable)
from daskdag.model.plan import Plan, make_plan
from daskdag.model.request import (check_chunk_size, nodes_in_wrt, one_input, parsed,
                                   rules_missing, with_rules, wrt_names)
from daskdag.rules.jvp import why_no_jvp
from daskdag.rules.vjp import check_real, function_of, why_no_vjp
from daskdag.running import programs
from daskdag.running.jobs import CallInfo
from daskdag.running.passes import Derivative, Lowered, names_key
from daskdag.kinds.gradients import Result, per_output
from daskdag.kinds.tangents import leading_axis, lifted
from daskdag.rules.lifted import Pair

if TYPE_CHECKING:
    import scipy.sparse as sp

MODES = ("auto", "rev", "fwd")


@dataclass(frozen=True)
class Layout:
    """A Jacobian's ``Lowered.extra``: the user's ``plan``, the ``mode`` taken and why, the
    patterns' ``colours`` and their ``source`` (``"given"``, ``"detected"``, ``"probed"``, or
    None); in forward mode the inputs' ``templates``, the seed ``tangents`` and their number."""

    plan: Plan
    mode: str
    mode_why: str
    colours: Colours
    source: str | None
    templates: dict | None = None
    tangents: dict | None = None
    directions: int = 0

    def bare(self) -> Layout:
        return replace(self, plan=self.plan.bare())


@dataclass(frozen=True)
class Jacobian(Derivative):
    """[`jacobian`][daskdag.jacobian] as a kind; a call has no data beyond its inputs."""

    mode: str = "auto"
    sparsity: Any = None
    sparse: bool = False
    chunk_size: int | None = None
    call = "jacobian"
    sweep_call = "sweep_jacobians"

    def options(self, data: tuple) -> tuple:
        check_chunk_size(self.chunk_size)
        if self.mode not in MODES:
            raise DAGError(f"mode must be one of {MODES}, got {self.mode!r}")
        return self.mode, pattern_key(self.sparsity), self.chunk_size, self.sparse

    def lower(self, spec, outputs, values, data, candidates, watch) -> Lowered:
        plan = make_plan(spec, outputs, wrt_names(spec, values, self.wrt, candidates=candidates))
        patterns, source = None, None
        # (each node's jaxpr, where a pattern traced it)
        traces: dict[str, Traced] | None = None if self.sparsity is None else {}
        if isinstance(self.sparsity, str) and self.sparsity == "detect":
            patterns = detected_patterns(plan, values, watch, traces)
            source = "probed" if watch.refused else "detected"
        elif self.sparsity is not None:
            avals = shapes(plan, values, traces)
            patterns = user_patterns(  # (checked against the elements known before it runs)
                plan, {i: size(values[i]) for i in plan.wrt if i in values},
                {o: size(avals[o]) for o in plan.outputs if avals.get(o, UNKNOWN) is not UNKNOWN},
                self.sparsity, self.outputs)
            source = "given"
        colours = Colours(patterns)
        # "auto" takes its mode from the nodes' traces, so it watches them first.
        if self.mode == "auto":
            for n in plan.needed:
                watch(n, plan.spec.nodes[n].fn)
        mode, mode_why = _mode(plan, values, self.mode, colours, traces)
        plan = with_rules(plan, forward=mode == "fwd")
        if mode == "rev":
            rows = Rows(self.chunk_size, tuple((o, tuple(cs.tolist())) for o, cs in (
                colours.rows.items() if patterns is not None else ())))
            return Lowered(plan, tuple(values), spec, plan.wrt, rows=rows,
                            extra=Layout(plan, mode, mode_why, colours, source),
                            tail=_dense(plan, mode, patterns, self.sparse, ()))
        templates = {i: jax.tree.map(  # (each differentiable leaf's shape and dtype, else None)
            lambda a: aval(a) if is_differentiable(a) else None, values[i]) for i in plan.wrt}
        dtype = jnp.result_type(*jax.tree.leaves(templates))
        seeds = (np.eye(size(templates), dtype=dtype) if patterns is None
                 else colouring.seeds(colours.columns, dtype))
        k = len(seeds)
        tangents = {i: tuple(jax.tree.leaves(t)) for i, t in zip(plan.wrt, stacked_rows(
            seeds, tuple(templates[i] for i in plan.wrt)))}
        lifted_spec, where = lifted(spec, outputs, plan.wrt, True, self.chunk_size)
        flat = (jax.tree.flatten(templates[i], is_leaf=lambda t: t is None) for i in plan.wrt)
        return Lowered(make_plan(lifted_spec, outputs, ()), where.given(values), spec, plan.wrt,
                        where.moving,
                        extra=Layout(plan, mode, mode_why, colours, source, templates, tangents, k),
                        tail=_dense(plan, mode, patterns, self.sparse, tuple(
                            (treedef, tuple(leaves)) for leaves, treedef in flat)))

    def inputs(self, lowered, values, data, batched=None) -> tuple[dict, dict]:
        layout = lowered.extra
        if layout.mode == "rev":
            return values, {}
        out = dict(values)
        for i, ts in (layout.tangents or {}).items():  # (a sweep's: the same for every item)
            out[i] = Pair(values[i], tuple(np.broadcast_to(t, (leading_axis(values[i]) or 0, *t.shape))
                                           for t in ts) if batched and i in batched else ts)
        return out, {}

    def info(self, lowered, data, why, where) -> CallInfo:
        layout = lowered.extra
        return CallInfo(self.call, layout.mode, 0, layout.colours.total, layout.source,
                        why is None, why, where, mode_why=layout.mode_why)

    def finish(self, lowered, info, computed, failed=None) -> Any:
        layout = lowered.extra
        results = _reverse_results if layout.mode == "rev" else _forward_results
        if failed is None and lowered.tail is not None and computed and \
                not isinstance(next(iter(computed.values())), Laid) and \
                all(map(is_array, jax.tree.leaves(computed))):
            computed = _laid(lowered.tail, computed)  # (where the passes' program did not)
        if computed and all(isinstance(c, Laid) for c in computed.values()):
            info = replace(info, passes=layout.directions if layout.mode == "fwd" else
                           sum(size(c.value) for c in computed.values()))
            return per_output(self.outputs, {o: Result(c.value, c.jacobian, {}, info)
                                             for o, c in computed.items()})
        if self.sparse and failed is not None:
            raise DAGError("sparse=True does not apply to a sweep: its Jacobians are stacked "
                           "over the items, in jax.jacrev's layout (give a sparsity pattern to "
                           "compress the passes)", argument="sparse")
        if failed is not None and layout.colours.patterns is not None:
            if any(hasattr(leaf, "dask") for leaf in jax.tree.leaves(computed)):
                raise DAGError("a sweep over dask arrays gives dense Jacobians only: a sparsity "
                               "pattern's colours are recovered item by item, in memory; sweep "
                               "NumPy or JAX items, or give no sparsity", argument="sparsity")
            items = [results(layout, self.sparse, info, jax.tree.map(lambda a, i=i: a[i], computed))
                     for i in range(leading_axis(computed) or 0)]  # (each item's, then stacked)
            return per_output(self.outputs, {o: replace(items[0][o], failed=failed, **{
                f: jax.tree.map(lambda *a: np.stack(a), *(getattr(r[o], f) for r in items))
                for f in ("value", "grad")}) for o in computed})
        unknown = {o: Result(None, None, failed or {}, info)  # (no item gave one, nor a trace)
                   for o, (value, _) in computed.items() if value is None}
        known = results(layout, self.sparse, info, {o: c for o, c in computed.items()
                                                    if o not in unknown}, failed is not None)
        return per_output(self.outputs, {**unknown, **{o: replace(r, failed=failed or {})
                                                       for o, r in known.items()}})


@partial(jax.tree_util.register_dataclass, data_fields=["value", "jacobian"], meta_fields=[])
@dataclass(frozen=True)
class Laid:
    """An output's value and its dense Jacobian laid out, by the call's program (:class:`Dense`)."""

    value: Any
    jacobian: Any


@dataclass(frozen=True)
class Dense:
    """A dense Jacobian's layout as the last step of the call's program (its ``Lowered``'s
    ``tail``): each output's :class:`Laid`. ``names``: the differentiated names; ``single``:
    one free input; ``templates``: in forward mode, each name's row template flattened."""

    mode: str
    names: tuple[str, ...]
    single: bool
    templates: tuple

    def __call__(self, computed: dict) -> dict:
        out = {}
        for o, (value, per_name) in computed.items():
            if self.mode == "rev":
                out[o] = Laid(value, _jacrev(value, {i: per_name[i] for i in self.names},
                                             self.single))
                continue
            templates = {i: treedef.unflatten(rows)
                         for i, (treedef, rows) in zip(self.names, self.templates)}
            value, passes = _pushed(o, value, size(templates), xp=jnp)
            out[o] = Laid(value, laid_out(self.names, self.single, value, passes.T, templates,
                                          False))
        return out


@partial(jax.jit, static_argnums=0)
def _laid(tail: Dense, computed: dict) -> dict:
    return tail(computed)


def _dense(plan: Plan, mode: str, patterns: Any, sparse: bool, templates: tuple
           ) -> Dense | None:
    """The call's :class:`Dense` tail, where its Jacobians are dense (``jax.jacrev``'s layout)."""
    return None if patterns is not None or sparse else Dense(
        mode, plan.wrt, one_input(plan.spec, plan.wrt), templates)


def _per_item(value: PyTree, items: bool) -> int:
    """The elements of one item's differentiable leaves (a sweep's ``value``, ``items``)."""
    return sum(int(np.prod(np.shape(leaf)[1 if items else 0:]))
               for leaf in differentiable_leaves(value))


def _reverse_results(layout: Layout, sparse: bool, info: CallInfo, computed: dict,
                     items: bool = False) -> dict:
    import scipy.sparse as sp
    plan, patterns = layout.plan, layout.colours.patterns
    info = replace(info, passes=info.colours or 0 if patterns is not None else
                   sum(_per_item(value, items) for value, _ in computed.values()))
    results = {}
    single = one_input(plan.spec, plan.wrt)
    for o, (value, per_name) in computed.items():
        if patterns is None and not sparse:
            results[o] = Result(value, _jacrev(value, per_name, single, items), info=info)
            continue
        flat = np.hstack([flat_rows(per_name[i]) for i in plan.wrt])
        full = (sp.csr_array(flat) if patterns is None else
                colouring.from_passes(patterns[o], layout.colours.rows[o], flat, False,
                                      dense=not sparse))
        templates = {i: row_template(r) for i, r in per_name.items()}
        results[o] = Result(value, laid_out(plan.wrt, single, value, full, templates, sparse),
                            info=info)
    return results


def _forward_results(layout: Layout, sparse: bool, info: CallInfo, computed: dict,
                     items: bool = False) -> dict:
    plan, patterns, k = layout.plan, layout.colours.patterns, layout.directions
    info = replace(info, passes=k)
    results = {}
    single = one_input(plan.spec, plan.wrt)
    for o, (lifted_value, _) in computed.items():
        value, passes = _pushed(o, lifted_value, k, items)
        if patterns is None:
            full = passes.swapaxes(-1, -2)
        else:
            colouring.check_rows(o, patterns[o].shape[0], passes.shape[1])
            full = colouring.from_passes(patterns[o], layout.colours.columns, passes, True,
                                         dense=not sparse)
        results[o] = Result(value, laid_out(plan.wrt, single, value, full,
                                            layout.templates or {}, sparse, items), info=info)
    return results


def _pushed(output: str, lifted: Any, k: int, items: bool = False, xp: Any = None
            ) -> tuple[PyTree, Any]:
    """An output's value and its ``k`` forward passes, ``(*items, k, its elements)``, from its
    lifted value (zeros where no tangent reached it: it reads no input, or has no float leaf).
    ``xp``: the arrays' module (default: JAX for a sweep's JAX arrays, which stay on the devices
    that computed them; else NumPy)."""
    value = getattr(lifted, "primal", lifted)
    leaves = check_real(output, value)
    lead = tuple(np.shape(jax.tree.leaves(value)[0])[:1]) if items else ()
    pushed = [leaf.reshape(*lead, k, int(np.prod(np.shape(leaf)[len(lead) + 1:])))
              for leaf in getattr(lifted, "tangent", ())]
    if xp is None:
        xp = jnp if items and pushed and all(isinstance(p, jax.Array) for p in pushed) else np
    return value, (xp.concatenate(pushed, axis=-1) if pushed else  # (in the leaves' dtype)
                   xp.zeros((*lead, k, _per_item(value, items)),
                            jnp.result_type(*leaves) if leaves else jnp.float32))


def _jacrev(value: PyTree, per_name: dict, single: bool, items: bool = False) -> PyTree:
    """One output's dense Jacobian from each name's rows, in ``jax.jacrev``'s layout
    (:func:`jacrev_layout`, :func:`joined`)."""
    return joined(value, {i: jacrev_layout(value, r, items) for i, r in per_name.items()}, single)


# -- sparsity patterns ---------------------------------------------------------------------------

def jacobian_patterns(dag, x, outputs, wrt) -> tuple[Plan, dict]:
    """The plan and detected patterns of [`jacobian_sparsity`][daskdag.jacobian_sparsity],
    compiled once per DAG and shapes."""
    program, _ = programs.compile("sparsity", dag, x, (names_key(outputs), names_key(wrt)),
                                  lambda watch: _detected(dag, x, outputs, wrt, watch))
    return program.value


def _detected(dag, x, outputs, wrt, watch: programs.Watch) -> tuple[Plan, dict]:
    spec, names, values = parsed(dag, x, outputs, watch.hold)
    plan = make_plan(spec, names, wrt_names(spec, values, wrt, candidates=values))
    return plan, detected_patterns(plan, values, watch)


def detected_patterns(plan: Plan, values: dict, watch: programs.Watch,
                      traces: dict[str, Traced] | None = None) -> dict[str, sp.csr_array]:
    """The plan's patterns, detected after watching every function they are read from."""
    for n in plan.needed:
        watch(n, plan.spec.nodes[n].fn)
    probed: list[str] = []
    found = detect(plan, values, probed, traces)
    if probed:
        watch.refuse(f"node(s) {probed}: their sparsity patterns were probed at this point (they "
                     f"could not be read off a jaxpr), so they are detected again at each call")
    return found


# -- the mode ------------------------------------------------------------------------------------

def _mode(plan: Plan, values: dict, mode: str, colours: Colours,
          traces: dict[str, Traced] | None) -> tuple[str, str]:
    """The mode and why: the one asked for, or for ``"auto"`` the one with fewer passes
    (forward on a tie) unless some node cannot take it; a :class:`DAGError` where no mode can
    serve the call. ``traces``: the nodes' jaxprs where an earlier step traced them, or None."""
    wrt_nodes = nodes_in_wrt(plan.spec, plan.wrt, "forward mode differentiates")
    avals = None
    if traces is None:  # ("auto" traces every node, as it counts elements; see _explicitly)
        traces = {}
        avals = shapes(plan, values, traces, only=None if mode == "auto" else _explicitly(plan))
    found: dict[tuple[str, bool], list[str]] = {}

    def why_not(m: str, traced: bool = True) -> list[str]:
        """What keeps mode ``m`` from the call (without ``traced``, what costs no trace)."""
        if (m, traced) not in found:
            found[m, traced] = ([wrt_nodes] if m == "fwd" and wrt_nodes else []) + _cannot(
                plan, traces if traced else {}, forward=m == "fwd")
        return found[m, traced]

    if mode != "auto":
        if why_not(mode):
            raise DAGError(f"mode={mode!r} cannot serve this call: " + "; ".join(why_not(mode)))
        return mode, f"mode={mode!r} was asked for"
    closed = {m: why_not(m, traced=False) for m in ("fwd", "rev")}
    order = [m for m in ("fwd", "rev") if not closed[m]]
    because = ""
    if len(order) == 2:  # (both open to the call: the one with fewer passes first)
        preferred, because = _preferred(plan, values, colours, avals)
        order = [preferred, "rev" if preferred == "fwd" else "fwd"]
    taken = next((m for m in order if not why_not(m)), None)
    if taken is None:
        raise DAGError("no mode can serve this call: forward mode (mode='fwd'): "
                       + "; ".join(why_not("fwd")) + "; reverse mode (mode='rev'): "
                       + "; ".join(why_not("rev")))
    other = "rev" if taken == "fwd" else "fwd"
    against = closed[other] or (why_not(other) if taken != order[0] else [])
    if against:
        because = ("the only mode that can serve this call: "
                   f"{'forward' if other == 'fwd' else 'reverse'} mode cannot: "
                   + "; ".join(against))
    if colours.patterns is not None:
        colours.used = "columns" if taken == "fwd" else "rows"
    return taken, because


def _preferred(plan: Plan, values: dict, colours: Colours, avals: dict | None
               ) -> tuple[str, str]:
    """The mode with fewer passes (per colour, else element), forward on a tie, and why."""
    if colours.patterns is not None:
        rev = sum(colouring.count(c) for c in colours.rows.values())
        fwd, units = colouring.count(colours.columns), ("colours of columns", "colours of rows")
    else:
        avals = shapes(plan, values) if avals is None else avals
        if any(avals[o] is UNKNOWN for o in plan.outputs):
            unknown = [n for n in plan.needed if avals[n] is UNKNOWN
                       and all(avals[d] is not UNKNOWN for d in plan.spec.nodes[n].deps)]
            return "rev", (f"reverse when the outputs' elements cannot be counted: node(s) "
                           f"{unknown} cannot be traced on shapes")
        rev = sum(size(avals[o]) for o in plan.outputs)
        fwd, units = sum(size(values[i]) for i in plan.wrt), ("input elements", "output elements")
    counts = f"{fwd} passes forward ({units[0]}) against {rev} reverse ({units[1]})"
    why = f"forward on a tie: {counts}" if fwd == rev else f"fewer passes: {counts}"
    return "fwd" if fwd <= rev else "rev", why


def _explicitly(plan: Plan) -> list[str]:
    """The nodes a mode asked for traces: those whose function is a custom JVP or VJP."""
    return [n for n in plan.needed if n in plan.active and
            isinstance(function_of(plan.spec.nodes[n]), (jax.custom_jvp, jax.custom_vjp))]


def _cannot(plan: Plan, traces: dict[str, Traced], forward: bool) -> list[str]:
    """Why nodes cannot take forward (``forward``) or reverse mode: missing rules, or jaxprs
    that JAX cannot differentiate so."""
    missing = rules_missing(plan, forward)
    why_no = why_no_jvp if forward else why_no_vjp
    for n in plan.needed:
        if n not in plan.active or n not in traces or n in missing:
            continue
        node, traced = plan.spec.nodes[n], traces[n]
        active = [d in plan.wrt or d in plan.active for d in node.deps]
        why = why_no(traced.jaxpr, [active[d] for d in traced.deps])
        if why is not None:
            missing[n] = f"node {n!r} {why}"
    return [missing[n] for n in plan.needed if n in missing]


# -- the layout ----------------------------------------------------------------------------------

def flat_rows(rows: PyTree) -> np.ndarray:
    """``(rows, elements)``: one name's stacked rows, its differentiable leaves side by side."""
    leaves = [np.asarray(r) for r in jax.tree.leaves(rows)]
    return np.hstack([r.reshape(len(r), -1) for r in leaves]) if leaves else np.zeros((0, 0))


def row_template(rows: PyTree) -> PyTree:
    """A name's structure from its stacked rows: each differentiable leaf's shape and dtype."""
    return jax.tree.map(lambda r: jax.ShapeDtypeStruct(r.shape[1:], r.dtype), rows)


def split_columns(matrix: Any, names: Sequence[str], widths: dict[str, int]
                  ) -> dict[str, sp.csr_array]:
    """``matrix``'s columns, ``widths[i]`` for each of ``names`` in turn, one matrix per name."""
    import scipy.sparse as sp
    return {i: sp.csr_array(matrix[:, s]) for i, s in zip(names, _spans(widths[i] for i in names))}


def _spans(widths) -> list[slice]:
    """Consecutive slices, one of each width."""
    ends = np.cumsum([0, *widths]).tolist()
    return [slice(a, b) for a, b in zip(ends, ends[1:])]


def laid_out(names: Sequence[str], single: bool, value: PyTree, full: Any, templates: dict,
             sparse: bool, items: bool = False) -> PyTree:
    """One output's Jacobian ``full`` (over the elements of every differentiated name of
    ``names``; ``templates``: each name's leaves' shapes and dtypes) as its result's ``grad``:
    ``scipy.sparse`` per name, or ``jax.jacrev``'s layout; the one name's alone where
    ``single`` (:func:`~daskdag.model.request.one_input`). ``items``: a sweep's, dense, with a
    leading axis of items (NumPy or dask arrays)."""
    import scipy.sparse as sp
    widths = {i: size(templates[i]) for i in names}
    if sparse:
        parts = split_columns(sp.csr_array(full), names, widths)
        return parts[names[0]] if single else parts
    dense = full.toarray() if sp.issparse(full) else full
    return _jacrev(value, {i: stacked_rows(dense[..., s], templates[i])
                           for i, s in zip(names, _spans(widths.values()))}, single, items)


def stacked_rows(block: np.ndarray | jax.Array, template: PyTree) -> PyTree:
    """``block`` ``(..., output elements, name elements)`` as stacked rows in the name's
    structure."""
    leaves, treedef = jax.tree.flatten(template, is_leaf=lambda leaf: leaf is None)
    spans = _spans(0 if leaf is None else int(np.prod(leaf.shape)) for leaf in leaves)
    lead = block.shape[:-1]
    return treedef.unflatten([
        None if leaf is None
        else block[..., s].reshape(*lead, *leaf.shape).astype(leaf.dtype, copy=False)
        for leaf, s in zip(leaves, spans)])


def joined(value: PyTree, jacs: dict, single: bool) -> PyTree:
    """Each name's Jacobian (``jacs``) as a result's: the one name's alone where ``single``
    (:func:`~daskdag.model.request.one_input`), else the output's structure of
    ``{name: ...}``."""
    if single:
        return next(iter(jacs.values()))
    out_def = jax.tree.structure(value)
    parts = {i: out_def.flatten_up_to(j) for i, j in jacs.items()}
    return out_def.unflatten([None if all(p[k] is None for p in parts.values())
                              else {i: p[k] for i, p in parts.items()}
                              for k in range(out_def.num_leaves)])


def to_jax(a: np.ndarray) -> jax.Array:
    """A JAX array of ``a`` (never changed after): a large one's buffer taken where JAX can,
    a small one copied by the cheaper ``jnp.asarray``."""
    return jax.device_put(a, may_alias=True) if a.nbytes > 2 ** 16 else jnp.asarray(a)


def jacrev_layout(value: PyTree, rows: PyTree, items: bool = False) -> PyTree:
    """One output's Jacobian for one input, laid out as ``jax.jacrev`` does, from its rows (the
    input's structure, each differentiable leaf stacked over the output's elements, ``None``
    elsewhere): JAX arrays, each made once from NumPy slices (each slice in JAX would be an op
    dispatched). ``items``: a sweep's, with a leading axis of items, kept as they come; so are
    tracers."""
    lead = 1 if items else 0
    in_leaves, in_def = jax.tree.flatten(rows, is_leaf=lambda leaf: leaf is None)
    made = not items and not any(isinstance(leaf, jax.core.Tracer) for leaf in in_leaves)
    if made:
        in_leaves = [None if r is None else np.asarray(r) for r in in_leaves]
    out_leaves, out_def = jax.tree.flatten(value)
    per_leaf: list = []
    start = 0
    for leaf in out_leaves:
        if not is_differentiable(leaf):
            per_leaf.append(None)
            continue
        shape = tuple(np.shape(leaf))
        n = int(np.prod(shape[lead:]))
        blocks = [None if r is None else r[(slice(None),) * lead + (slice(start, start + n),)]
                  .reshape((*shape, *r.shape[lead + 1:])) for r in in_leaves]
        per_leaf.append(in_def.unflatten([to_jax(b) if made and b is not None else b
                                          for b in blocks]))
        start += n
    return out_def.unflatten(per_leaf)
