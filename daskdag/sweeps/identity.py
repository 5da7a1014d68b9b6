"""What a durable sweep is, as its store records it (:func:`identity`), and the hash of a chunk's
input items; the rest of a record, and how records differ, are every store's
(:mod:`daskdag.durable.identity`)."""

from __future__ import annotations

from typing import Any

from daskdag.durable.identity import common, hash_tree, options, plain
from daskdag.durable.rules import SWEEP


def identity(kind, outputs, wrt, batched, size: int, shared: dict, cotangents, errors: str
             ) -> dict:
    """What a sweep of ``kind`` (a :class:`~daskdag.running.passes.Derivative`) is, as a store
    records it: what every store records (:func:`daskdag.durable.identity.common`) and the
    sweep's arguments, shared inputs (their tangents with them) and cotangents by hash; for
    another kind than gradients, the kind and its options too
    (:func:`daskdag.durable.identity.options`): a record without them is a gradient sweep's."""
    record = {**common(kind.dag), "outputs": list(outputs), "wrt": list(wrt),
              "batched": sorted(batched), "items": size,
              "shared": {k: hash_tree(v) for k, v in sorted(shared.items())},
              "cotangents": hash_tree(cotangents), "errors": errors}
    if kind.sweep_call != "sweep_grads":
        record.update({SWEEP: kind.sweep_call, **plain(options(kind, skip=("cotangents",)))})
    return record


def items_hash(values: dict[str, Any]) -> str:
    """The hash of one chunk's input items (``Sweep.items``: the batched inputs' rows)."""
    return hash_tree({k: values[k] for k in sorted(values)})
