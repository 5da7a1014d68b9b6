"""Implicit nodes (:class:`Implicit`: ``u`` solving ``residual(u, *deps) = 0``) and coupled
groups (:func:`coupled`: nodes that depend on each other, solved together).

A node's function is a :class:`Solve`: ``jax.lax.custom_root`` of the residual, from whose
implicit-function rule JAX derives every derivative kind and ``vmap``. The linear solves are dense
up to :data:`DENSE_UNKNOWNS` unknowns, else GMRES on Jacobian-vector products.

A solve that misses its tolerance raises :class:`~daskdag.errors.SolveError`. Each solve run on
values is recorded for the call's ``info.solves``: into the call's record in this process
(:func:`recording`), or from a worker's task through its event log under :data:`TOPIC`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from daskdag.cancel import current_task
from daskdag.errors import DAGError, SolveError, raised_in_program
from daskdag.transport.fingerprints import fingerprint
from daskdag.transport.weak import held

DENSE_UNKNOWNS = 512  # unknowns up to which the linear solves ("auto") are dense
SOLVERS = ("newton", "gauss-seidel")
LINEAR_SOLVERS = ("auto", "dense", "gmres")


@dataclass(frozen=True, eq=False)  # (an entry is itself: its guess may be an array)
class Implicit:
    """A DAG entry whose value ``u`` solves ``residual(u, *deps) = 0`` (an equilibrium, a steady
    state), solved by Newton's method by default and differentiated by the implicit function
    theorem: one linear solve with the residual's Jacobian in ``u``, never through the solver.

    Attributes:
        residual: ``residual(u, *values of deps)``, a JAX function (traceable: it is traced
            into the solve) returning a pytree shaped like ``u``.
        deps: the names of its deps, as a [`Node`][daskdag.Node]'s.
        guess: where the solve starts: a pytree of arrays shaped like ``u`` (its structure,
            shapes and dtypes are the solution's), or ``guess(*values of deps)`` returning one.
            No derivative flows through it.
        solver: ``"newton"`` (the default), or ``solver(f, u0) -> u`` for another method
            (``f(u)``: the residual at the deps' values; it must be traceable, an optimistix
            root finder for instance), whose result is checked against the tolerances.
        linear_solver: for Newton's steps and the derivatives: ``"dense"`` (the Jacobian
            formed, ``jnp.linalg.solve``), ``"gmres"`` (matrix-free,
            ``jax.scipy.sparse.linalg.gmres``), ``"auto"`` (dense up to 512 unknowns), or
            ``solve(matvec, b) -> x`` (``matvec`` and ``b`` on pytrees shaped like ``u``; it
            must be traceable and linear in ``b``).
        rtol, atol: converged when ``|residual(u)| <= atol + rtol * |residual(guess)|`` (2-norms
            over all leaves). Default ``None``: 1e-5 in float32, 1e-10 in float64.
        maxiter: the most Newton (or Gauss-Seidel) iterations; more is a
            [`SolveError`][daskdag.SolveError].
        jit, vmap, device, resources, remat: as a [`Node`][daskdag.Node]'s. (The solve is
            compiled by JAX whether or not ``jit`` is set; ``jit=True`` compiles the node's call
            around it. With ``vmap=True``, a sweep solves a chunk's items as one batched solve,
            each item to its own tolerance.)

    For example, ``u = a ** (1/3)`` as the root of ``u ** 3 - a``:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {"u": daskdag.Implicit(lambda u, a: u ** 3 - a, ["a"], guess=jnp.ones(3)),
           "L": (jnp.sum, ["u"])}
    res = daskdag.compute_grads(dag, jnp.array([1.0, 8.0, 27.0]), "L")
    print(res.value, res.grad)  # 6.0, 1 / (3 u**2): [0.333 0.0833 0.037]
    ```
    """

    residual: Callable[..., Any]
    deps: Sequence[str] = ()
    guess: Any = None
    solver: str | Callable[..., Any] = "newton"
    linear_solver: str | Callable[..., Any] = "auto"
    rtol: float | None = None
    atol: float | None = None
    maxiter: int = 50
    jit: bool = False
    vmap: bool = False
    device: str | jax.Device | None = None
    resources: Mapping[str, float] | None = None
    remat: bool | None = None

    def solve(self, name: str, hold: Callable[[Any], Any] | None = None) -> Solve:
        """This entry's node function under ``name``, checked, the user's functions held by
        ``hold`` (as ``spec.parse`` says)."""
        _check(name, self)

        def keep(f):
            return hold(f) if hold is not None and callable(f) else f

        return Solve(name, keep(self.residual), keep(self.guess), keep(self.solver),
                     keep(self.linear_solver), self.rtol, self.atol, self.maxiter)


def coupled(nodes: Mapping[str, Any], guess: Mapping[str, Any], *,
            solver: str | Callable[..., Any] = "newton", linear_solver: str | Callable = "auto",
            rtol: float | None = None, atol: float | None = None, maxiter: int = 50,
            name: str | None = None, **options: Any) -> dict:
    """DAG entries for nodes that depend on each other (a cycle: discipline 1 needs ``y2``,
    discipline 2 needs ``y1``), solved together as one implicit node: its unknowns are the
    nodes' values, its residual ``y_i - f_i(...)`` for each node ``i``. ``linear_solver``,
    ``rtol``, ``atol`` and ``maxiter`` are as [`Implicit`][daskdag.Implicit]'s.

    Args:
        nodes: ``{name: (fn, [deps])}``, as in a DAG; a dep may name another node of the group
            (a cycle) or anything the DAG has (nodes outside it, free inputs).
        guess: ``{name: value}``, each node's starting value, which gives its shape and dtype.
        solver: ``"newton"`` (the default: Newton's method on the whole group), or
            ``"gauss-seidel"`` (nonlinear block Gauss-Seidel: each node evaluated in turn on the
            newest values, until the residual meets the tolerances; its derivatives are the
            same linear solves), or a callable, as [`Implicit`][daskdag.Implicit]'s.
        name: the group's own node, whose value is ``{name: value}`` of its nodes (default
            ``"cycle(y1,y2)"``, its nodes' names): errors and ``info.solves`` name it.
        **options: ``jit``, ``vmap``, ``device``, ``resources``, ``remat``, as
            [`Implicit`][daskdag.Implicit]'s.

    Returns:
        ``{group name: Implicit(...), y1: (pick y1, [group name]), ...}``: entries to put in the
        DAG (``dag = {**daskdag.coupled(...), "obj": ...}``). Each node of the group is then a
        node like any other: an output, a dep, in ``wrt``.

    For example, ``y1 = x - y2 / 2`` and ``y2 = y1 / 4``:

    ```python
    import jax.numpy as jnp
    import daskdag

    dag = {**daskdag.coupled({"y1": (lambda x, y2: x - y2 / 2, ["x", "y2"]),
                              "y2": (lambda y1: y1 / 4, ["y1"])},
                             guess={"y1": 0.0, "y2": 0.0}),
           "L": (lambda y1, y2: y1 + y2, ["y1", "y2"])}
    res = daskdag.compute_grads(dag, jnp.array(9.0), "L")
    print(res.value, res.grad)  # y1 = 8, y2 = 2: 10.0; dL/dx = 10/9
    ```
    """
    if not isinstance(nodes, Mapping) or not nodes:
        raise DAGError(f"coupled: nodes must be a non-empty dict {{name: (fn, [deps])}}, "
                       f"got {nodes!r}")
    group = name or f"cycle({','.join(nodes)})"
    fns, deps = {}, {}
    for n, entry in nodes.items():
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and callable(entry[0])
                and isinstance(entry[1], (tuple, list))):
            raise DAGError(f"coupled group {group!r}: node {n!r}: expected (fn, [deps]), "
                           f"got {entry!r}")
        fns[n], deps[n] = entry[0], tuple(entry[1])
        for d in deps[n]:
            if not isinstance(d, str):
                raise DAGError(f"coupled group {group!r}: node {n!r}: dep {d!r} is not a string")
    if not isinstance(guess, Mapping) or set(guess) != set(nodes):
        given = sorted(guess) if isinstance(guess, Mapping) else guess
        raise DAGError(f"coupled group {group!r}: guess must give a starting value for each of "
                       f"its nodes {sorted(nodes)}, got {given!r}")
    outside = tuple(dict.fromkeys(d for n in nodes for d in deps[n] if d not in nodes))
    system = Coupled(tuple(nodes), fns, deps, outside)
    entry = Implicit(system, outside, {n: guess[n] for n in nodes}, solver, linear_solver,
                     rtol, atol, maxiter, **options)
    return {group: entry, **{n: (operator.itemgetter(n), [group]) for n in nodes}}


class Coupled:
    """A coupled group's residual, ``{y_i: y_i - f_i(deps)}``, and its Gauss-Seidel sweep.
    ``outside``: the deps from outside the group, in the order the group's node takes them."""

    def __init__(self, names: tuple, fns: dict, deps: dict, outside: tuple):
        self.names, self.fns, self.deps, self.outside = names, fns, deps, outside

    def _evaluate(self, name: str, u: Mapping, args: Sequence) -> Any:
        given = dict(zip(self.outside, args))
        return self.fns[name](*(u[d] if d in u else given[d] for d in self.deps[name]))

    def __call__(self, u: Mapping, *args: Any) -> dict:
        return {n: jax.tree.map(jnp.subtract, u[n], self._evaluate(n, u, args))
                for n in self.names}

    def gauss_seidel(self, u0: dict, *args: Any) -> dict:
        """One sweep through the group, each node on the newest values: the next iterate."""
        u = dict(u0)
        for n in self.names:
            u[n] = jax.tree.map(lambda old, new: jnp.asarray(new, jnp.result_type(old)),
                                u[n], self._evaluate(n, u, args))
        return u

    def __reduce__(self) -> tuple:
        return Coupled, (self.names, self.fns, self.deps, self.outside)


class Solve:
    """An implicit node's function: called with its deps' values, the solution."""

    def __init__(self, name: str, residual: Callable, guess: Any, solver: Any, linear: Any,
                 rtol: float | None, atol: float | None, maxiter: int):
        self.name, self.residual, self.guess, self.solver, self.linear = (
            name, residual, guess, solver, linear)
        self.rtol, self.atol, self.maxiter = rtol, atol, maxiter

    def __call__(self, *args: Any) -> Any:
        # (NumPy arrays copied: JAX caches a constant NumPy array by identity, missing any
        # change the user makes in place)
        guess = None if callable(self.guess) else jax.tree.map(
            lambda leaf: leaf.copy() if isinstance(leaf, np.ndarray) else leaf, self.guess)
        u, stats = self._program()(guess, *args)
        self._check(*stats)
        return u

    def _program(self) -> Callable[..., Any]:
        """:meth:`_solve` jitted, kept while the user's functions' fingerprint
        (:mod:`daskdag.transport.fingerprints`) is unchanged: traced again only after a change."""
        kept = self.__dict__.get("_compiled")
        if kept is not None and kept[0].holds(self):
            return kept[1]
        program = jax.jit(self._solve)
        print_ = fingerprint(self, checked=True)
        if print_ is not None:  # (else unwatchable: traced at every call)
            self.__dict__["_compiled"] = (print_, program)
        return program

    def _solve(self, guess: Any, *args: Any) -> tuple:
        """The solution and ``(iterations, residual norm, tolerance)``, from ``guess`` (None:
        the guess function's)."""
        guess = self.guess(*args) if guess is None else guess
        guess = jax.lax.stop_gradient(jax.tree.map(jnp.asarray, guess))
        flat, _ = ravel_pytree(guess)
        default = 1e-10 if jnp.finfo(flat.dtype).bits > 32 else 1e-5
        rtol, atol = (default if t is None else t for t in (self.rtol, self.atol))
        linear = self.linear  # (x with g(x) = y, for the linear map g: solve(g, y) -> x)
        if not callable(linear):
            dense = linear == "dense" or (linear == "auto" and flat.size <= DENSE_UNKNOWNS)
            linear = _dense if dense else _gmres

        def f(u):
            return self.residual(u, *args)

        _same_shapes(self.name, jax.eval_shape(f, guess), guess)

        def solve(f, u0):
            if self.solver == "newton":
                return _iterate(f, u0, rtol, atol, self.maxiter, linear)
            if self.solver == "gauss-seidel":
                step = held(self.residual).gauss_seidel
                return _iterate(f, u0, rtol, atol, self.maxiter, linear,
                                lambda u: step(u, *args))
            u = self.solver(f, u0)
            r0, r = _norm(f(u0)), _norm(f(u))
            return u, (jnp.asarray(-1.0, r.dtype), r, atol + rtol * r0)

        return jax.lax.custom_root(f, guess, solve, linear, has_aux=True)

    def _check(self, iterations, norm, tol) -> None:
        """:meth:`_seen` the solve: at once on values, by a callback on tracers."""
        try:
            stats = float(iterations), float(norm), float(tol)
        except jax.errors.ConcretizationTypeError:
            jax.debug.callback(self._seen, iterations, norm, tol)
            return
        self._seen(*stats)

    def _seen(self, iterations, norm, tol) -> None:
        """Record the solve; raise :class:`SolveError` if it missed its tolerance. Under
        ``vmap`` (a sweep's items), the arguments are arrays."""
        iterations, norm, tol = (np.asarray(a) for a in (iterations, norm, tol))
        _record(self.name, {"iterations": None if iterations.max() < 0 else int(iterations.max()),
                            "residual": float(norm.max())})
        bad = ~(norm <= tol)
        if not bad.any():
            return
        worst = float(np.max(np.where(bad, norm, -np.inf)))
        how = ("the solver" if iterations.max() < 0
               else f"{int(iterations.max())} iterations (maxiter {self.maxiter})")
        items = f" in {int(bad.sum())} of {bad.size} items" if bad.ndim else ""
        lost = "" if np.isfinite(worst) else " (the iterates stopped being finite)"
        raise raised_in_program(SolveError(
            f"node {self.name!r}: the solve did not converge{items}: residual norm {worst:.3g} "
            f"after {how}, tolerance {float(tol.max()):.3g}{lost}"))

    def __reduce__(self) -> tuple:
        return Solve, (self.name, self.residual, self.guess, self.solver, self.linear,
                       self.rtol, self.atol, self.maxiter)


def _same_shapes(name: str, residual: Any, guess: Any) -> None:
    """Refuse a residual not shaped like its unknowns (``guess``): one equation per unknown."""
    def shapes(tree):
        return jax.tree.map(lambda leaf: f"{jnp.result_type(leaf)}{list(jnp.shape(leaf))}", tree)

    got, want = shapes(residual), shapes(guess)
    if jax.tree.structure(got) != jax.tree.structure(want) or any(
            jnp.shape(r) != jnp.shape(g)
            for r, g in zip(jax.tree.leaves(residual), jax.tree.leaves(guess))):
        raise ValueError(f"node {name!r}: the residual returns {got}, but the unknowns (shaped "
                         f"like guess) are {want}: residual(u, ...) must return one equation "
                         f"per unknown, shaped like u")


def _norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.abs(leaf) ** 2) for leaf in jax.tree.leaves(tree)))


def _iterate(f, u0, rtol, atol, maxiter, linear, iterate=None):
    """Newton's method on ``f`` from ``u0`` (``iterate``: another step, ``u -> next u``), until
    ``|f(u)| <= atol + rtol * |f(u0)|`` or ``maxiter`` steps: ``(u, (steps, |f(u)|, tol))``."""
    r0 = f(u0)
    tol = atol + rtol * _norm(r0)

    def newton(u, r):
        step = linear(lambda d: jax.jvp(f, (u,), (d,))[1], r)
        return jax.tree.map(jnp.subtract, u, step)

    def go_on(state):
        _, r, i = state
        return (_norm(r) > tol) & (i < maxiter)

    def body(state):
        u, r, i = state
        u = iterate(u) if iterate is not None else newton(u, r)
        return u, f(u), i + 1

    u, r, i = jax.lax.while_loop(go_on, body, (u0, r0, 0))
    norm = _norm(r)
    return u, (jnp.asarray(i, norm.dtype), norm, jnp.asarray(tol, norm.dtype))


def _dense(g, y):
    flat, unravel = ravel_pytree(y)
    matrix = jax.jacfwd(lambda v: ravel_pytree(g(unravel(v)))[0])(jnp.zeros_like(flat))
    return unravel(jnp.linalg.solve(matrix, flat))


def _gmres(g, y):
    def solve(matvec, b):
        wide = any(jnp.finfo(leaf.dtype).bits > 32 for leaf in jax.tree.leaves(b))
        return jax.scipy.sparse.linalg.gmres(matvec, b, tol=1e-12 if wide else 1e-7, restart=50,
                                             maxiter=20)[0]

    return jax.lax.custom_linear_solve(g, y, solve, transpose_solve=solve)


def _check(name: str, entry: Implicit) -> None:
    if not callable(entry.residual):
        raise DAGError(f"node {name!r}: residual is not callable: {entry.residual!r}")
    if entry.guess is None:
        raise DAGError(f"node {name!r}: give guess=, the solve's starting point (its shape and "
                       f"dtype are the solution's), or guess(*deps) returning one")
    if entry.solver == "gauss-seidel" and not isinstance(entry.residual, Coupled):
        raise DAGError(f"node {name!r}: solver='gauss-seidel' is for coupled groups "
                       f"(daskdag.coupled); an implicit node takes 'newton' or a callable")
    if not callable(entry.solver) and entry.solver not in SOLVERS:
        raise DAGError(f"node {name!r}: solver must be one of {SOLVERS} or a callable "
                       f"solver(f, u0) -> u, got {entry.solver!r}")
    if not callable(entry.linear_solver) and entry.linear_solver not in LINEAR_SOLVERS:
        raise DAGError(f"node {name!r}: linear_solver must be one of {LINEAR_SOLVERS} or a "
                       f"callable solve(matvec, b) -> x, got {entry.linear_solver!r}")
    if not (isinstance(entry.maxiter, int) and entry.maxiter >= 1):
        raise DAGError(f"node {name!r}: maxiter must be a positive int, got {entry.maxiter!r}")
    for what in ("rtol", "atol"):
        value = getattr(entry, what)
        if value is not None and not (isinstance(value, (int, float)) and value >= 0
                                      and math.isfinite(value)):
            raise DAGError(f"node {name!r}: {what} must be a number >= 0, got {value!r}")


class _NotOurs(logging.Filter):
    """Keeps JAX from logging a solve's failure raised in a callback: its error reports it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], SolveError))


logging.getLogger("jax._src.debugging").addFilter(_NotOurs())

_solves: contextvars.ContextVar[dict | None] = contextvars.ContextVar("daskdag solves",
                                                                      default=None)
TOPIC = "daskdag-solves"  # the workers' event log topic of the solves their tasks ran


def _record(name: str, solve: dict) -> None:
    """The solve of node ``name`` into this thread's record (:func:`recording`), or, in a
    worker's task, to the worker's event log (:data:`TOPIC`) as ``[task key, name, solve]``."""
    record = _solves.get()
    if record is not None:
        record.setdefault(name, []).append(solve)
    elif (task := current_task()) is not None:
        worker, key = task
        worker.log_event(TOPIC, [key, name, solve])


def recorded() -> dict | None:
    """The record of the call this thread runs (:func:`recording`), or None."""
    return _solves.get()


@contextlib.contextmanager
def recording(record: dict | None) -> Iterator[dict | None]:
    """Each solve this thread (and the tasks it hands to Dask's threads) runs on values within
    it is recorded into ``record``: ``{node: [{"iterations", "residual"}, ...]}`` (None: none)."""
    token = _solves.set(record)
    try:
        yield record
    finally:
        _solves.reset(token)
