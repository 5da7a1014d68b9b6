"""A sparse Jacobian's patterns: as the user gives them (``sparsity=``), checked and joined
into one pattern per output over every differentiated input (:func:`user_patterns`); as part of
a preparation's key (:func:`pattern_key`); and with their colours (:class:`Colours`,
:mod:`daskdag.model.colouring`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np
import scipy.sparse as sp

from daskdag.errors import DAGError
from daskdag.model.colouring import as_pattern, colour_columns, colour_rows, count
from daskdag.model.plan import Plan


class Colours:
    """A call's patterns (``{output: pattern over every wrt name}``, or None: dense), and
    their colours, found once each when asked: ``rows`` per output (reverse), ``columns``
    (forward, one colouring for all outputs)."""

    def __init__(self, patterns: dict[str, sp.csr_array] | None) -> None:
        self.patterns: Any = patterns  # (rows and columns are asked for only where it is not None)
        self.used: str | None = None  # which were used: "rows" or "columns"

    @cached_property
    def rows(self) -> dict:
        self.used = "rows"
        return {o: colour_rows(p) for o, p in self.patterns.items()}

    @cached_property
    def columns(self) -> np.ndarray:
        self.used = "columns"
        return colour_columns(sp.vstack(list(self.patterns.values())))

    @property
    def total(self) -> int | None:
        """The colours the chosen mode takes (one pass each); None when dense."""
        if self.patterns is None:
            return None
        if self.used == "columns":
            return count(self.columns)
        return sum(count(c) for c in self.rows.values())




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


def user_patterns(plan: Plan, widths: dict[str, int], sparsity: Any, outputs: str | Sequence[str]
                  ) -> dict[str, sp.csr_array]:
    """``{output: pattern over every wrt name's elements}`` from ``sparsity`` as given, checked
    against ``widths``, the elements of each wrt input given (a node's are not known yet)."""
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
                block = as_pattern(blocks[i])
            except (TypeError, ValueError) as e:
                raise DAGError(f"sparsity for output {o!r} and {i!r}: {e}") from None
            if block.ndim != 2:
                raise DAGError(f"sparsity for output {o!r} and {i!r} must be 2-D (output "
                               f"elements, input elements)")
            if i in widths and block.shape[1] != widths[i]:
                raise DAGError(f"sparsity for output {o!r} and input {i!r} has {block.shape[1]} "
                               f"columns, but the input has {widths[i]} elements")
            parts.append(block)
        if len({p.shape[0] for p in parts}) > 1:
            raise DAGError(f"sparsity for output {o!r}: the patterns disagree on its number of "
                           f"elements: {[p.shape[0] for p in parts]}")
        out[o] = sp.hstack(parts, format="csr")
    return out
