"""A DAG as a function of its inputs, prepared once and called many times, in JAX's idiom:
:func:`grad`, :func:`value_and_grad`, :func:`value_and_jacobian`, :func:`value_and_jvp` and
:func:`value_grad_and_hvp` each return a :class:`Prepared` function, which also sweeps
(:meth:`Prepared.sweep`) and keeps its calls in a store (``f(x, store=...)``).

``f = daskdag.value_and_grad(dag, "loss")`` then ``loss, grads = f(params)`` in a loop, as
``jax.value_and_grad(loss_fn)`` would be; pytrees in and out, so ``f`` drops into an optax
loop, and with one output and one free input into ``scipy.optimize.minimize(f, x0,
jac=True)``. Each computes what the eager call it stands for computes, by the same kind of
call (:mod:`daskdag.kinds`), and holds its compiled programs as :class:`Prepared` says (the
guide "Repeated calls and optimisation loops").
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable

from daskdag.api import now, swept
from daskdag.kinds.gradients import Gradients
from daskdag.kinds.hessians import HVPs
from daskdag.kinds.jacobians import Jacobian
from daskdag.kinds.tangents import JVPs
from daskdag.model.leaves import PyTree
from daskdag.running.programs import Held, alone_here
from daskdag.running.jobs import CallInfo
from daskdag.running.passes import Derivative
from daskdag.sweeps.sweep import Interrupted

if TYPE_CHECKING:
    from distributed import Client


class Prepared:
    """A DAG's call as a function of its inputs (made by
    [`value_and_grad`][daskdag.value_and_grad] and its siblings): call it as ``f(x)``
    (``f(x, tangents)``, ``f(x, v)``), or over many items as ``f.sweep(xs)``; ``f.info`` is the
    [`CallInfo`][daskdag.CallInfo] of its latest call in this thread: the mode and passes, and
    whether the call reused an earlier call's preparation, and if not, why.

    It holds a compiled program per signature of its inputs (their structure, shapes and
    dtypes) and per place it runs, as ``jax.jit``'s wrapper holds its executables: a call asks
    that program whether anything it relies on changed (the DAG's entries, the settings, what
    its node functions hold), and runs it.
    """

    def __init__(self, name: str, kind: Derivative, unpack: Callable[[Any], tuple],
                 outputs: str | Sequence[str], client: Client | None,
                 scheduler: str | Client | None, progress: bool) -> None:
        self._name, self._kind, self._unpack, self._outputs = name, kind, unpack, outputs
        self._client, self._scheduler, self._progress = client, scheduler, progress
        self._here = client is None and scheduler is None and not progress  # (may run alone)
        self._last = threading.local()
        self._held = Held(self._shaped)

    def __call__(self, x: PyTree, *data: PyTree, store: Any = None) -> Any:
        """The call for inputs ``x`` (and its data: tangents, ``v``); ``store`` as
        [`compute_grads`][daskdag.compute_grads]'s ``store=``."""
        if store is None and not data and self._here and alone_here():
            entry = self._held.entry(x)
            if entry is not None:  # (a warm call of one program here: its entry alone)
                self._last.info, self._last.failed = entry.info, {}
                return entry(x)
        return self._unpacked(now(self._kind, x, *data, client=self._client,
                                  scheduler=self._scheduler, progress=self._progress,
                                  store=store, held=self._held))

    def sweep(self, xs: PyTree, *data: PyTree, batched: Sequence[str] | None = None,
              chunk_size: int | None = None, errors: str = "raise", store: Any = None) -> Any:
        """The call for every item of ``xs`` (and of its data, where a batched input's carry the
        items too), as [`sweep_grads`][daskdag.sweep_grads] and its siblings sweep: ``batched``,
        ``chunk_size``, ``errors`` and ``store`` as there. Returns what a call returns, each part
        stacked over the items; with ``errors='collect'``, ``f.failed`` says which items failed."""
        try:
            results = swept(self._kind, xs, *data, batched=batched, chunk_size=chunk_size,
                            client=self._client, scheduler=self._scheduler,
                            progress=self._progress, errors=errors, store=store)
        except Interrupted as e:  # (Ctrl-C: what is saved, without daskdag's frames)
            raise KeyboardInterrupt(str(e)) from None
        return self._unpacked(results)

    def _unpacked(self, results: Any) -> Any:
        first = results if isinstance(self._outputs, str) else next(iter(results.values()))
        self._last.info, self._last.failed = first.info, dict(first.failed) if first.failed else {}
        return self._shaped(results)

    def _shaped(self, results: Any) -> Any:
        """A call's ``results`` as this function returns them."""
        if isinstance(self._outputs, str):
            out = self._unpack(results)
        else:
            parts = [self._unpack(r) for r in results.values()]
            out = tuple({o: p[k] for o, p in zip(results, parts)} for k in range(len(parts[0])))
        return out[0] if len(out) == 1 else out

    @property
    def info(self) -> CallInfo | None:
        """How this function's latest call in this thread was computed (None before any)."""
        return getattr(self._last, "info", None)

    @property
    def failed(self) -> dict:
        """The items that failed in this function's latest sweep in this thread, with their
        [`NodeError`][daskdag.NodeError] (``errors='collect'``); empty otherwise."""
        return getattr(self._last, "failed", {})

    def __repr__(self) -> str:
        return f"daskdag.{self._name}(outputs={self._outputs!r})"


def grad(dag: Mapping[str, Any], outputs: str | Sequence[str], *,
         wrt: Sequence[str] | None = None, cotangents: Mapping[str, PyTree] | None = None,
         client: Client | None = None, scheduler: str | Client | None = None,
         progress: bool = False) -> Prepared:
    """``dag`` as a function ``f(x) -> grads``, as ``jax.grad`` of the composed function: as
    [`value_and_grad`][daskdag.value_and_grad], without the values.

    Returns:
        A [`Prepared`][daskdag.Prepared] function: ``f(x)`` returns the gradient for a single
            output name (shaped like ``x`` with one free input, else ``{input: grad}``), else
            ``{output: grad}``.

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "L": (lambda a: jnp.sum(a ** 2), ["A"])}
    print(daskdag.grad(dag, "L")(jnp.arange(3.0)))  # sin(2x)
    ```
    """
    return Prepared("grad", Gradients(dag, outputs, wrt, cotangents), lambda r: (r.grad,),
                    outputs, client, scheduler, progress)


def value_and_grad(dag: Mapping[str, Any], outputs: str | Sequence[str], *,
                   wrt: Sequence[str] | None = None,
                   cotangents: Mapping[str, PyTree] | None = None, client: Client | None = None,
                   scheduler: str | Client | None = None, progress: bool = False) -> Prepared:
    """``dag`` as a function ``f(x) -> (values, grads)``, as ``jax.value_and_grad`` of the
    composed function.

    Arguments as for [`compute_grads`][daskdag.compute_grads] (``cotangents``: the same at every
    call; ``client`` None: the default client in effect at each call, else Dask's threads).

    Returns:
        A [`Prepared`][daskdag.Prepared] function. ``f(x)`` returns ``(value, grad)`` for a
            single output name (``grad`` shaped like ``x`` with one free input, else
            ``{input: grad}``), else ``({output: value}, {output: grad})``. It raises as
            [`compute_grads`][daskdag.compute_grads] does.

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "L": (lambda a: jnp.sum(a ** 2), ["A"])}
    f = daskdag.value_and_grad(dag, "L")
    for step in range(3):
        loss, grad = f(jnp.arange(3.0) + step)
    print(loss, grad, f.info.prepared)  # the later calls reuse the first one's preparation
    ```
    """
    return Prepared("value_and_grad", Gradients(dag, outputs, wrt, cotangents),
                    lambda r: (r.value, r.grad), outputs, client, scheduler, progress)


def value_and_jacobian(dag: Mapping[str, Any], outputs: str | Sequence[str], *,
                       wrt: Sequence[str] | None = None, mode: str = "auto", sparsity: Any = None,
                       sparse: bool = False, chunk_size: int | None = None,
                       client: Client | None = None, scheduler: str | Client | None = None,
                       progress: bool = False) -> Prepared:
    """``dag`` as a function ``f(x) -> (values, jacobians)``, as ``jax.jacrev`` (or
    ``jax.jacfwd``) of the composed function, with its values.

    Arguments as for [`jacobian`][daskdag.jacobian] (``client`` as for
    [`value_and_grad`][daskdag.value_and_grad]). ``mode="auto"`` decides at the first call,
    and again only when the inputs' shapes or the DAG change; ``sparsity="detect"`` detects
    the pattern at the first call, and later calls reuse it (unless a node's pattern had to be
    probed at the point: then at every call).

    Returns:
        A [`Prepared`][daskdag.Prepared] function: ``f(x)`` returns ``(value, jac)`` for a
            single output name, else ``({output: value}, {output: jac})``, each ``jac`` in
            ``jax.jacrev``'s layout (or ``scipy.sparse`` with ``sparse=True``), as
            [`jacobian`][daskdag.jacobian] gives it.

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: a[:2] * a[1:], ["A"])}
    f = daskdag.value_and_jacobian(dag, "B")
    value, jac = f(jnp.arange(3.0))
    print(jac.shape, f.info.mode)  # (2, 3): reverse, 2 rows against 3 columns
    ```
    """
    return Prepared("value_and_jacobian",
                    Jacobian(dag, outputs, wrt, mode, sparsity, sparse, chunk_size),
                    lambda r: (r.value, r.grad), outputs, client, scheduler, progress)


def value_and_jvp(dag: Mapping[str, Any], outputs: str | Sequence[str], *,
                  wrt: Sequence[str] | None = None, batched: bool = False,
                  client: Client | None = None, scheduler: str | Client | None = None,
                  progress: bool = False) -> Prepared:
    """``dag`` as a function ``f(x, tangents) -> (values, tangents out)``, as ``jax.jvp`` of
    the composed function.

    Arguments as for [`compute_jvps`][daskdag.compute_jvps] (``client`` as for
    [`value_and_grad`][daskdag.value_and_grad]).

    Returns:
        A [`Prepared`][daskdag.Prepared] function: ``f(x, tangents)`` returns ``(value,
            tangent)`` for a single output name, else ``({output: value}, {output: tangent})``;
            ``tangents`` as [`compute_jvps`][daskdag.compute_jvps] takes them.

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "B": (lambda a: jnp.sum(a ** 2), ["A"])}
    f = daskdag.value_and_jvp(dag, "B")
    value, tangent = f(jnp.arange(3.0), jnp.ones(3))
    print(value, tangent)
    ```
    """
    return Prepared("value_and_jvp", JVPs(dag, outputs, wrt, batched),
                    lambda r: (r.value, r.tangent), outputs, client, scheduler, progress)


def value_grad_and_hvp(dag: Mapping[str, Any], outputs: str | Sequence[str], *,
                       wrt: Sequence[str] | None = None,
                       cotangents: Mapping[str, PyTree] | None = None,
                       client: Client | None = None, scheduler: str | Client | None = None,
                       progress: bool = False) -> Prepared:
    """``dag`` as a function ``f(x, v) -> (values, grads, hvps)``: the gradients and the
    Hessian-vector products along ``v``, as [`compute_hvps`][daskdag.compute_hvps] gives them (for
    ``scipy.optimize.minimize``'s ``hessp``, or a Newton-CG step).

    Arguments as for [`compute_hvps`][daskdag.compute_hvps] (``cotangents``: the same at
    every call; ``client`` as for [`value_and_grad`][daskdag.value_and_grad]).

    Returns:
        A [`Prepared`][daskdag.Prepared] function: ``f(x, v)`` returns ``(value, grad, hvp)``
            for a single output name, else three dicts ``{output: ...}``.

    For example:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"A": (jnp.sin, ["x"]), "L": (lambda a: jnp.sum(a ** 2), ["A"])}
    f = daskdag.value_grad_and_hvp(dag, "L")
    value, grad, hvp = f(jnp.arange(3.0), jnp.ones(3))
    print(hvp)  # 2 cos(2x), the Hessian's diagonal here
    ```
    """
    return Prepared("value_grad_and_hvp", HVPs(dag, outputs, wrt, cotangents),
                    lambda r: (r.value, r.grad, r.hvp), outputs, client, scheduler, progress)
