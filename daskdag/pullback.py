"""A node's forward pass under ``jax.vjp``, and the :class:`Pullback` it leaves behind."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import programs
from .spec import Node


class Pullback:
    """The backward half of one node's ``jax.vjp`` at one point; holds the residuals.

    Call: ``pullback(ct, inputs)``, with the cotangent of the node's output and the node's dep
    values; returns a tuple aligned with the deps: each differentiated dep's cotangent, ``None``
    for the deps held constant.

    In the process that ran the forward pass it calls JAX's own vjp function. When Dask moves it
    elsewhere (:mod:`daskdag.protocol`) it travels as :meth:`portable`: an exported program plus
    its residual arrays, less those that are the node's own inputs, which the backward task
    holds anyway. A program that cannot be exported (a host callback inside) travels as the
    node's function instead, and its forward pass is redone there.
    """

    __slots__ = ("active", "_node", "_vjp", "_args", "_ct_avals", "_form", "_program")

    def __init__(self, node: Node, active: tuple[bool, ...], vjp_fn=None, args=None, ct_avals=None):
        self._node, self.active, self._vjp, self._args, self._ct_avals = node, active, vjp_fn, args, ct_avals
        self._form = self._program = None  # set in a process that received this pullback

    def __call__(self, ct, inputs: Sequence[Any]):
        if self._vjp is not None:
            cts = self._vjp(ct)
        elif self._program is not None:
            consts = list(self._form["consts"])
            for c, (d, k) in self._form["slots"]:
                consts[c] = jax.tree.leaves(inputs[d])[k]
            flat = self._program(*jax.tree.leaves(ct), *consts)
            cts = jax.tree.unflatten(self._form["out_tree"], flat)
        else:  # shipped as its function: redo this node's forward pass here
            cts = linearize(self._node, inputs, self.active)[1]._vjp(ct)
        it = iter(cts)
        return tuple(next(it) if on else None for on in self.active)

    def residual_nbytes(self) -> int:
        """Bytes of the residuals that are not the node's own inputs: what moving it ships."""
        if self._vjp is None:
            return sum(a.nbytes for a in self._form.get("consts", ()) if a is not None)
        inputs = {id(leaf) for leaf in jax.tree.leaves(self._args)}
        return sum(a.nbytes for a in jax.tree.leaves(self._vjp) if id(a) not in inputs)

    # -- travelling ------------------------------------------------------------------------------

    def portable(self) -> dict:
        """What crosses a process boundary: small metadata plus the residual arrays (NumPy)."""
        if self._form is not None:  # received from elsewhere: passes on as it came
            return dict(self._form)
        try:
            closed, out = jax.make_jaxpr(self._vjp, return_shape=True)(self._ct_avals)
            key, program = programs.export(closed, jax.tree.leaves(self._ct_avals))
        except Exception:  # e.g. "serialization of host_callbacks is not yet implemented"
            return {"active": self.active, "node": self._node, "versions": programs.versions()}
        where = {id(leaf): (d, k) for d, arg in enumerate(self._args)
                 for k, leaf in enumerate(jax.tree.leaves(arg))}
        slots = [(c, where[id(a)]) for c, a in enumerate(closed.consts) if id(a) in where]
        taken = {c for c, _ in slots}
        return {"active": self.active, "key": key, "program": program,
                "consts": [None if c in taken else np.asarray(a) for c, a in enumerate(closed.consts)],
                "slots": slots, "out_tree": jax.tree.structure(out), "versions": programs.versions()}

    @classmethod
    def from_portable(cls, form: dict) -> "Pullback":
        """The inverse of :meth:`portable`, in the receiving process."""
        programs.check_versions(form["versions"])
        pb = cls(form.get("node"), form["active"])  # the node travels only when it is redone
        pb._form = form
        if "program" in form:
            pb._program = programs.load(form["key"], form["program"])
        return pb

    def __reduce__(self):  # for pickle-based schedulers; distributed uses protocol.py's frames
        return Pullback.from_portable, (self.portable(),)


def linearize(node: Node, args: Sequence[Any], active: tuple[bool, ...]):
    """Run the node's function once under ``jax.vjp``, differentiating only the ``active`` args.

    Returns ``(primal, Pullback)``. Inactive args (integer indices, constants) are closed over,
    so they get no ``float0`` cotangents and cost no backward work.
    """

    fn = node.callable()

    def fn_of_active(*diff):
        it = iter(diff)
        return fn(*(next(it) if on else a for a, on in zip(args, active)))

    primal, vjp_fn = jax.vjp(fn_of_active, *(a for a, on in zip(args, active) if on))
    ct_avals = jax.tree.map(cotangent_aval, primal)
    return primal, Pullback(node, active, vjp_fn, tuple(args), ct_avals)


def cotangent_aval(x) -> jax.ShapeDtypeStruct:
    """Shape and dtype of a cotangent for primal leaf ``x`` (an array or its ShapeDtypeStruct):
    ``float0`` for integer leaves."""
    dtype = jnp.result_type(x)
    return jax.ShapeDtypeStruct(jnp.shape(x) if not isinstance(x, jax.ShapeDtypeStruct) else x.shape,
                                dtype if jnp.issubdtype(dtype, jnp.inexact) else jax.dtypes.float0)
