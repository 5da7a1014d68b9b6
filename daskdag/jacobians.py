"""Full Jacobians: :func:`jacobian`, its lazy form :func:`jacobians`, and
:func:`jacobian_sparsity`.

A Jacobian is pulled back row by row (reverse mode, the graph of :func:`daskdag.compute_grads`
seeded with the rows of the identity) or pushed forward column by column (forward mode, the
graph of :func:`daskdag.compute_jvps` seeded with the identity's columns as directions).
``mode="auto"`` takes the one with fewer passes, forward on a tie, as OpenMDAO's
``compute_totals`` does. A sparse Jacobian's rows (or columns) are grouped by colour (:mod:`daskdag.model.colouring`): one
pass per colour, the entries recovered from the pattern. Either way the result has
``jax.jacrev``'s layout, or is ``scipy.sparse``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property, partial
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from distributed import Client

from daskdag.api import LAZY, Result, entries, input_values, names_key, one_input, watched
from daskdag.errors import DAGError
from daskdag.graph import forward as jvp_graph
from daskdag.graph.build import JacobianSeeding, build
from daskdag.transport import transports
from daskdag.transport.transports import Transport
from daskdag.graph.sparsity import detect, shapes, size
from daskdag.graph.tasks import Rows
from daskdag.model import colouring
from daskdag.model.leaves import PyTree, differentiable_leaves, is_differentiable
from daskdag.model.plan import Plan, make_plan
from daskdag.model.request import check_chunk_size, nodes_in_wrt, parsed, wrt_names, with_rules
from daskdag.model.shapes import UNKNOWN
from daskdag.graph.stages import make_stages
from daskdag.running import prepared
from daskdag.running.compute import active_client, where
from daskdag.running.jobs import CallInfo, Job, as_collection, run
from daskdag.running.lazy import Call
from daskdag.running.local import Template, slot
from daskdag.running.log import where as where_in_words
from daskdag.model.plan import ship
MODES = ("auto", "rev", "fwd")


@overload  # (a str is a Sequence[str] too: the first that fits, str, wins)
def jacobian(dag: Mapping[str, Any], x: PyTree, outputs: str, *,
             wrt: Sequence[str] | None = None, mode: str = "auto", sparsity: Any = None,
             sparse: bool = False, chunk_size: int | None = None, client: Client | None = None,
             scheduler: str | Client | None = None, progress: bool = False
             ) -> Result: ...


@overload
def jacobian(dag: Mapping[str, Any], x: PyTree, outputs: Sequence[str], *,
             wrt: Sequence[str] | None = None, mode: str = "auto", sparsity: Any = None,
             sparse: bool = False, chunk_size: int | None = None, client: Client | None = None,
             scheduler: str | Client | None = None, progress: bool = False
             ) -> dict[str, Result]: ...


def jacobian(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
             wrt: Sequence[str] | None = None, mode: str = "auto", sparsity: Any = None,
             sparse: bool = False, chunk_size: int | None = None, client: Client | None = None,
             scheduler: str | Client | None = None, progress: bool = False
             ) -> Result | dict[str, Result]:
    """Values and full Jacobians of ``outputs`` of ``dag``, as ``jax.jacrev`` of the composed
    function gives them, each node computed once.

    Arguments as for :func:`~daskdag.compute_grads`; outputs may be any real arrays or pytrees.

    Args:
        mode: ``"rev"`` pulls back the rows of the identity over each output's elements
            through each node's pullback under ``jax.vmap`` (one pass per output element;
            every output passing through a stage goes in one call); ``"fwd"`` pushes the
            columns of the identity over the inputs' elements forward through each node's
            JVP under ``jax.vmap`` (one pass per input element, as ``jax.jacfwd``; free
            inputs only, and nodes of your own code need ``jvp=``). ``"auto"`` (default)
            takes the one with fewer passes, forward on a tie (as OpenMDAO does; forward
            keeps no residuals and runs one task per stage). To count the outputs' elements
            it traces the nodes with ``jax.eval_shape`` once (no arithmetic; an eager node's
            Python code runs once more, on abstract values; later calls with the same DAG and
            shapes reuse the count); where a node cannot be traced, reverse. The mode taken
            is ``Result.info.mode``.
        sparsity: the Jacobian's pattern, so that one pass serves many rows (reverse) or columns
            (forward): those a greedy colouring groups, sharing no column (row). A boolean
            array (NumPy or ``scipy.sparse``) shaped ``(output elements, input elements)``,
            over the differentiable leaves in ``jax.tree.leaves`` order, each flattened in
            C order; with several outputs ``{output: ...}``, with several inputs
            ``{input: ...}`` (per output). A True where the Jacobian is zero costs passes;
            a False where it is not gives a wrong Jacobian. ``"detect"`` finds it
            (:func:`jacobian_sparsity`). The mode then counts colours, not elements.
        sparse: return each Jacobian as a ``scipy.sparse.csr_array`` ``(output elements, input
            elements)`` (``{input: ...}`` with several inputs) instead of the dense layout.
        chunk_size: rows (reverse) or columns (forward) per ``jax.vmap`` call (default: all of
            them). A call holds about ``chunk_size`` times a stage's residuals (reverse) or
            values (forward): pass fewer to bound memory. In forward mode each chunk runs a
            node's function once more. A pullback that cannot be vmapped (a host callback)
            runs row by row.

    Returns:
        ``{output: Result(value, jac)}``; ``jac`` has ``jax.jacrev``'s layout: the output's
        structure, each leaf holding the input's structure with leaves shaped
        ``output_leaf.shape + input_leaf.shape``; with several inputs (or nodes) differentiated,
        each output leaf holds a dict ``{input: ...}`` of those, as ``jax.jacrev`` of a function of
        the dict of inputs gives it. ``None`` where a leaf of either is held constant (integers,
        booleans...). Raises as :func:`~daskdag.compute_grads` does, a :class:`~daskdag.DAGError`
        for a mode or pattern that cannot serve the call (naming the node, input or output), and a
        ``ValueError`` naming a complex output. :func:`jacobians` is the same call, not computed yet.

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    res = daskdag.jacobian(dag, jnp.arange(3.0), "A")
    print(res.grad)  # diag(cos(x)), as jax.jacrev gives it
    res = daskdag.jacobian(dag, jnp.arange(3.0), "A", sparsity="detect", sparse=True)
    print(res.grad.nnz)  # 3: one pass per colour, here 1
    ```
    """
    client, local = where(client, scheduler)
    return run(_jacobian(dag, x, outputs, wrt, mode, sparsity, sparse, chunk_size,
                         transports.for_call(client), where=where_in_words(client, local)),
               client, local, progress)


def jacobians(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
              wrt: Sequence[str] | None = None,
              mode: str = "auto", sparsity: Any = None, sparse: bool = False,
              chunk_size: int | None = None) -> Call:
    """:func:`jacobian`, not computed yet: a Dask collection, as :func:`~daskdag.grads` is.

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    print(daskdag.jacobians(dag, jnp.arange(3.0), "A").compute().grad.shape)  # (3, 3)
    ```
    """
    return as_collection(_jacobian(dag, x, outputs, wrt, mode, sparsity, sparse, chunk_size,
                                   transports.for_call(active_client(), lazy=True), where=LAZY))


def jacobian_sparsity(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
                      wrt: Sequence[str] | None = None) -> sp.csr_array | dict[str, Any]:
    """The sparsity patterns of the Jacobians of ``outputs``, as ``jacobian(sparsity=...)``
    takes them: a boolean ``scipy.sparse.csr_array`` ``(output elements, input elements)``, in
    dicts ``{output: {input: ...}}`` as there (one output: no outer dict; one input: no inner).

    Arguments as for :func:`~daskdag.compute_grads`. The DAG's structure composes each node's
    own pattern: from its jaxpr (sound: it holds at every point), or for a node that cannot be
    traced (Python control flow on values, NumPy code under its own rule) from its Jacobian at
    ``x`` and at two random points near it, which runs that node and those before it here,
    and holds where the node's zeros are structural. Computes no Jacobian.

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    print(daskdag.jacobian_sparsity(dag, jnp.arange(3.0), "A").toarray())  # the identity's pattern
    ```
    """
    made, _ = prepared.get("sparsity", dag, x, (names_key(outputs), names_key(wrt)),
                           partial(_detected, dag, x, outputs, wrt))
    plan, patterns = made
    widths = {i: size(t) for i, t in _templates(plan, input_values(plan.spec, x)).items()}
    out = {o: _split_columns(p, plan.wrt, widths) for o, p in patterns.items()}
    out = {o: p[plan.wrt[0]] if len(plan.wrt) == 1 else p for o, p in out.items()}
    return out[outputs] if isinstance(outputs, str) else out


def _detected(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str],
              wrt: Sequence[str] | None, watch: prepared.Watch) -> tuple[Plan, dict]:
    """:func:`jacobian_sparsity` prepared: the plan and its detected patterns."""
    plan, values = _plan(dag, x, outputs, wrt, watch.hold)
    return plan, _detect(plan, values, watch)


def _detect(plan: Plan, values: dict, watch: prepared.Watch) -> dict[str, sp.csr_array]:
    """The plan's patterns, detected (:func:`daskdag.graph.sparsity.detect`) after watching
    every function they are read from; a pattern probed at this point holds for this call
    only."""
    for n in plan.needed:
        watch(n, plan.spec.nodes[n].fn)
    probed: list[str] = []
    patterns = detect(plan, values, probed)
    if probed:
        watch.refuse(f"node(s) {probed}: their sparsity patterns were probed at this point (they "
                     f"could not be read off a jaxpr), so they are detected again at each call")
    return patterns


# -- one call --------------------------------------------------------------------------------------

def _plan(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str],
          wrt: Sequence[str] | None, hold: Any = None) -> tuple[Plan, dict]:
    """The call's plan (its ``wrt`` checked, its rules not yet: that depends on the mode) and
    its input values; ``hold`` as for :func:`daskdag.model.spec.parse`."""
    spec, names, values = parsed(dag, x, outputs, hold)
    return make_plan(spec, names, wrt_names(spec, values, wrt, candidates=values)), values


def _jacobian(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str],
              wrt: Sequence[str] | None, mode: str, sparsity: Any, sparse: bool,
              chunk_size: int | None, transport: Transport, where: str = "") -> Job:
    check_chunk_size(chunk_size)
    if mode not in MODES:
        raise DAGError(f"mode must be one of {MODES}, got {mode!r}")
    made, why = prepared.get(
        "jacobian", dag, x, (names_key(outputs), names_key(wrt), mode, pattern_key(sparsity),
                             chunk_size, transport),
        partial(Jacobian.make, dag, x, outputs, wrt, mode, sparsity, chunk_size, transport))
    info = CallInfo("jacobian", made.mode, 0, made.colours.total, made.source, why is None, why,
                    where)
    return replace(made.job(input_values(made.plan.spec, x), sparse, outputs, info),
                   keep=entries(dag))


@dataclass(frozen=True)
class Jacobian:
    """:func:`jacobian` prepared: its plan (packed for its ``transport``, checked for its
    mode), stages, mode, patterns and their colours (``source``: ``"given"``, ``"detected"``,
    ``"probed"``, or None when dense), and the seeds of its passes: ``rows`` (reverse), or the
    inputs' ``templates`` and ``tangents`` (forward)."""

    plan: Plan
    transport: Transport
    stages: tuple
    mode: str
    colours: _Colours
    source: str | None
    chunk_size: int | None
    rows: Rows | None = None
    templates: dict | None = None
    tangents: dict | None = None
    graph: Template | None = None  # a call in this process: its graph, inputs in slots

    @classmethod
    def make(cls, dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str],
             wrt: Sequence[str] | None, mode: str, sparsity: Any, chunk_size: int | None,
             transport: Transport, watch: prepared.Watch) -> Jacobian:
        plan, values = _plan(dag, x, outputs, wrt, watch.hold)
        patterns, source = None, None
        if isinstance(sparsity, str) and sparsity == "detect":
            patterns = _detect(plan, values, watch)
            source = "probed" if watch.refused else "detected"
        elif sparsity is not None:
            patterns, source = _user_patterns(plan, values, sparsity, outputs), "given"
        colours = _Colours(patterns)
        if mode == "auto" and patterns is None:  # (the mode comes from the nodes' traced shapes)
            for n in plan.needed:
                watch(n, plan.spec.nodes[n].fn)
        # (Packed first, as the user's functions are now: the mode's trace of them comes after.)
        plan = ship(plan, transport, watched(plan, transport, watch))
        mode = _mode(plan, values, mode, colours)
        plan = with_rules(plan, forward=mode == "fwd")
        if mode == "rev":
            rows = Rows(chunk_size, tuple((o, tuple(cs.tolist())) for o, cs in
                                          (colours.rows.items() if patterns is not None else ())))
            made = cls(plan, transport, make_stages(plan, fan_in=not transport.packs), mode,
                       colours, source, chunk_size, rows=rows)
            return made if transport.packs else replace(made, graph=Template(made.build(
                {i: slot("input", i) for i in values}, slot("stop"), None)))
        templates = _templates(plan, values)
        dtype = jnp.result_type(*(leaf for t in templates.values() for leaf in jax.tree.leaves(t)))
        seeds = (np.eye(sum(size(t) for t in templates.values()), dtype=dtype) if patterns is None else
                 colouring.seeds(colours.columns, dtype))
        k, start, tangents = len(seeds), 0, {}
        for i in plan.wrt:
            leaves = []
            for leaf in jax.tree.leaves(templates[i]):
                width = int(np.prod(leaf.shape))
                leaves.append(jnp.asarray(seeds[:, start:start + width].reshape(k, *leaf.shape),
                                          leaf.dtype))
                start += width
            tangents[i] = tuple(leaves)
        made = cls(plan, transport, make_stages(plan, fan_in=not transport.packs), mode, colours,
                   source, chunk_size, templates=templates, tangents=tangents)
        return made if transport.packs else replace(made, graph=Template(made.build(
            {i: slot("input", i) for i in values}, slot("stop"), None)))

    @property
    def directions(self) -> int:
        """Forward mode: the passes, one per column (per colour when sparse)."""
        tangents = self.tangents or {}
        return len(next(iter(tangents.values()))[0]) if tangents else 0

    def build(self, values: dict, stop: Any, place: Any) -> dict:
        """The call's graph (:func:`daskdag.graph.build.build`, seeded with rows, or
        :func:`daskdag.graph.forward.build`, with the identity's columns)."""
        if self.mode == "rev":
            assert self.rows is not None
            return build(self.plan, values, JacobianSeeding(self.rows), self.transport,
                         place=place, stop=stop, stages=self.stages)
        return jvp_graph.build(self.plan, values, self.tangents or {}, self.transport,
                               self.directions, place=place, stop=stop, chunk=self.chunk_size,
                               stages=self.stages)

    def job(self, values: dict, sparse: bool, outputs: str | Sequence[str], info: CallInfo
            ) -> Job:
        graph = self.graph

        def make(place: Any, stop: Any) -> Any:
            if graph is not None:
                return graph.fill({**{slot("input", i): v for i, v in values.items()},
                                   slot("stop"): stop})
            return self.build(values, stop, place)

        if self.mode == "rev":
            finish = partial(self._reverse_results, sparse, outputs, info)
        else:
            finish = partial(self._forward_results, sparse, outputs,
                             replace(info, passes=self.directions), self.directions)
        return Job(self.plan, make, finish, "jacobian")

    def _reverse_results(self, sparse: bool, outputs: str | Sequence[str], info: CallInfo,
                         computed: dict) -> Any:
        plan, patterns = self.plan, self.colours.patterns
        info = replace(info, passes=info.colours or 0 if patterns is not None else
                       sum(size(value) for value, _ in computed.values()))
        results = {}
        for o, (value, per_name) in computed.items():
            if patterns is None and not sparse:
                jacs = {i: _jacrev_layout(value, r) for i, r in per_name.items()}
                results[o] = Result(value, _joined(plan, value, jacs), info=info)
                continue
            flat = np.hstack([_flat_rows(per_name[i]) for i in plan.wrt])
            full = (sp.csr_array(flat) if patterns is None else
                    colouring.from_rows(patterns[o], self.colours.rows[o], flat,
                                        dense=not sparse))
            results[o] = _result(plan, value, full, {i: _row_template(r) for i, r in
                                                     per_name.items()}, sparse, info)
        return results[outputs] if isinstance(outputs, str) else results

    def _forward_results(self, sparse: bool, outputs: str | Sequence[str], info: CallInfo,
                         k: int, computed: dict) -> Any:
        plan, patterns = self.plan, self.colours.patterns
        results = {}
        for o, (value, t) in computed.items():
            for leaf in differentiable_leaves(value):
                if jnp.iscomplexobj(leaf):
                    raise ValueError(f"output {o!r} is complex ({jnp.result_type(leaf)}): a "
                                     f"Jacobian needs real outputs, as jax.jacrev does")
            pushed = [np.asarray(leaf).reshape(k, -1) for leaf in
                      jax.tree.leaves(t[jvp_graph.TANGENT])]
            passes = np.hstack(pushed) if pushed else np.zeros((k, 0))
            if patterns is None:
                full = passes.T
            else:
                if patterns[o].shape[0] != passes.shape[1]:
                    raise ValueError(f"the sparsity pattern of output {o!r} has "
                                     f"{patterns[o].shape[0]} rows, but the output has "
                                     f"{passes.shape[1]} elements")
                full = colouring.from_columns(patterns[o], self.colours.columns, passes,
                                              dense=not sparse)
            results[o] = _result(plan, value, full, self.templates or {}, sparse, info)
        return results[outputs] if isinstance(outputs, str) else results


class _Colours:
    """A call's patterns (``{output: pattern over every wrt name}``, or None: dense), and
    their colours, found once each when asked: ``rows`` per output (reverse), ``columns``
    (forward, one colouring for all outputs)."""

    def __init__(self, patterns: dict[str, sp.csr_array] | None) -> None:
        self.patterns: Any = patterns  # (rows and columns are asked for only where it is not None)
        self.used: str | None = None  # which were used: "rows" or "columns"

    @cached_property
    def rows(self) -> dict:
        self.used = "rows"
        return {o: colouring.colour_rows(p) for o, p in self.patterns.items()}

    @cached_property
    def columns(self) -> np.ndarray:
        self.used = "columns"
        return colouring.colour_columns(sp.vstack(list(self.patterns.values())))

    @property
    def total(self) -> int | None:
        """The colours the chosen mode takes (one pass each); None when dense."""
        if self.patterns is None:
            return None
        if self.used == "columns":
            return colouring.count(self.columns)
        return sum(colouring.count(c) for c in self.rows.values())


def _mode(plan: Plan, values: dict, mode: str, colours: _Colours) -> str:
    """The mode asked for, checked, or for ``"auto"`` the one with fewer passes."""
    why_not = {"fwd": nodes_in_wrt(plan.spec, plan.wrt, "forward mode differentiates")
               or _rules_missing(plan, forward=True),
               "rev": _rules_missing(plan, forward=False)}
    if mode != "auto":
        if why_not[mode]:
            raise DAGError(f"mode={mode!r} cannot serve this call: {why_not[mode]}")
        return mode
    if why_not["fwd"] or why_not["rev"]:
        return "rev" if not why_not["rev"] else "fwd"
    if colours.patterns is not None:
        rev = sum(colouring.count(c) for c in colours.rows.values())
        columns = colouring.count(colours.columns)
        mode = "fwd" if columns <= rev else "rev"
        colours.used = "columns" if mode == "fwd" else "rows"
        return mode
    avals = shapes(plan, values)
    if any(avals[o] is UNKNOWN for o in plan.outputs):
        return "rev"
    rev = sum(size(avals[o]) for o in plan.outputs)
    fwd = sum(size(values[i]) for i in plan.wrt)
    return "fwd" if fwd <= rev else "rev"


def _rules_missing(plan: Plan, forward: bool) -> str | None:
    try:
        with_rules(plan, forward)
    except DAGError as e:
        return str(e)
    return None


def _templates(plan: Plan, values: dict) -> dict:
    """Per wrt input, its differentiable leaves' shapes and dtypes (``None`` elsewhere)."""
    return {i: jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
                            if is_differentiable(a) else None, values[i]) for i in plan.wrt}


def pattern_key(sparsity: Any) -> Any:
    """A ``sparsity`` argument as (part of) a preparation's key: by content (a pattern given as
    an array can change in place), ``"detect"`` or None as they are."""
    if sparsity is None or isinstance(sparsity, str):
        return sparsity
    if isinstance(sparsity, Mapping):
        return tuple((k, pattern_key(v)) for k, v in sparsity.items())
    if sp.issparse(sparsity):
        csr = sp.csr_array(sparsity)
        parts: tuple = (csr.indptr, csr.indices, csr.data)
        shape = csr.shape
    else:
        try:
            dense = np.asarray(sparsity)
        except Exception:
            return ("object", id(sparsity))
        if dense.dtype.hasobject:
            return ("object", id(sparsity))
        parts, shape = (np.ascontiguousarray(dense),), dense.shape
    digest = hashlib.sha1(repr((shape, [(p.dtype.str, p.shape) for p in parts])).encode())
    for p in parts:
        digest.update(np.ascontiguousarray(p).data)
    return digest.hexdigest()


# -- reverse and forward: the gradient graph seeded with rows, the JVP graph with columns ------------

def _flat_rows(rows: PyTree) -> np.ndarray:
    """``(rows, elements)``: one name's stacked rows, its differentiable leaves side by side."""
    leaves = [np.asarray(r) for r in jax.tree.leaves(rows)]
    return np.hstack([r.reshape(len(r), -1) for r in leaves]) if leaves else np.zeros((0, 0))


def _row_template(rows: PyTree) -> PyTree:
    """A name's structure from its stacked rows: each differentiable leaf's shape and dtype."""
    return jax.tree.map(lambda r: jax.ShapeDtypeStruct(r.shape[1:], r.dtype), rows)


# -- patterns --------------------------------------------------------------------------------------

def _user_patterns(plan: Plan, values: dict, sparsity: Any, outputs: str | Sequence[str]
                   ) -> dict[str, sp.csr_array]:
    """``{output: pattern over every wrt name's elements}`` from ``sparsity`` as given."""
    one = isinstance(outputs, str) and not (  # (one output's pattern, or {output: pattern})
        isinstance(sparsity, Mapping) and set(sparsity) == {outputs} and outputs not in plan.wrt)
    per_output = {o: sparsity for o in plan.outputs} if one else sparsity
    if not isinstance(per_output, Mapping):
        raise DAGError(f"sparsity for several outputs must be a dict {{output: pattern}}, got "
                       f"{type(sparsity).__name__}")
    out = {}
    for o in plan.outputs:
        if o not in per_output:
            raise DAGError(f"sparsity gives no pattern for output {o!r}; it has {list(per_output)}")
        given = per_output[o]
        blocks = given if isinstance(given, Mapping) else (
            {plan.wrt[0]: given} if len(plan.wrt) == 1 else None)
        if blocks is None:
            raise DAGError(f"sparsity for output {o!r}: with several inputs {list(plan.wrt)}, "
                           f"give a dict {{input: pattern}}")
        parts = []
        for i in plan.wrt:
            if i not in blocks:
                raise DAGError(f"sparsity for output {o!r} gives no pattern for {i!r}; it has "
                               f"{list(blocks)}")
            try:
                block = colouring.as_pattern(blocks[i])
            except (TypeError, ValueError) as e:
                raise DAGError(f"sparsity for output {o!r} and {i!r}: {e}") from None
            if block.ndim != 2:
                raise DAGError(f"sparsity for output {o!r} and {i!r} must be 2-D (output "
                               f"elements, input elements)")
            if i in values and block.shape[1] != size(values[i]):
                raise DAGError(f"sparsity for output {o!r} and input {i!r} has {block.shape[1]} "
                               f"columns, but the input has {size(values[i])} elements")
            parts.append(block)
        if len({p.shape[0] for p in parts}) > 1:
            raise DAGError(f"sparsity for output {o!r}: the patterns disagree on its number of "
                           f"elements: {[p.shape[0] for p in parts]}")
        out[o] = sp.hstack(parts, format="csr")
    return out


def _split_columns(matrix: Any, names: Sequence[str], widths: dict[str, int]
                   ) -> dict[str, sp.csr_array]:
    out, start = {}, 0
    for i in names:
        out[i] = sp.csr_array(matrix[:, start:start + widths[i]])
        start += widths[i]
    return out


# -- layout ----------------------------------------------------------------------------------------

def _result(plan: Plan, value: PyTree, full: Any, templates: dict, sparse: bool,
            info: CallInfo) -> Result:
    """One output's Result from its Jacobian over every wrt name's elements (``full``, dense
    NumPy or ``scipy.sparse``): as ``scipy.sparse`` per name, or in ``jax.jacrev``'s layout."""
    widths = {i: size(t) for i, t in templates.items()}
    if sparse:
        parts = _split_columns(sp.csr_array(full), plan.wrt, widths)
        return Result(value, parts[plan.wrt[0]] if one_input(plan.spec, parts) else parts,
                      info=info)
    dense = full.toarray() if sp.issparse(full) else np.asarray(full)
    jacs, start = {}, 0
    for i in plan.wrt:
        block = dense[:, start:start + widths[i]]
        start += widths[i]
        jacs[i] = _jacrev_layout(value, _rows(block, templates[i]))
    return Result(value, _joined(plan, value, jacs), info=info)


def _rows(block: np.ndarray, template: PyTree) -> PyTree:
    """``block`` ``(output elements, name elements)`` as stacked rows in the name's structure."""
    leaves, treedef = jax.tree.flatten(template, is_leaf=lambda leaf: leaf is None)
    out: list = []
    start = 0
    for leaf in leaves:
        if leaf is None:
            out.append(None)
            continue
        n = int(np.prod(leaf.shape))
        out.append(block[:, start:start + n].reshape(len(block), *leaf.shape).astype(
            leaf.dtype, copy=False))
        start += n
    return treedef.unflatten(out)


def _joined(plan: Plan, value: PyTree, jacs: dict) -> PyTree:
    """One name's Jacobian alone when the DAG has one free input and it is all that was
    differentiated, else the output's structure of ``{name: ...}``."""
    return jacs[plan.wrt[0]] if one_input(plan.spec, jacs) else _by_output(value, jacs)


def _by_output(value: PyTree, jacs: dict) -> PyTree:
    """``{input: output structure of jac}`` as the output's structure of ``{input: jac}``."""
    out_def = jax.tree.structure(value)
    parts = {i: out_def.flatten_up_to(j) for i, j in jacs.items()}
    return out_def.unflatten([None if all(p[k] is None for p in parts.values()) else
                              {i: p[k] for i, p in parts.items()} for k in range(out_def.num_leaves)])


def _to_jax(a: np.ndarray) -> jax.Array:
    """A JAX array of ``a``, this call's own array, which nothing changes after: a large one put
    on the device as it is, its buffer taken where JAX can (``jnp.asarray`` would copy it), a
    small one by ``jnp.asarray`` (the cheaper call)."""
    return jax.device_put(a, may_alias=True) if a.nbytes > 2 ** 16 else jnp.asarray(a)


def _jacrev_layout(value: PyTree, rows: PyTree) -> PyTree:
    """One output's Jacobian for one input, laid out as ``jax.jacrev`` does, from its rows (the
    input's structure, each differentiable leaf stacked over the output's elements, ``None``
    elsewhere; see :func:`daskdag.rules.seeds.basis`): JAX arrays, each made once from the
    rows' NumPy values, sliced and reshaped there (in JAX each would be an op dispatched)."""
    in_leaves, in_def = jax.tree.flatten(rows, is_leaf=lambda leaf: leaf is None)
    in_leaves = [None if r is None else np.asarray(r) for r in in_leaves]
    out_leaves, out_def = jax.tree.flatten(value)
    per_leaf: list = []
    start = 0
    for leaf in out_leaves:
        if not is_differentiable(leaf):
            per_leaf.append(None)
            continue
        n = int(np.size(leaf))
        per_leaf.append(in_def.unflatten([
            None if r is None else _to_jax(r[start:start + n].reshape(*np.shape(leaf), *r.shape[1:]))
            for r in in_leaves]))
        start += n
    return out_def.unflatten(per_leaf)
