"""Sparse Jacobians in few passes: a boolean pattern ``(output elements, input elements)`` has
its rows (reverse mode) or columns (forward mode) grouped by a greedy colouring, so that no two
rows of a colour share a column; one pass per colour then keeps each row's entries apart."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from daskdag.caches import Cache

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
        c = 0
        while c in taken:
            c += 1
        colours[r] = c
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


def from_rows(pattern: sp.csr_array, colours: np.ndarray, passes: np.ndarray,
              dense: bool = False) -> sp.csr_array | np.ndarray:
    """The Jacobian from reverse passes: entry ``(r, c)`` is ``passes[colours[r], c]``.
    ``dense``: as a NumPy array."""
    coo = as_pattern(pattern).tocoo()
    return _filled(coo, np.asarray(passes)[colours[coo.row], coo.col], dense)


def from_columns(pattern: sp.csr_array, colours: np.ndarray, passes: np.ndarray,
                 dense: bool = False) -> sp.csr_array | np.ndarray:
    """The Jacobian from forward passes: entry ``(r, c)`` is ``passes[colours[c], r]``."""
    coo = as_pattern(pattern).tocoo()
    return _filled(coo, np.asarray(passes)[colours[coo.col], coo.row], dense)


def _filled(coo, data: np.ndarray, dense: bool) -> sp.csr_array | np.ndarray:
    import scipy.sparse as sp
    csr = sp.csr_array((data, (coo.row, coo.col)), shape=coo.shape)
    return csr.toarray() if dense else csr
