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

import os

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, overload

import jax
import jax.numpy as jnp
import numpy as np

from daskdag.api import Result, entries, input_values, names_key, watched
from daskdag.durable import calls as durable
from daskdag.errors import DAGError
from daskdag.graph import forward as jvp_graph
from daskdag.graph.build import JacobianSeeding, build
from daskdag.transport.transports import Transport
from daskdag.graph.sparsity import detect, shapes, size
from daskdag.graph.tasks import Rows
from daskdag.model import colouring
from daskdag.model.leaves import PyTree, differentiable_leaves, is_differentiable
from daskdag.model.plan import Plan, make_plan
from daskdag.model.patterns import Colours, pattern_key, user_patterns
from daskdag.model.jacobian_layout import (flat_rows, jacrev_layout, joined, laid_out,
                                           row_template, split_columns)
from daskdag.model.request import (check_chunk_size, nodes_in_wrt, parsed, rules_missing,
                                   wrt_names, with_rules)
from daskdag.model.shapes import UNKNOWN, Traced
from daskdag.graph.stages import stages_for
from daskdag.graph.whole import WholeJacobian, made_once, whole_stage
from daskdag.rules.jvp import why_no_jvp
from daskdag.rules.registry import function_of
from daskdag.rules.vjp import why_no_vjp
from daskdag.running import programs
from daskdag.running.compute import where
from daskdag.running.jobs import CallInfo, Job, call, lazy
from daskdag.running.lazy import Call
from daskdag.running.local import Template, slot
from daskdag.running.programs import Program
from daskdag.model.plan import ship

if TYPE_CHECKING:
    import scipy.sparse as sp
    from distributed import Client
    from zarr.abc.store import Store as ZarrStore
MODES = ("auto", "rev", "fwd")


@overload  # (a str is a Sequence[str] too: the first that fits, str, wins)
def jacobian(dag: Mapping[str, Any], x: PyTree, outputs: str, *,
             wrt: Sequence[str] | None = None, mode: str = "auto", sparsity: Any = None,
             sparse: bool = False, chunk_size: int | None = None, client: Client | None = None,
             scheduler: str | Client | None = None, progress: bool = False,
             store: str | os.PathLike | ZarrStore | None = None) -> Result: ...


@overload
def jacobian(dag: Mapping[str, Any], x: PyTree, outputs: Sequence[str], *,
             wrt: Sequence[str] | None = None, mode: str = "auto", sparsity: Any = None,
             sparse: bool = False, chunk_size: int | None = None, client: Client | None = None,
             scheduler: str | Client | None = None, progress: bool = False,
             store: str | os.PathLike | ZarrStore | None = None) -> dict[str, Result]: ...


def jacobian(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
             wrt: Sequence[str] | None = None, mode: str = "auto", sparsity: Any = None,
             sparse: bool = False, chunk_size: int | None = None, client: Client | None = None,
             scheduler: str | Client | None = None, progress: bool = False,
             store: str | os.PathLike | ZarrStore | None = None) -> Result | dict[str, Result]:
    """Values and full Jacobians of ``outputs`` of ``dag``, as ``jax.jacrev`` of the composed
    function gives them, each node computed once.

    Arguments as for [`compute_grads`][daskdag.compute_grads]; outputs may be any real arrays or pytrees.

    Args:
        mode: ``"rev"`` pulls back the rows of the identity over each output's elements
            through each node's pullback under ``jax.vmap`` (one pass per output element;
            every output passing through a stage goes in one call); ``"fwd"`` pushes the
            columns of the identity over the inputs' elements forward through each node's
            JVP under ``jax.vmap`` (one pass per input element, as ``jax.jacfwd``; free
            inputs only, and nodes of your own code need ``jvp=``). ``"auto"`` (default)
            takes the one with fewer passes, forward on a tie (as OpenMDAO does; forward
            keeps no residuals and runs one task per stage), among the modes every node can
            take. To count the outputs' elements it traces the nodes on shapes once (no
            arithmetic; an eager node's Python code runs once more, on abstract values; later
            calls with the same DAG and shapes reuse the count); where a node cannot be
            traced, reverse. The same trace says which mode a node cannot take: forward
            through a ``jax.custom_vjp`` function, reverse through a ``jax.custom_jvp`` rule
            that cannot be transposed (a ``jax.pure_callback``), or either without the rule
            of your own (``vjp=``, ``jvp=``). An explicit mode checks your rules and the nodes
            whose function is a ``jax.custom_jvp`` or ``jax.custom_vjp`` (traced with the
            nodes before them). The mode taken is ``Result.info.mode``, why it was taken
            ``Result.info.mode_why``.
        sparsity: the Jacobian's pattern, so that one pass serves many rows (reverse) or columns
            (forward): those a greedy colouring groups, sharing no column (row). A boolean
            array (NumPy or ``scipy.sparse``) shaped ``(output elements, input elements)``,
            over the differentiable leaves in ``jax.tree.leaves`` order, each flattened in
            C order; with several outputs ``{output: ...}``, with several inputs
            ``{input: ...}`` (per output). A True where the Jacobian is zero costs passes;
            a False where it is not gives a wrong Jacobian. ``"detect"`` finds it
            ([`jacobian_sparsity`][daskdag.jacobian_sparsity]). The mode then counts colours, not elements.
        sparse: return each Jacobian as a ``scipy.sparse.csr_array`` ``(output elements, input
            elements)`` (``{input: ...}`` with several inputs) instead of the dense layout.
        chunk_size: rows (reverse) or columns (forward) per ``jax.vmap`` call (default: all of
            them). A call holds about ``chunk_size`` times a stage's residuals (reverse) or
            values (forward): pass fewer to bound memory. In forward mode each chunk runs a
            node's function once more. A pullback that cannot be vmapped (a host callback)
            runs row by row.
        store: as for [`compute_grads`][daskdag.compute_grads]: each stage's forward result
            kept as it finishes (reverse: values and residuals; forward: values and
            tangents); the mode, pattern and ``chunk_size`` are part of what the store
            records.

    Returns:
        ``{output: Result(value, jac)}`` (a single name: one [`Result`][daskdag.Result]);
            ``jac`` has ``jax.jacrev``'s layout: the output's structure, each leaf holding the
            input's structure with leaves shaped ``output_leaf.shape + input_leaf.shape``; with
            several inputs (or nodes) differentiated, each output leaf holds a dict
            ``{input: ...}`` of those, as ``jax.jacrev`` of a function of the dict of inputs
            gives it. ``None`` where a leaf of either is held constant (integers, booleans...).
            [`jacobians`][daskdag.jacobians] is the same call, not computed yet.

    Raises:
        DAGError: as for [`compute_grads`][daskdag.compute_grads]; also a mode or pattern that
            cannot serve the call (with ``"auto"``, when no mode can: naming each node and
            what it lacks), and a complex output, naming the node, input or output.
        NodeError: a node raised.
        ClusterError: as for [`compute_grads`][daskdag.compute_grads].

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
    kind = Jacobians(dag, outputs, wrt, mode, sparsity, sparse, chunk_size)
    if store is not None:
        return durable.call(kind, "jacobian", x, client=client, local=local, progress=progress,
                            store=store)
    return call(kind, x, client=client, local=local, progress=progress)


def jacobians(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
              wrt: Sequence[str] | None = None,
              mode: str = "auto", sparsity: Any = None, sparse: bool = False,
              chunk_size: int | None = None) -> Call:
    """[`jacobian`][daskdag.jacobian], not computed yet: a Dask collection, as [`grads`][daskdag.grads] is.

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    print(daskdag.jacobians(dag, jnp.arange(3.0), "A").compute().grad.shape)  # (3, 3)
    ```
    """
    return lazy(Jacobians(dag, outputs, wrt, mode, sparsity, sparse, chunk_size), x)


def jacobian_sparsity(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
                      wrt: Sequence[str] | None = None) -> sp.csr_array | dict[str, Any]:
    """The sparsity patterns of the Jacobians of ``outputs``, as ``jacobian(sparsity=...)``
    takes them: a boolean ``scipy.sparse.csr_array`` ``(output elements, input elements)``, in
    dicts ``{output: {input: ...}}`` as there (one output: no outer dict; one input: no inner).

    Arguments as for [`compute_grads`][daskdag.compute_grads]. The DAG's structure composes each node's
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
    program, _ = programs.compile("sparsity", dag, x, (names_key(outputs), names_key(wrt)),
                                  partial(_detected, dag, x, outputs, wrt))
    plan, patterns = program.value
    widths = {i: size(t) for i, t in _templates(plan, input_values(plan.spec, x)).items()}
    out = {o: split_columns(p, plan.wrt, widths) for o, p in patterns.items()}
    out = {o: p[plan.wrt[0]] if len(plan.wrt) == 1 else p for o, p in out.items()}
    return out[outputs] if isinstance(outputs, str) else out


def _detected(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str],
              wrt: Sequence[str] | None, watch: programs.Watch) -> tuple[Plan, dict]:
    """:func:`jacobian_sparsity` compiled: the plan and its detected patterns."""
    plan, values = _plan(dag, x, outputs, wrt, watch.hold)
    return plan, _detect(plan, values, watch)


def _detect(plan: Plan, values: dict, watch: programs.Watch,
            traces: dict[str, Traced] | None = None) -> dict[str, sp.csr_array]:
    """The plan's patterns, detected (:func:`daskdag.graph.sparsity.detect`) after watching
    every function they are read from; a pattern probed at this point holds for this call
    only. ``traces``: filled with the nodes' jaxprs, as :func:`~daskdag.graph.sparsity.shapes`
    traced them."""
    for n in plan.needed:
        watch(n, plan.spec.nodes[n].fn)
    probed: list[str] = []
    patterns = detect(plan, values, probed, traces)
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


@dataclass(frozen=True)
class Jacobians:
    """:func:`jacobian` as a kind of call (:class:`~daskdag.running.jobs.Kind`): its program is
    a :class:`Jacobian`; a call has no data beyond its inputs (its seeds are the identity's
    rows or columns, part of the program)."""

    dag: Mapping[str, Any]
    outputs: str | Sequence[str]
    wrt: Sequence[str] | None
    mode: str
    sparsity: Any
    sparse: bool
    chunk_size: int | None

    def compile(self, x: PyTree, data: tuple, transport: Transport
                ) -> tuple[Program[Jacobian], str | None]:
        check_chunk_size(self.chunk_size)
        if self.mode not in MODES:
            raise DAGError(f"mode must be one of {MODES}, got {self.mode!r}")
        return programs.compile(
            "jacobian", self.dag, x, (names_key(self.outputs), names_key(self.wrt), self.mode,
                                      pattern_key(self.sparsity), self.chunk_size, transport),
            partial(Jacobian.make, self.dag, x, self.outputs, self.wrt, self.mode,
                    self.sparsity, self.chunk_size, transport))

    def job(self, program: Program[Jacobian], x: PyTree, data: tuple, why: str | None,
            where: str) -> Job:
        made = program.value
        info = CallInfo("jacobian", made.mode, 0, made.colours.total, made.source, why is None,
                        why, where, mode_why=made.mode_why)
        return made.job(input_values(made.plan.spec, x), self.sparse, self.outputs, info,
                        keep=entries(self.dag))


@dataclass(frozen=True)
class Jacobian:
    """:func:`jacobian` compiled: its plan (packed for its ``transport``, checked for its
    mode), stages, mode and why it was taken, patterns and their colours (``source``:
    ``"given"``, ``"detected"``, ``"probed"``, or None when dense), and the seeds of its passes:
    ``rows`` (reverse), or the inputs' ``templates`` and ``tangents`` (forward)."""

    plan: Plan
    transport: Transport
    stages: tuple
    mode: str
    mode_why: str
    colours: Colours
    source: str | None
    chunk_size: int | None
    rows: Rows | None = None
    templates: dict | None = None
    tangents: dict | None = None
    graph: Template | None = None  # a call in this process: its graph, inputs in slots
    whole: WholeJacobian | None = None  # the call as one program (daskdag.graph.whole)

    @classmethod
    def make(cls, dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str],
             wrt: Sequence[str] | None, mode: str, sparsity: Any, chunk_size: int | None,
             transport: Transport, watch: programs.Watch) -> Jacobian:
        plan, values = _plan(dag, x, outputs, wrt, watch.hold)
        patterns, source = None, None
        traces: dict[str, Traced] | None = None  # (each node's jaxpr, where a pattern traced it)
        if isinstance(sparsity, str) and sparsity == "detect":
            traces = {}
            patterns = _detect(plan, values, watch, traces)
            source = "probed" if watch.refused else "detected"
        elif sparsity is not None:
            traces = {}
            patterns = _given_patterns(plan, values, sparsity, outputs, traces)
            source = "given"
        colours = Colours(patterns)
        # "auto" takes its mode from the nodes' traces (their shapes and what they can do), so
        # it watches them; a mode asked for is only checked, and a call refused keeps nothing.
        if mode == "auto":
            for n in plan.needed:
                watch(n, plan.spec.nodes[n].fn)
        # (Packed first, as the user's functions are now: the mode's trace of them comes after.)
        plan = ship(plan, transport, watched(plan, transport, watch))
        mode, mode_why = _mode(plan, values, mode, colours, traces)
        plan = with_rules(plan, forward=mode == "fwd")
        if mode == "rev":
            rows = Rows(chunk_size, tuple((o, tuple(cs.tolist())) for o, cs in
                                          (colours.rows.items() if patterns is not None else ())))
            made = cls(plan, transport, stages_for(plan, transport.packs), mode,
                       mode_why, colours, source, chunk_size, rows=rows)
            return made if transport.packs else made.in_process(values)
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
        made = cls(plan, transport, stages_for(plan, transport.packs), mode,
                   mode_why, colours, source, chunk_size, templates=templates, tangents=tangents)
        return made if transport.packs else made.in_process(values)

    def in_process(self, values: dict) -> Jacobian:
        """With what a call in this process runs: its graph, inputs in slots, and where the
        call is one closed fused stage and its Jacobian dense and whole (no pattern, no
        ``chunk_size``), the call as one program."""
        made = replace(self, graph=Template(self.build(
            {i: slot("input", i) for i in values}, slot("stop"), None)))
        stage = whole_stage(self.plan, self.stages)
        if stage is None or self.colours.patterns is not None or self.chunk_size is not None:
            return made
        nodes = [self.plan.spec.nodes[n] for n in stage.nodes]
        return replace(made, whole=made_once(
            lambda: WholeJacobian(self.plan, stage, nodes, self.mode),
            (WholeJacobian, stage, self.plan.outputs, self.plan.wrt, self.mode), nodes))

    @cached_property
    def directions(self) -> int:
        """Forward mode: the passes, one per column (per colour when sparse)."""
        tangents = self.tangents or {}
        return len(next(iter(tangents.values()))[0]) if tangents else 0

    def build(self, values: dict, stop: Any, place: Any, keep: Any = None) -> dict:
        """The call's graph (:func:`daskdag.graph.build.build`, seeded with rows, or
        :func:`daskdag.graph.forward.build`, with the identity's columns); ``keep`` as for
        those."""
        if self.mode == "rev":
            assert self.rows is not None
            return build(self.plan, values, JacobianSeeding(self.rows), self.transport,
                         place=place, stop=stop, stages=self.stages, keep=keep)
        return jvp_graph.build(self.plan, values, self.tangents or {}, self.transport,
                               self.directions, place=place, stop=stop, chunk=self.chunk_size,
                               stages=self.stages, keep=keep)

    def job(self, values: dict, sparse: bool, outputs: str | Sequence[str], info: CallInfo,
            keep: Any = None) -> Job:
        """The call for input ``values``; ``keep`` as for :class:`~daskdag.running.jobs.Job`."""
        graph = self.graph

        def make(place: Any, stop: Any) -> Any:
            if graph is not None:
                return graph.fill({**{slot("input", i): v for i, v in values.items()},
                                   slot("stop"): stop})
            return self.build(values, stop, place)

        if self.mode == "rev":
            finish = partial(self._reverse_results, sparse, outputs, info)
        else:
            finish = partial(self._forward_results, sparse, outputs, info, self.directions)
        direct = None if self.whole is None or sparse else partial(
            self._directly, self.whole, values, outputs, info)
        return Job(self.plan, make, finish, "jacobian", keep=keep, direct=direct,
                   stored=lambda place, stop, keeper: self.build(values, stop, place, keeper))

    def _directly(self, whole: WholeJacobian, values: dict, outputs: str | Sequence[str],
                  info: CallInfo) -> Any:
        """The call's result from its one program, or None where it cannot run it."""
        computed = whole(values)
        if computed is None:
            return None
        passes = (self.directions if self.mode == "fwd" else
                  sum(size(value) for value, _ in computed.values()))
        info = replace(info, passes=passes)
        results = {o: Result(value, joined(self.plan, value, jacs), info=info)
                   for o, (value, jacs) in computed.items()}
        return results[outputs] if isinstance(outputs, str) else results

    def _reverse_results(self, sparse: bool, outputs: str | Sequence[str], info: CallInfo,
                         computed: dict) -> Any:
        import scipy.sparse as sp
        plan, patterns = self.plan, self.colours.patterns
        info = replace(info, passes=info.colours or 0 if patterns is not None else
                       sum(size(value) for value, _ in computed.values()))
        results = {}
        for o, (value, per_name) in computed.items():
            if patterns is None and not sparse:
                jacs = {i: jacrev_layout(value, r) for i, r in per_name.items()}
                results[o] = Result(value, joined(plan, value, jacs), info=info)
                continue
            flat = np.hstack([flat_rows(per_name[i]) for i in plan.wrt])
            full = (sp.csr_array(flat) if patterns is None else
                    colouring.from_rows(patterns[o], self.colours.rows[o], flat,
                                        dense=not sparse))
            results[o] = _result(plan, value, full, {i: row_template(r) for i, r in
                                                     per_name.items()}, sparse, info)
        return results[outputs] if isinstance(outputs, str) else results

    def _forward_results(self, sparse: bool, outputs: str | Sequence[str], info: CallInfo,
                         k: int, computed: dict) -> Any:
        plan, patterns = self.plan, self.colours.patterns
        info = replace(info, passes=k)
        results = {}
        for o, (value, t) in computed.items():
            for leaf in differentiable_leaves(value):
                if jnp.iscomplexobj(leaf):
                    raise DAGError(f"output {o!r} is complex ({jnp.result_type(leaf)}): a "
                                   f"Jacobian needs real outputs, as jax.jacrev does")
            pushed = [np.asarray(leaf).reshape(k, -1) for leaf in
                      jax.tree.leaves(t[jvp_graph.TANGENT])]
            passes = np.hstack(pushed) if pushed else np.zeros((k, 0))
            if patterns is None:
                full = passes.T
            else:
                if patterns[o].shape[0] != passes.shape[1]:
                    raise DAGError(f"the sparsity pattern of output {o!r} has "
                                   f"{patterns[o].shape[0]} rows, but the output has "
                                   f"{passes.shape[1]} elements", argument="sparsity")
                full = colouring.from_columns(patterns[o], self.colours.columns, passes,
                                              dense=not sparse)
            results[o] = _result(plan, value, full, self.templates or {}, sparse, info)
        return results[outputs] if isinstance(outputs, str) else results


def _result(plan: Plan, value: PyTree, full: Any, templates: dict, sparse: bool,
            info: CallInfo) -> Result:
    """One output's :class:`~daskdag.Result` from its Jacobian over every wrt name's elements
    (:func:`~daskdag.model.jacobian_layout.laid_out`)."""
    widths = {i: size(t) for i, t in templates.items()}
    return Result(value, laid_out(plan, value, full, templates, widths, sparse), info=info)


def _given_patterns(plan: Plan, values: dict, sparsity: Any, outputs: str | Sequence[str],
                    traces: dict[str, Traced] | None = None) -> dict[str, sp.csr_array]:
    """The patterns the user gave, checked before anything runs against the inputs' elements
    and the outputs' (from their shapes traced abstractly, where a node's code can be traced:
    :func:`daskdag.graph.sparsity.shapes`, which fills ``traces`` with their jaxprs)."""
    widths = {i: size(values[i]) for i in plan.wrt if i in values}
    avals = shapes(plan, values, traces)
    elements = {o: size(avals[o]) for o in plan.outputs if avals.get(o, UNKNOWN) is not UNKNOWN}
    return user_patterns(plan, widths, elements, sparsity, outputs)


def _mode(plan: Plan, values: dict, mode: str, colours: Colours,
          traces: dict[str, Traced] | None) -> tuple[str, str]:
    """The mode and why it was taken: the one asked for, or for ``"auto"`` the one with fewer
    passes, forward on a tie (:func:`_preferred`), unless some node cannot take it
    (:func:`_cannot`: then the other); a :class:`DAGError` when the mode asked for, or every
    mode, cannot serve the call. ``traces``: the nodes' jaxprs where an earlier step traced
    them all, else None. A mode's check through JAX's rules (each node's JVP or VJP traced on
    shapes) runs only where the mode could be taken, your own rules' always."""
    wrt_nodes = nodes_in_wrt(plan.spec, plan.wrt, "forward mode differentiates")
    avals = None
    if traces is None:  # ("auto" traces every node, as it counts elements; see _explicitly)
        traces = {}
        avals = shapes(plan, values, traces, only=None if mode == "auto" else _explicitly(plan))
    found: dict[tuple[str, bool], list[str]] = {}

    def why_not(m: str, traced: bool = True) -> list[str]:
        """What keeps mode ``m`` from the call; without ``traced``, only what costs no trace
        (``wrt``, your own rules)."""
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
        because = (f"the only mode that can serve this call: {MODE_NAMES[other]} mode cannot: "
                   + "; ".join(against))
    if colours.patterns is not None:
        colours.used = "columns" if taken == "fwd" else "rows"
    return taken, because


MODE_NAMES = {"fwd": "forward", "rev": "reverse"}


def _preferred(plan: Plan, values: dict, colours: Colours, avals: dict | None
               ) -> tuple[str, str]:
    """The mode with fewer passes, forward on a tie, and why: per colour of a sparse
    Jacobian's columns or rows, else per input or output element (``avals``: the values'
    shapes where they were traced); reverse where the outputs' elements are unknown."""
    if colours.patterns is not None:
        rev = sum(colouring.count(c) for c in colours.rows.values())
        fwd = colouring.count(colours.columns)
        return "fwd" if fwd <= rev else "rev", _fewer(fwd, rev, "colours of columns",
                                                      "colours of rows")
    avals = shapes(plan, values) if avals is None else avals
    if any(avals[o] is UNKNOWN for o in plan.outputs):
        unknown = [n for n in plan.needed if avals[n] is UNKNOWN
                   and all(avals[d] is not UNKNOWN for d in plan.spec.nodes[n].deps)]
        return "rev", (f"reverse when the outputs' elements cannot be counted: node(s) {unknown} "
                       f"cannot be traced on shapes")
    rev = sum(size(avals[o]) for o in plan.outputs)
    fwd = sum(size(values[i]) for i in plan.wrt)
    return "fwd" if fwd <= rev else "rev", _fewer(fwd, rev, "input elements", "output elements")


def _fewer(fwd: int, rev: int, columns: str, rows: str) -> str:
    """Why auto took the mode with fewer passes: forward's ``fwd`` passes (one per column: its
    ``columns``) against reverse's ``rev`` (one per row)."""
    counts = f"{fwd} passes forward ({columns}) against {rev} reverse ({rows})"
    return f"forward on a tie: {counts}" if fwd == rev else f"fewer passes: {counts}"


def _explicitly(plan: Plan) -> list[str]:
    """The nodes a mode asked for traces to check that they can take it: those whose function
    is a ``jax.custom_jvp`` or ``jax.custom_vjp``, whose rules are in question (with the nodes
    before them, for their shapes). Other nodes' code does not run once more for the check."""
    return [n for n in plan.needed if n in plan.active and
            isinstance(function_of(plan.spec.nodes[n]), (jax.custom_jvp, jax.custom_vjp))]


def _cannot(plan: Plan, traces: dict[str, Traced], forward: bool) -> list[str]:
    """What keeps the call from forward (``forward``) or reverse mode, node by node in order:
    a node of your own code without the rule (:func:`daskdag.model.request.rules_missing`), or
    a node whose jaxpr (in ``traces``) JAX cannot differentiate that way (a ``jax.custom_vjp``
    function has no forward rule; a ``jax.custom_jvp`` rule through ``jax.pure_callback``
    cannot be transposed). A node not traced gives no verdict."""
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


def _templates(plan: Plan, values: dict) -> dict:
    """Per wrt input, its differentiable leaves' shapes and dtypes (``None`` elsewhere)."""
    return {i: jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
                            if is_differentiable(a) else None, values[i]) for i in plan.wrt}
