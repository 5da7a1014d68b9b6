"""Sparse Jacobians in few passes: a boolean pattern ``(output elements, input elements)`` has
its rows (reverse mode) or columns (forward mode) grouped by a greedy colouring, so that no two
rows of a colour share a column; one pass per colour then keeps each row's entries apart. The
patterns as the user gives them (``sparsity=``) are checked and joined into one per output
(:func:`user_patterns`), keyed by content (:func:`pattern_key`), and coloured (:class:`Colours`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdag.caches import Cache
from daskdag.errors import DAGError
from daskdag.model.plan import Plan
from daskdag.transport.content import array_digest

if TYPE_CHECKING:
    import scipy.sparse as sp


def as_pattern(pattern, shape: tuple[int, int] | None = None) -> sp.csr_array:
    """``pattern`` (NumPy, ``scipy.sparse``, nested lists) as a boolean CSR array; a
    ``ValueError`` when its shape is not ``shape``."""
    import scipy.sparse as sp
    csr = sp.csr_array(pattern if sp.issparse(pattern) else np.asarray(pattern), dtype=bool)
    csr.eliminate_zeros()
    if shape is not None and csr.shape != tuple(shape):
        raise ValueError(f"it is {csr.shape[0]} x {csr.shape[1]}, but the Jacobian is "
                         f"{shape[0]} x {shape[1]} (output elements x input elements)")
    return csr


def colour_rows(pattern: sp.csr_array) -> np.ndarray:
    """A colour (0, 1, ...) per row, rows sharing a column apart. Greedy, fullest rows first
    (Welsh-Powell); cached by the pattern's content."""
    csr = as_pattern(pattern)
    csr.sort_indices()
    digest = hashlib.sha1(np.asarray(csr.shape).tobytes() + csr.indptr.tobytes()
                          + csr.indices.tobytes()).hexdigest()
    return _coloured.setdefault(digest, lambda: _greedy(csr)).copy()


_coloured: Cache[np.ndarray] = Cache("colourings of sparsity patterns", 64)


def _greedy(csr: sp.csr_array) -> np.ndarray:
    rows = csr.astype(np.int64)
    conflicts = (rows @ rows.T).tocsr()  # rows sharing some column
    starts, neighbours = conflicts.indptr.tolist(), conflicts.indices.tolist()
    colours = [-1] * rows.shape[0]
    for r in np.argsort(-np.diff(rows.indptr), kind="stable").tolist():
        taken = {colours[j] for j in neighbours[starts[r]:starts[r + 1]]}
        colours[r] = min(set(range(len(taken) + 1)) - taken)  # (the least colour not taken)
    return np.asarray(colours, np.int64)


def colour_columns(pattern: sp.csr_array) -> np.ndarray:
    """A colour per column, columns sharing a row apart."""
    return colour_rows(as_pattern(pattern).T.tocsr())


def count(colours: np.ndarray) -> int:
    return int(colours.max()) + 1 if len(colours) else 0


def seeds(colours: np.ndarray, dtype) -> np.ndarray:
    """``(colours, elements)``: row k seeds every element of colour k with 1."""
    out = np.zeros((count(colours), len(colours)), dtype)
    out[colours, np.arange(len(colours))] = 1
    return out


def from_passes(pattern: sp.csr_array, colours: np.ndarray, passes: np.ndarray,
                forward: bool, dense: bool = False) -> sp.csr_array | np.ndarray:
    """The Jacobian from one pass per colour: entry ``(r, c)`` is ``passes[colours[r], c]``
    from reverse passes (rows coloured), ``passes[colours[c], r]`` from ``forward`` ones
    (columns coloured). ``dense``: as a NumPy array."""
    import scipy.sparse as sp
    coo = as_pattern(pattern).tocoo()
    coloured, other = (coo.col, coo.row) if forward else (coo.row, coo.col)
    csr = sp.csr_array((np.asarray(passes)[colours[coloured], other], (coo.row, coo.col)),
                       shape=coo.shape)
    return csr.toarray() if dense else csr


class Colours:
    """A call's patterns (``{output: pattern over every wrt name}``, or None: dense), and their
    colours, found when first asked: ``rows`` per output (reverse), ``columns`` (forward, one
    colouring for all outputs)."""

    def __init__(self, patterns: dict[str, sp.csr_array] | None) -> None:
        self.patterns: Any = patterns
        self.used: str | None = None  # "rows" or "columns", whichever was asked for

    @cached_property
    def rows(self) -> dict:
        self.used = "rows"
        return {o: colour_rows(p) for o, p in self.patterns.items()}

    @cached_property
    def columns(self) -> np.ndarray:
        import scipy.sparse as sp
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
    """A ``sparsity`` argument as part of a preparation's key: a pattern by its content (an
    array can change in place), ``"detect"`` or None as they are."""
    import scipy.sparse as sp
    if sparsity is None or isinstance(sparsity, str):
        return sparsity
    if isinstance(sparsity, Mapping):
        return tuple((k, pattern_key(v)) for k, v in sparsity.items())
    if sp.issparse(sparsity):
        csr = sp.csr_array(sparsity)
        parts: tuple = (np.asarray(csr.shape), csr.indptr, csr.indices, csr.data)
    else:
        try:
            parts = (np.asarray(sparsity),)
        except Exception:
            return ("object", id(sparsity))
        if parts[0].dtype.hasobject:
            return ("object", id(sparsity))
    return hashlib.sha256(b"".join(map(array_digest, parts))).hexdigest()


def user_patterns(plan: Plan, widths: dict[str, int], elements: dict[str, int], sparsity: Any,
                  outputs: str | Sequence[str]) -> dict[str, sp.csr_array]:
    """``{output: pattern over every wrt name's elements}`` from ``sparsity`` as given, checked
    against ``widths`` (each given wrt input's elements) and ``elements`` (each output's, where
    known before it runs): else a :class:`~daskdag.DAGError` naming the output and input."""
    import scipy.sparse as sp
    one = isinstance(outputs, str) and not (  # (one output's pattern, or {output: pattern})
        isinstance(sparsity, Mapping) and set(sparsity) == {outputs} and outputs not in plan.wrt)
    per_output = {o: sparsity for o in plan.outputs} if one else sparsity
    if not isinstance(per_output, Mapping):
        raise DAGError(f"sparsity for several outputs must be a dict {{output: pattern}}, got "
                       f"{type(sparsity).__name__}", argument="sparsity")
    out = {}
    for o in plan.outputs:
        if o not in per_output:
            raise DAGError(f"sparsity gives no pattern for output {o!r}; it has "
                           f"{list(per_output)}", argument="sparsity")
        blocks = _blocks(plan, o, per_output[o], one)
        parts = [_block(o, i, blocks, widths) for i in plan.wrt]
        rows = {p.shape[0] for p in parts}
        if len(rows) > 1:
            raise DAGError(f"sparsity for output {o!r}: the patterns disagree on its number of "
                           f"elements: {[p.shape[0] for p in parts]}", argument="sparsity")
        if o in elements and rows:
            check_rows(o, rows.pop(), elements[o])
        out[o] = sp.hstack(parts, format="csr")
    return out


def check_rows(output: str, rows: int, elements: int) -> None:
    """Refuse a pattern of ``output`` whose ``rows`` are not the output's ``elements``."""
    if rows != elements:
        raise DAGError(f"the sparsity pattern of output {output!r} has {rows} rows, but the "
                       f"output has {elements} elements", argument="sparsity")


def _blocks(plan: Plan, output: str, given: Any, one: bool) -> Mapping:
    """``{input: pattern}`` of one output's pattern as given."""
    if not isinstance(given, Mapping):
        if len(plan.wrt) != 1:
            raise DAGError(f"sparsity for output {output!r}: with several inputs "
                           f"{list(plan.wrt)}, give a dict {{input: pattern}}", argument="sparsity")
        return {plan.wrt[0]: given}
    unknown = [k for k in given if k not in plan.wrt]
    if unknown:
        read = " (read as {input: pattern} for the one output asked for)" if one else ""
        raise DAGError(f"sparsity for output {output!r}{read} names {unknown}, which are not "
                       f"among the inputs differentiated, {list(plan.wrt)}", argument="sparsity")
    return given


def _block(output: str, name: str, blocks: Mapping, widths: dict[str, int]) -> sp.csr_array:
    """The pattern of ``output`` for ``name``, checked: 2-D, boolean, as wide as the input."""
    import scipy.sparse as sp
    if name not in blocks:
        raise DAGError(f"sparsity for output {output!r} gives no pattern for {name!r}; it has "
                       f"{list(blocks)}", argument="sparsity")
    given = blocks[name]
    values = given.data if sp.issparse(given) else np.asarray(given)
    if values.dtype != bool and (not np.issubdtype(values.dtype, np.number)
                                 or not np.isin(values, (0, 1)).all()):
        raise DAGError(f"sparsity for output {output!r} and {name!r} must be boolean (True where "
                       f"an output element may depend on an input element), or of 0 and 1; it "
                       f"holds other {values.dtype} values", argument="sparsity")
    try:
        block = as_pattern(given)
    except (TypeError, ValueError) as e:
        raise DAGError(f"sparsity for output {output!r} and {name!r}: {e}",
                       argument="sparsity") from None
    if block.ndim != 2:
        raise DAGError(f"sparsity for output {output!r} and {name!r} must be 2-D (output "
                       f"elements, input elements)", argument="sparsity")
    if name in widths and block.shape[1] != widths[name]:
        raise DAGError(f"sparsity for output {output!r} and input {name!r} has {block.shape[1]} "
                       f"columns, but the input has {widths[name]} elements", argument="sparsity")
    return block
