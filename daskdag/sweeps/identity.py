"""What a durable sweep is, as its store records it (:func:`identity`), and the hash of a chunk's
input items; the rest of a record is every store's (:mod:`daskdag.durable.identity`)."""

from __future__ import annotations

from typing import Any

from daskdag.durable.identity import common, hash_tree, options, plain
from daskdag.durable.rules import SWEEP


def identity(kind, outputs, wrt, batched, size: int, shared: dict, cotangents, errors: str
             ) -> dict:
    """What a sweep of ``kind`` is, as a store records it: what every store records, the sweep's
    arguments, its shared inputs and cotangents by hash, and for another kind than gradients
    the kind and its options (a record without them is a gradient sweep's)."""
    record = {**common(kind.dag), "outputs": list(outputs), "wrt": list(wrt),
              "batched": sorted(batched), "items": size,
              "shared": {k: hash_tree(v) for k, v in sorted(shared.items())},
              "cotangents": hash_tree(cotangents), "errors": errors}
    if kind.sweep_call != "sweep_grads":
        record.update({SWEEP: kind.sweep_call, **plain(options(kind, skip=("cotangents",)))})
    return record


def items_hash(values: dict[str, Any]) -> str:
    """The hash of one chunk's input items (the batched inputs' rows)."""
    return hash_tree({k: values[k] for k in sorted(values)})
