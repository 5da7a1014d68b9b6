"""The errors a user meets, and :func:`node_errors`, which names the node that raised."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

import jax

from daskdag.caches import Cache

_VJP = ("a node differentiated with jax.vjp gets tracers for inputs: float(), int() and "
        "np.asarray() on them fail, and so does non-JAX code; give such a node its own VJP, "
        "daskdag.Node(fwd=..., bwd=..., deps=...) or Node(fn, deps, vjp=...), and it gets NumPy "
        "values")
_TRACED = ("a node marked jit=True (or vmap=True in a sweep) is traced without values, so Python "
           "control flow on its values fails: drop jit=True (vmap=True) for this node, or use "
           "jax.lax.cond / jnp.where")

# What to do about an exception a node raised, by type, most specific first.
HINTS: tuple[tuple[type[BaseException], str], ...] = (
    (jax.errors.TracerBoolConversionError, _TRACED),
    (jax.errors.ConcretizationTypeError, f"{_VJP}; {_TRACED}"),
    (jax.errors.TracerArrayConversionError, _VJP),
)


def hint(original: BaseException) -> str:
    return next((h for kind, h in HINTS if isinstance(original, kind)), "")


class DAGError(ValueError):
    """The DAG, its inputs, outputs or options are malformed. The message names the culprit.

    Args:
        message: what is wrong, naming the node, input or output concerned.
        argument: the call's argument the mistake is in (``"cotangents"``), where a front end
            names it its own way (the command line's ``--cotangents``); else None.
    """

    def __init__(self, message: str, argument: str | None = None):
        super().__init__(message)
        self.argument = argument

    def __reduce__(self) -> tuple:  # (raised on a worker: the argument travels too)
        return type(self), (str(self), self.argument)


class NodeError(RuntimeError):
    """A node's function (or its pullback) raised. ``node`` names it, ``item`` the sweep item
    (else ``None``); the original exception is ``__cause__``. For JAX's tracer errors the
    message ends with a hint (``HINTS``). Picklable, cause included, so it survives the trip
    back from a ``distributed`` worker."""

    def __init__(self, node: str, phase: str, original: BaseException, item: int | None = None):
        where = f"item {item}: " if item is not None else ""
        advice = hint(original)
        super().__init__(f"{where}node {node!r} failed in its {phase} pass: "
                         f"{type(original).__name__}: {original}"
                         + (f"\nHint: {advice}" if advice else ""))
        self.node, self.phase, self.original, self.item = node, phase, original, item
        self.__cause__ = original

    def __reduce__(self) -> tuple:
        return NodeError, (self.node, self.phase, self.original, self.item)


class GradientCheckError(AssertionError):
    """A node's VJP disagrees with central finite differences of the node alone
    ([`daskdag.check_grads`][daskdag.check_grads]). ``node`` and ``dep`` name them
    (``position``: the dep's index among the node's deps); ``fd`` and ``ad`` are ``<u, J v>``
    by finite differences and from the VJP, for a random tangent ``v`` of the dep and cotangent
    ``u`` of the output; ``error`` is ``|fd - ad|``, over ``tolerance``; ``eps`` the
    finite-difference step (before each leaf's magnitude scales it); ``others``: the names of
    the other nodes that failed too. Picklable, like [`NodeError`][daskdag.NodeError]."""

    def __init__(self, node: str, dep: str, position: int, fd: float, ad: float, error: float,
                 tolerance: float, eps: float, others: tuple[str, ...] = ()):
        more = (f"; {len(others)} other node{'s' if len(others) > 1 else ''} failed too: "
                + ", ".join(map(repr, others))) if others else ""
        super().__init__(f"node {node!r}: its VJP disagrees with finite differences for dep "
                         f"{dep!r} (position {position}): <u, J v> = {fd:.4e} by central "
                         f"differences (eps {eps:.1e}), {ad:.4e} from the VJP; error {error:.1e} "
                         f"> tolerance {tolerance:.1e}{more}")
        self.position: int | None  # (None for a TotalCheckError)
        self.node, self.dep, self.position = node, dep, position
        self.fd, self.ad, self.error, self.tolerance, self.eps = fd, ad, error, tolerance, eps
        self.others = tuple(others)

    def __reduce__(self) -> tuple:
        return GradientCheckError, (self.node, self.dep, self.position, self.fd, self.ad,
                                    self.error, self.tolerance, self.eps, self.others)


class TotalCheckError(GradientCheckError):
    """An output's gradient by an input disagrees with central finite differences of the
    composed DAG ([`daskdag.check_totals`][daskdag.check_totals]): ``output`` and ``input``
    name them; ``fd``, ``ad``, ``error``, ``tolerance`` and ``eps`` as for
    [`GradientCheckError`][daskdag.GradientCheckError]; ``others``: the other
    ``(output, input)`` pairs that failed too."""

    def __init__(self, output: str, input: str, fd: float, ad: float, error: float,
                 tolerance: float, eps: float, others: tuple = ()):
        more = (f"; {len(others)} other pair{'s' if len(others) > 1 else ''} failed too: "
                + ", ".join(f"{o!r} by {i!r}" for o, i in others)) if others else ""
        AssertionError.__init__(
            self, f"output {output!r}: its gradient by input {input!r} disagrees with central "
                  f"differences of the composed DAG: <u, J v> = {fd:.4e} by central differences "
                  f"(eps {eps:.1e}), {ad:.4e} from the gradient; error {error:.1e} > tolerance "
                  f"{tolerance:.1e}{more}")
        self.node, self.dep, self.position = output, input, None
        self.output, self.input = output, input
        self.fd, self.ad, self.error, self.tolerance, self.eps = fd, ad, error, tolerance, eps
        self.others = tuple(others)

    def __reduce__(self) -> tuple:
        return TotalCheckError, (self.output, self.input, self.fd, self.ad, self.error,
                                 self.tolerance, self.eps, self.others)


class ClusterError(RuntimeError):
    """The cluster cannot run this graph: a client that is not running, no worker at all, no
    worker offering a resource a node needs, or versions that differ from the client's. The
    message names the client, the node or the workers."""


class SolveError(RuntimeError):
    """An implicit node's solve ([`Implicit`][daskdag.Implicit],
    [`coupled`][daskdag.coupled]) did not converge. The message names the node, the
    residual's norm, the iterations and the tolerance; raised from a node, it is a
    [`NodeError`][daskdag.NodeError]'s ``original``."""


# Exceptions raised by callbacks inside compiled programs, by the message that ends JAX's error.
_in_programs: Cache[BaseException] = Cache("exceptions raised inside compiled programs", 64)


def raised_in_program(e: BaseException) -> BaseException:
    """``e``, remembered so that a node raising it from a callback inside a compiled program
    fails with ``e`` itself, not JAX's runtime error around it."""
    return _in_programs.put(f"{type(e).__name__}: {e}", e)


def _raised(e: BaseException) -> BaseException:
    """What a node raised: ``e``, or the exception a callback raised inside its program."""
    if isinstance(e, jax.errors.JaxRuntimeError):
        lines = str(e).strip().splitlines()
        found = _in_programs.get(lines[-1].strip()) if lines else None
        if found is not None:
            return found
    return e


class StoreError(RuntimeError):
    """A durable sweep's store refuses the call: it holds another sweep (the DAG, its inputs,
    outputs or settings changed: the message says which), or another sweep is writing to it.
    Nothing in it was changed."""


def node_errors(node: str, phase: str) -> "_NodeErrors":
    """A context manager: whatever the node's ``phase`` (``'forward'``, ``'backward'``) raises
    in its block becomes a :class:`NodeError` naming it, KeyboardInterrupt and SystemExit too
    (but for Ctrl-C in the user's own process)."""
    return _NodeErrors(node, phase)


class _NodeErrors:
    """:func:`node_errors`' context manager (a class: it is entered for every node's work)."""

    __slots__ = ("node", "phase")

    def __init__(self, node: str, phase: str):
        self.node, self.phase = node, phase

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, e: BaseException | None, traceback: Any) -> None:
        if e is None or isinstance(e, NodeError):  # (a NodeError names its node already)
            return None
        if not isinstance(e, (Exception, KeyboardInterrupt, SystemExit)):
            return None
        if (isinstance(e, KeyboardInterrupt)  # in the user's own main thread: maybe Ctrl-C's
                and threading.current_thread() is threading.main_thread()
                and multiprocessing.parent_process() is None):
            return None
        original = _raised(e)
        raise NodeError(self.node, self.phase, original) from original
