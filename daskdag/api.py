"""The public calls, each a derivative kind (:mod:`daskdag.kinds`) in one of its forms: now
(``compute_grads``, ``jacobian``...), lazily as a Dask collection (``grads``...), and over many
items (``sweep_grads``...); prepared once and called many times: :mod:`daskdag.prepared`. Every
form of every kind takes ``store=``, runs on threads or any cluster, and reuses its preparation
and unchanged nodes from call to call: one program each (:mod:`daskdag.running.passes`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

from daskdag.durable import calls as durable
from daskdag.graph.sparsity import size as size_of
from daskdag.kinds.gradients import Gradients, Result
from daskdag.kinds.hessians import HVPResult, HVPs
from daskdag.kinds.jacobians import Jacobian, jacobian_patterns, split_columns
from daskdag.kinds.tangents import JVPResult, JVPs
from daskdag.model.leaves import PyTree
from daskdag.model.request import given_values
from daskdag.running.jobs import call, lazy
from daskdag.running.lazy import Call
from daskdag.running.passes import Derivative
from daskdag.running.programs import Held, where
from daskdag.sweeps import sweep as sweeps
from daskdag.sweeps.store import SweepStore

if TYPE_CHECKING:
    import scipy.sparse as sp
    from distributed import Client
    from zarr.abc.store import Store as ZarrStore

__all__ = ["Result", "JVPResult", "HVPResult"]


def now(kind: Derivative, x: PyTree, *data: Any, client: Client | None,
        scheduler: str | Client | None, progress: bool, store: Any = None,
        held: Held | None = None) -> Any:
    """A call of ``kind`` computed now, where ``client`` and ``scheduler`` say, kept in
    ``store`` where one is given (:mod:`daskdag.durable.calls`); ``held``: a prepared
    function's programs (:func:`daskdag.running.jobs.call`)."""
    client, local = where(client, scheduler)
    if store is not None:
        return durable.call(kind, x, *data, client=client, local=local, progress=progress,
                            store=store)
    return call(kind, x, *data, client=client, local=local, progress=progress, held=held)


def later(kind: Derivative, x: PyTree, *data: Any, store: Any = None) -> Call:
    """A call of ``kind`` as a Dask collection, its stages kept in ``store`` where one is given."""
    if store is not None:
        return durable.lazy(kind, x, *data, store=store)
    return lazy(kind, x, *data)


def swept(kind: Derivative, xs: PyTree, *data: Any, batched: Sequence[str] | None,
          chunk_size: int | None, client: Client | None, scheduler: str | Client | None,
          progress: bool, errors: str, store: Any) -> Any:
    """``kind`` over every item of ``xs`` (:func:`daskdag.sweeps.sweep.of_kind`). Ctrl-C with a
    store raises :class:`~daskdag.sweeps.sweep.Interrupted`, which says what is saved: the
    public function raises it again as a ``KeyboardInterrupt``, without daskdag's frames."""
    client, local = where(client, scheduler)
    return sweeps.of_kind(kind, xs, data, batched=batched, chunk_size=chunk_size, client=client,
                          local=local, progress=progress, errors=errors, store=store)


@overload  # (a str is a Sequence[str] too: the first that fits, str, wins)
def compute_grads(dag: Mapping[str, Any], x: PyTree, outputs: str, *,
                  wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
                  client: Client | None = None, scheduler: str | Client | None = None,
                  progress: bool = False,
                  store: str | os.PathLike | ZarrStore | None = None) -> Result: ...


@overload
def compute_grads(dag: Mapping[str, Any], x: PyTree, outputs: Sequence[str], *,
                  wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
                  client: Client | None = None, scheduler: str | Client | None = None,
                  progress: bool = False,
                  store: str | os.PathLike | ZarrStore | None = None) -> dict[str, Result]: ...


def compute_grads(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
                  wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
                  client: Client | None = None, scheduler: str | Client | None = None,
                  progress: bool = False, store: str | os.PathLike | ZarrStore | None = None
                  ) -> Result | dict[str, Result]:
    """Values and gradients of ``outputs`` of ``dag``, each node computed once.

    Args:
        dag: ``{name: (fn, [deps])}`` or ``{name: daskdag.Node(fn, deps, jit=...)}``; a dep that
            is no node's name is a free input.
        x: the free input's value (any pytree of arrays) when there is one, else a mapping
            ``{input_name: value}``. With one free input, a mapping with the input's name as a
            key is that form too (``{"x": value}``), and one that reads as values for other
            names is refused (keys that all name nodes, or one array under a single other
            name): ``{"x": that mapping}`` gives it as the value.
        outputs: node names; a single name returns a single [`Result`][daskdag.Result].
        wrt: input names to differentiate; default every given input with a floating-point
            leaf. Within an input, floating-point (and complex) array leaves are
            differentiated, other leaves (ints, bools, functions) held constant. Node
            names too: their gradient is d output / d the node's value (its cotangent in
            the same backward pass; zeros where the output does not depend on it).
        cotangents: ``{output: ct}`` seeds for outputs that are not real scalars (scalars get 1).
        client: a ``distributed.Client``; default the active one, else Dask's threaded scheduler.
        scheduler: as Dask's own ``scheduler=``: ``"threads"`` or ``"sync"`` run in this process
            even while a default client exists; a ``distributed.Client`` is ``client=``.
        progress: show Dask's progress bar over the call's tasks (``dask.diagnostics.ProgressBar``
            on the local scheduler, ``distributed.progress``'s text bar on a cluster).
        store: a directory (made if missing) or a Zarr store object, where the task that
            computed each stage writes its forward result (its nodes' values and the residuals
            its backward pass needs) durably as it finishes, so that the call outlives its
            client and scheduler: the same call with the same store runs only the stages the
            store lacks, and returns what an uninterrupted call returns, bit for bit. A store
            holding another call (a node, input, output, ``wrt``, cotangent or setting changed,
            an array changed in place included) is refused (see Raises). Default None: nothing
            is kept. See the guide "Durable calls".

    Returns:
        ``{output: Result(value, grad)}`` (a single name: one [`Result`][daskdag.Result]);
            each gradient has its input's (or node's) structure, with ``None`` at the leaves
            held constant, and JAX arrays of the leaves' JAX dtypes (as ``jax.grad`` gives them:
            float32 for a Python float), whether JAX or a node's own NumPy rule computed them.
            [`grads`][daskdag.grads] is the same call, not computed yet.

    Raises:
        DAGError: a malformed call, naming the node, input or output concerned.
        NodeError: a node raised, in its forward or backward pass.
        ClusterError: the cluster cannot run the graph: a client that is not running, no worker
            within ``daskdag.worker-wait``, a resource no worker offers, versions that differ.
        StoreError: with ``store``: it holds another call (naming what changed), or is in use,
            or is not a daskdag store, or its disk is full (the stages written before stay usable).

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    res = daskdag.compute_grads(dag, jnp.arange(3.0), ["A", "B"], cotangents={"A": jnp.ones(3)})
    print(res["B"].value, res["B"].grad)  # sum(sin(x)**2), sin(2x)
    ```
    """
    return now(Gradients(dag, outputs, wrt, cotangents), x, client=client,
               scheduler=scheduler, progress=progress, store=store)


def grads(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
          wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
          store: str | os.PathLike | ZarrStore | None = None) -> Call:
    """[`compute_grads`][daskdag.compute_grads], not computed yet: a Dask collection (``Call``)
    whose ``.compute()`` returns what that returns; ``dask.compute``, ``dask.persist`` and
    ``.visualize()`` take it with any other Dask collection, and the forward tasks of calls
    computed together are shared. It runs where Dask runs it: the default ``distributed``
    client in effect at compute time (checked then, as the eager call checks it), else the
    scheduler passed to ``compute``, else threads. (The eager call on a cluster also keeps the
    call's inputs and nodes there for the next calls; a lazy call carries them in its graph.)

    For example:

    ```python
    import dask
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    call = daskdag.grads(dag, jnp.arange(3.0), "B")
    res, total = dask.compute(call, dask.delayed(sum)([1, 2]))
    print(res.grad, total)
    ```
    """
    return later(Gradients(dag, outputs, wrt, cotangents), x, store=store)


@overload  # (a str is a Sequence[str] too: the first that fits, str, wins)
def sweep_grads(dag: Mapping[str, Any], xs: PyTree, outputs: str, *,
                batched: Sequence[str] | None = None, wrt: Sequence[str] | None = None,
                cotangents: Mapping[str, PyTree] | None = None, chunk_size: int | None = None,
                client: Client | None = None, scheduler: str | Client | None = None,
                progress: bool = False, errors: str = "raise",
                store: str | os.PathLike | SweepStore | ZarrStore | None = None
                ) -> Result: ...


@overload
def sweep_grads(dag: Mapping[str, Any], xs: PyTree, outputs: Sequence[str], *,
                batched: Sequence[str] | None = None, wrt: Sequence[str] | None = None,
                cotangents: Mapping[str, PyTree] | None = None, chunk_size: int | None = None,
                client: Client | None = None, scheduler: str | Client | None = None,
                progress: bool = False, errors: str = "raise",
                store: str | os.PathLike | SweepStore | ZarrStore | None = None
                ) -> dict[str, Result]: ...


def sweep_grads(dag: Mapping[str, Any], xs: PyTree, outputs: str | Sequence[str], *,
                batched: Sequence[str] | None = None, wrt: Sequence[str] | None = None,
                cotangents: Mapping[str, PyTree] | None = None, chunk_size: int | None = None,
                client: Client | None = None, scheduler: str | Client | None = None,
                progress: bool = False, errors: str = "raise",
                store: str | os.PathLike | SweepStore | ZarrStore | None = None
                ) -> Result | dict[str, Result]:
    """[`compute_grads`][daskdag.compute_grads] for every item of a batch, in chunks over the
    cluster.

    Args:
        xs: like ``x`` of [`compute_grads`][daskdag.compute_grads], the ``batched`` inputs
            carrying a leading item axis of one common length N.
        batched: the inputs that carry it (default: all given); the others are shared by every
            item and sent to each worker once.
        wrt: default every batched input with floating leaves. A shared input named here gets
            a gradient per item; a node, its gradient per item (as for compute_grads).
        cotangents: ``{output: ct}`` for outputs that are not real scalars, shaped like one
            item's output; the same for every item.
        client: as for [`compute_grads`][daskdag.compute_grads].
        scheduler: as for [`compute_grads`][daskdag.compute_grads] (``"sync"``: one chunk at a
            time).
        chunk_size: items per chunk (default: about four chunks per worker thread, at most 256;
            when every node that carries items is ``vmap=True``, one chunk per worker thread,
            at most 64 MiB of items each). Within a chunk, ``Node(vmap=True)`` nodes run
            vectorized, others item by item.
        progress: a progress bar over the items on stderr (Dask's text bar, as a call's); it
            advances as items finish inside running chunks, and ends at the number computed.
        errors: ``'raise'``: the first failing item's [`NodeError`][daskdag.NodeError], naming
            the item and node. ``'collect'``: every item that succeeded, and in
            ``Result.failed`` the ones that did not; their rows hold NaN.
        store: a directory (made if missing), a Zarr store object (an object store...) or a
            [`SweepStore`][daskdag.SweepStore], where each chunk's values, gradients and failed
            items are written durably as the chunk finishes, so that the sweep outlives this
            process: the same call with the same store computes only the chunks it lacks, and
            returns what an uninterrupted sweep returns. A store holding another sweep (another
            DAG, other inputs, outputs or settings) raises [`StoreError`][daskdag.StoreError]
            naming what changed, as does one another sweep is writing to, or a location holding
            something else. Its chunk size is the store's; without ``chunk_size``, items
            computed one by one (no ``vmap=True`` node) are written in pieces of about 10 s of
            work, so that an interrupt early in a long sweep finds something saved. With
            dask-array items, or ``SweepStore(..., lazy=True)``, the results are dask arrays
            reading the store. See the sweeps guide, "Durable sweeps".

    Returns:
        ``{output: Result(value, grad, failed)}``, values and gradients as NumPy arrays
            stacked on a leading axis of length N (gradients shaped ``(N, *input item shape)``,
            values ``(N, *item output shape)``).

    When no item gives a result (N = 0, or every item failed with ``errors='collect'``), the
    shapes come from tracing the nodes with ``jax.eval_shape`` on one item's shapes (a node's
    Python code runs once, on abstract values): gradients are always shaped (zero or NaN rows),
    values too unless a node on the way cannot be traced abstractly (Python control flow on
    values, ``float(x)``, non-JAX code): then that output's ``value`` is ``None``.

    Ctrl-C (``KeyboardInterrupt``) stops the sweep: chunks that have not started never do,
    running ones stop after their current item, on threads and on a cluster. With a store,
    what was computed is written first, and the ``KeyboardInterrupt`` says how much: "N of M
    items saved in STORE; run the same call again to resume".

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    xs = jnp.arange(12.0).reshape(4, 3)  # 4 items of 3
    res = daskdag.sweep_grads(dag, xs, "B")
    print(res.value.shape, res.grad.shape)  # (4,) (4, 3)
    ```
    """
    try:
        return swept(Gradients(dag, outputs, wrt, cotangents), xs, batched=batched,
                     chunk_size=chunk_size, client=client, scheduler=scheduler,
                     progress=progress, errors=errors, store=store)
    except sweeps.Interrupted as e:  # (Ctrl-C: what is saved)
        raise KeyboardInterrupt(str(e)) from None


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

    Arguments as for [`compute_grads`][daskdag.compute_grads]; outputs: any real arrays or pytrees.

    Args:
        mode: ``"rev"`` pulls the identity's rows over each output's elements back through each
            node's pullback under ``jax.vmap`` (one pass per output element; every output passing
            through a stage goes in one call); ``"fwd"`` pushes the identity's columns over the
            inputs' elements forward through each node's JVP under ``jax.vmap`` (one pass per input
            element, as ``jax.jacfwd``; free inputs only, and nodes of your own code need ``jvp=``).
            ``"auto"`` (default) takes the one with fewer passes, forward on a tie (as OpenMDAO
            does; forward keeps no residuals and runs one task per stage), among the modes every
            node can take. To count the outputs' elements it traces the nodes on shapes once (no
            arithmetic; an eager node's Python code runs once more, on abstract values; later calls
            with the same DAG and shapes reuse the count); where a node cannot be traced, reverse.
            The same trace says which mode a node cannot take: forward through a ``jax.custom_vjp``
            function, reverse through a ``jax.custom_jvp`` rule that cannot be transposed (a
            ``jax.pure_callback``), or either without your own rule (``vjp=``, ``jvp=``). An
            explicit mode checks your rules and the nodes whose function is a ``jax.custom_jvp`` or
            ``jax.custom_vjp`` (traced with the nodes before them). ``Result.info.mode`` is the mode
            taken, ``Result.info.mode_why`` why.
        sparsity: the Jacobian's pattern, so that one pass serves many rows (reverse) or
            columns (forward): those a greedy colouring groups, sharing no column (row). A
            boolean array (NumPy or ``scipy.sparse``) shaped ``(output elements, input
            elements)``, over the differentiable leaves in ``jax.tree.leaves`` order, each
            flattened in C order; with several outputs ``{output: ...}``, with several inputs
            ``{input: ...}`` (per output). A True where the Jacobian is zero costs passes; a
            False where it is not gives a wrong Jacobian. ``"detect"`` finds it
            ([`jacobian_sparsity`][daskdag.jacobian_sparsity]); the mode then counts colours.
        sparse: return each Jacobian as a ``scipy.sparse.csr_array`` ``(output elements, input
            elements)`` (``{input: ...}`` with several inputs) instead of the dense layout.
        chunk_size: rows (reverse) or columns (forward) per ``jax.vmap`` call (default: all of
            them). A call holds about ``chunk_size`` times a stage's residuals (reverse) or values
            (forward): pass fewer to bound memory. In forward mode each chunk runs a node's function
            once more. A pullback that cannot be vmapped (a host callback) runs row by row.
        store: as for [`compute_grads`][daskdag.compute_grads]: each stage's forward result
            kept as it finishes (reverse: values and residuals; forward: values and tangents);
            the mode, pattern and ``chunk_size`` are part of what the store records.

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
    return now(Jacobian(dag, outputs, wrt, mode, sparsity, sparse, chunk_size), x,
               client=client, scheduler=scheduler, progress=progress, store=store)


def jacobians(dag: Mapping[str, Any], x: PyTree, outputs: str | Sequence[str], *,
              wrt: Sequence[str] | None = None,
              mode: str = "auto", sparsity: Any = None, sparse: bool = False,
              chunk_size: int | None = None,
              store: str | os.PathLike | ZarrStore | None = None) -> Call:
    """[`jacobian`][daskdag.jacobian], not computed yet: a Dask collection, as
    [`grads`][daskdag.grads] is (``store`` too).

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    print(daskdag.jacobians(dag, jnp.arange(3.0), "A").compute().grad.shape)  # (3, 3)
    ```
    """
    return later(Jacobian(dag, outputs, wrt, mode, sparsity, sparse, chunk_size), x,
                 store=store)


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
    plan, found = jacobian_patterns(dag, x, outputs, wrt)
    widths = {i: size_of(v) for i, v in given_values(plan.spec, x).items() if i in plan.wrt}
    out = {o: split_columns(p, plan.wrt, widths) for o, p in found.items()}
    out = {o: p[plan.wrt[0]] if len(plan.wrt) == 1 else p for o, p in out.items()}
    return out[outputs] if isinstance(outputs, str) else out


@overload  # (a str is a Sequence[str] too: the first that fits, str, wins)
def compute_jvps(dag: Mapping[str, Any], x: PyTree, tangents: PyTree, outputs: str,
                 *, wrt: Sequence[str] | None = None, batched: bool = False,
                 client: Client | None = None,
                 scheduler: str | Client | None = None, progress: bool = False,
                 store: str | os.PathLike | ZarrStore | None = None) -> JVPResult: ...


@overload
def compute_jvps(dag: Mapping[str, Any], x: PyTree, tangents: PyTree, outputs: Sequence[str],
                 *, wrt: Sequence[str] | None = None, batched: bool = False,
                 client: Client | None = None,
                 scheduler: str | Client | None = None, progress: bool = False,
                 store: str | os.PathLike | ZarrStore | None = None) -> dict[str, JVPResult]: ...


def compute_jvps(dag: Mapping[str, Any], x: PyTree, tangents: PyTree, outputs: str | Sequence[str],
                 *, wrt: Sequence[str] | None = None, batched: bool = False,
                 client: Client | None = None,
                 scheduler: str | Client | None = None, progress: bool = False,
                 store: str | os.PathLike | ZarrStore | None = None
                 ) -> JVPResult | dict[str, JVPResult]:
    """Values and Jacobian-vector products (forward mode) of ``outputs`` of ``dag``, each node
    computed once.

    The other arguments as for [`compute_grads`][daskdag.compute_grads].

    Args:
        tangents: with one free input, a pytree shaped like ``x``: the tangent of each
            floating-point leaf (``None`` there means zero), ``None`` at the leaves held
            constant (ints, bools, functions); or ``{input_name: tangent}``, read as ``x`` is.
            With several inputs, a dict ``{input_name: tangent}``; the inputs left out are held
            constant. A node named in ``wrt`` takes its tangent here too (``{"B": tB, ...}``,
            shaped like its value), added at its value.
        wrt: the names that move: inputs, whose tangents are given (a name without one
            moves by zero; a tangent for another input is ignored, that input held
            constant), and nodes, at whose value the given tangent is added (the sensitivity
            to a change there, the forward twin of a node's gradient: see the guide
            "Sensitivities at nodes"). Default: the inputs ``tangents`` names.
        batched: every tangent leaf has a leading axis of K directions, and so has every
            output's tangent, ``(K, *output shape)``: with the identity as the K directions,
            row ``k`` is the Jacobian's column ``k``, so the whole is the transpose of
            ``jax.jacfwd``'s Jacobian (which puts the output's axes first). Each node's jvp
            runs under ``jax.vmap`` over the directions (its function still runs once), or once
            per direction where it cannot be vmapped (non-JAX code under its own JVP rule).
        store: as for [`compute_grads`][daskdag.compute_grads]: each stage's values and
            tangents kept as they finish (forward mode has no residuals to keep); the
            tangents are part of what the store records.

    Returns:
        ``{output: JVPResult(value, tangent)}`` (a single name: one
            [`JVPResult`][daskdag.JVPResult]); ``tangent`` has the output's structure, ``None`` at
            its leaves held constant, zeros where no tangent reaches it.
            [`jvps`][daskdag.jvps] is the same call, not computed yet.

    Raises:
        DAGError: a malformed call: a tangent whose structure, shape or dtype does not match
            its input (naming it), a tangent for a name that is no input.
        NodeError: a node raised; a node that ``jax.jvp`` cannot differentiate (NumPy code)
            raises there unless it gives its own ``jvp=``.
        ClusterError: as for [`compute_grads`][daskdag.compute_grads].

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    res = daskdag.compute_jvps(dag, jnp.arange(3.0), jnp.ones(3), "B")
    print(res.value, res.tangent)  # the directional derivative along ones
    ```
    """
    return now(JVPs(dag, outputs, wrt, batched), x, tangents, client=client,
               scheduler=scheduler, progress=progress, store=store)


def jvps(dag: Mapping[str, Any], x: PyTree, tangents: PyTree, outputs: str | Sequence[str], *,
         wrt: Sequence[str] | None = None, batched: bool = False,
         store: str | os.PathLike | ZarrStore | None = None) -> Call:
    """[`compute_jvps`][daskdag.compute_jvps], not computed yet: a Dask collection, as
    [`grads`][daskdag.grads] is (``store`` too).

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    print(daskdag.jvps(dag, jnp.arange(3.0), jnp.ones(3), "B").compute().tangent)
    ```
    """
    return later(JVPs(dag, outputs, wrt, batched), x, tangents, store=store)


@overload  # (a str is a Sequence[str] too: the first that fits, str, wins)
def compute_hvps(dag: Mapping[str, Any], x: PyTree, v: PyTree, outputs: str, *,
                 wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
                 client: Client | None = None, scheduler: str | Client | None = None,
                 progress: bool = False, store: str | os.PathLike | ZarrStore | None = None) -> HVPResult: ...


@overload
def compute_hvps(dag: Mapping[str, Any], x: PyTree, v: PyTree, outputs: Sequence[str], *,
                 wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
                 client: Client | None = None, scheduler: str | Client | None = None,
                 progress: bool = False,
                 store: str | os.PathLike | ZarrStore | None = None) -> dict[str, HVPResult]: ...


def compute_hvps(dag: Mapping[str, Any], x: PyTree, v: PyTree, outputs: str | Sequence[str], *,
                 wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
                 client: Client | None = None, scheduler: str | Client | None = None,
                 progress: bool = False, store: str | os.PathLike | ZarrStore | None = None
                 ) -> HVPResult | dict[str, HVPResult]:
    """Values, gradients and Hessian-vector products of ``outputs`` of ``dag``, each node
    computed once: ``jax.jvp(jax.grad(f), (x,), (v,))`` of the composed function, in one
    backward pass (reverse over forward, see ``daskdag.kinds.hessians``).

    The other arguments as for [`compute_grads`][daskdag.compute_grads].

    Args:
        v: the vector, as ``tangents`` of [`compute_jvps`][daskdag.compute_jvps] (the inputs left
            out move by zero). An input outside ``wrt`` is held constant, so its part of ``v`` is
            ignored: ``hvp`` is the Hessian over the ``wrt`` inputs times ``v``'s part on them.
        wrt: as for [`compute_grads`][daskdag.compute_grads]; a node named here takes its
            part of ``v`` (``{"B": vB, ...}``) added at its value, and its ``grad`` and
            ``hvp`` are those of a change added there.
        cotangents: as for [`compute_grads`][daskdag.compute_grads]; then ``hvp`` is the
            Hessian of ``<ct, output>`` times ``v``.
        store: as for [`compute_grads`][daskdag.compute_grads]: each stage's forward result
            (values and tangents, and the residuals of their backward pass) kept as it
            finishes; ``v`` is part of what the store records.

    Returns:
        ``{output: HVPResult(value, grad, hvp, tangent)}`` (a single name: one
            [`HVPResult`][daskdag.HVPResult]). Each node runs under ``jax.jvp`` inside
            ``jax.vjp``, so it must be twice differentiable by JAX.
            [`hvps`][daskdag.hvps] is the same call, not computed yet.

    Raises:
        DAGError: as for [`compute_grads`][daskdag.compute_grads]; also a node with its own
            derivative rules (``vjp=``, ``fwd=`` / ``bwd=``: NumPy code) on the way, naming it.
        NodeError: a node raised; a ``jax.custom_vjp`` function inside a node fails here (JAX
            has no forward mode for it).
        ClusterError: as for [`compute_grads`][daskdag.compute_grads].

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    res = daskdag.compute_hvps(dag, jnp.arange(3.0), jnp.ones(3), "B")
    print(res.grad, res.hvp)  # sin(2x), 2 cos(2x) * 1
    ```
    """
    return now(HVPs(dag, outputs, wrt, cotangents), x, v, client=client, scheduler=scheduler,
               progress=progress, store=store)


def hvps(dag: Mapping[str, Any], x: PyTree, v: PyTree, outputs: str | Sequence[str], *,
         wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
         store: str | os.PathLike | ZarrStore | None = None) -> Call:
    """[`compute_hvps`][daskdag.compute_hvps], not computed yet: a Dask collection, as
    [`grads`][daskdag.grads] is (``store`` too).

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    call = daskdag.hvps({"L": (lambda x: jnp.sum(x ** 3), ["x"])}, jnp.arange(3.0),
                        jnp.ones(3), "L")
    print(call.compute().hvp)  # 6 x: the Hessian 6 diag(x), times ones
    ```
    """
    return later(HVPs(dag, outputs, wrt, cotangents), x, v, store=store)


def sweep_jacobians(dag: Mapping[str, Any], xs: PyTree, outputs: str | Sequence[str], *,
                    batched: Sequence[str] | None = None, wrt: Sequence[str] | None = None,
                    mode: str = "auto", sparsity: Any = None, chunk_size: int | None = None,
                    client: Client | None = None, scheduler: str | Client | None = None,
                    progress: bool = False, errors: str = "raise",
                    store: str | os.PathLike | SweepStore | ZarrStore | None = None
                    ) -> Result | dict[str, Result]:
    """[`jacobian`][daskdag.jacobian] for every item of a batch, as
    [`sweep_grads`][daskdag.sweep_grads] sweeps gradients: ``jax.vmap(jax.jacrev(f))``.

    Args:
        mode: as for [`jacobian`][daskdag.jacobian], decided on one item's shapes; in forward
            mode, the identity's columns are the same for every item.
        sparsity: as for [`jacobian`][daskdag.jacobian], one item's pattern.
        chunk_size: items per chunk, as for [`sweep_grads`][daskdag.sweep_grads] (every row or
            column of an item's Jacobian goes in one pass).

    The other arguments as for [`sweep_grads`][daskdag.sweep_grads]. Returns
    ``{output: Result(value, jac, failed)}``: each item's Jacobian in ``jax.jacrev``'s
    layout, stacked on a leading axis of items.

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"])}
    res = daskdag.sweep_jacobians(dag, jnp.arange(6.0).reshape(2, 3), "A")
    print(res.grad.shape)  # (2, 3, 3): each item's diag(cos(x))
    ```
    """
    try:
        return swept(Jacobian(dag, outputs, wrt, mode, sparsity), xs, batched=batched,
                     chunk_size=chunk_size, client=client, scheduler=scheduler,
                     progress=progress, errors=errors, store=store)
    except sweeps.Interrupted as e:  # (Ctrl-C: what is saved)
        raise KeyboardInterrupt(str(e)) from None


def sweep_jvps(dag: Mapping[str, Any], xs: PyTree, tangents: PyTree, outputs: str | Sequence[str],
               *, batched: Sequence[str] | None = None, wrt: Sequence[str] | None = None,
               chunk_size: int | None = None,
               client: Client | None = None, scheduler: str | Client | None = None,
               progress: bool = False, errors: str = "raise",
               store: str | os.PathLike | SweepStore | ZarrStore | None = None
               ) -> JVPResult | dict[str, JVPResult]:
    """[`compute_jvps`][daskdag.compute_jvps] for every item of a batch:
    ``jax.vmap(lambda x, t: jax.jvp(f, (x,), (t,)))(xs, ts)``.

    Args:
        tangents: as for [`compute_jvps`][daskdag.compute_jvps]; a batched input's tangent
            carries the items too (one tangent per item, shaped like ``xs``), a shared
            input's is the same for every item.
        wrt: as for [`compute_jvps`][daskdag.compute_jvps].

    The other arguments as for [`sweep_grads`][daskdag.sweep_grads]; nodes of shared inputs
    alone, tangents included, run once for every item. Returns ``{output: JVPResult(value,
    tangent, failed)}``, stacked on a leading axis of items. (Several directions per item:
    [`sweep_jacobians`][daskdag.sweep_jacobians] with ``mode="fwd"``.)

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"])}
    xs = jnp.arange(6.0).reshape(2, 3)
    print(daskdag.sweep_jvps(dag, xs, jnp.ones_like(xs), "A").tangent)  # cos(xs)
    ```
    """
    try:
        return swept(JVPs(dag, outputs, wrt), xs, tangents, batched=batched,
                     chunk_size=chunk_size, client=client, scheduler=scheduler,
                     progress=progress, errors=errors, store=store)
    except sweeps.Interrupted as e:  # (Ctrl-C: what is saved)
        raise KeyboardInterrupt(str(e)) from None


def sweep_hvps(dag: Mapping[str, Any], xs: PyTree, v: PyTree, outputs: str | Sequence[str], *,
               batched: Sequence[str] | None = None, wrt: Sequence[str] | None = None,
               cotangents: Mapping[str, PyTree] | None = None, chunk_size: int | None = None,
               client: Client | None = None, scheduler: str | Client | None = None,
               progress: bool = False, errors: str = "raise",
               store: str | os.PathLike | SweepStore | ZarrStore | None = None
               ) -> HVPResult | dict[str, HVPResult]:
    """[`compute_hvps`][daskdag.compute_hvps] for every item of a batch:
    ``jax.vmap(lambda x, v: jax.jvp(jax.grad(f), (x,), (v,)))(xs, vs)``.

    Args:
        v: as ``tangents`` of [`sweep_jvps`][daskdag.sweep_jvps]: per item for a batched
            input, the same for every item for a shared one.

    The other arguments as for [`sweep_grads`][daskdag.sweep_grads]. Returns ``{output:
    HVPResult(value, grad, hvp, tangent, failed)}``, stacked on a leading axis of items.

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"L": (lambda x: jnp.sum(jnp.sin(x)), ["x"])}
    xs = jnp.arange(6.0).reshape(2, 3)
    print(daskdag.sweep_hvps(dag, xs, jnp.ones_like(xs), "L").hvp)  # -sin(xs)
    ```
    """
    try:
        return swept(HVPs(dag, outputs, wrt, cotangents), xs, v, batched=batched,
                     chunk_size=chunk_size, client=client, scheduler=scheduler,
                     progress=progress, errors=errors, store=store)
    except sweeps.Interrupted as e:  # (Ctrl-C: what is saved)
        raise KeyboardInterrupt(str(e)) from None
