"""What a durable sweep is, as its store records it (:func:`identity`), how a stored one differs
from a call's (:func:`differences`), and the hashes of input items and of stored rows."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import jax
import numpy as np
from dask.base import tokenize

from daskdag.model.leaves import is_array
from daskdag.model.spec import parse
from daskdag.running.prepared import settings
from daskdag.transport.transports import CLUSTER

FORMAT = 2


def identity(dag, outputs, wrt, batched, size: int, shared: dict, cotangents, errors: str
             ) -> dict:
    """What a sweep is, as a store records it: each node's content token (its functions packed
    as they travel to a cluster, closed-over arrays by value), the outputs, ``wrt``, the
    batched inputs, the number of items, the hashes of the shared inputs and of the cotangents,
    ``errors`` (what becomes of failing items), the settings the numbers depend on
    (``dask.config``'s ``daskdag.*`` and JAX's x64), and the versions of daskdag and JAX."""
    from daskdag import __version__

    spec = parse(dag)
    nodes = {}
    for n, node in spec.nodes.items():
        fns = [None if f is None else CLUSTER.pack_function(f"node {n!r}: its function", f).token
               for f in (node.fn, node.vjp, node.fwd, node.bwd, node.jvp)]
        nodes[n] = tokenize(fns, list(node.deps), node.jit, node.vmap, node.remat)
    x64, ours = settings()
    return {"format": FORMAT, "daskdag": __version__, "jax": jax.__version__, "dag": nodes,
            "outputs": list(outputs), "wrt": list(wrt), "batched": sorted(batched),
            "items": size, "shared": {k: hash_tree(v) for k, v in sorted(shared.items())},
            "cotangents": hash_tree(cotangents), "errors": errors, "x64": x64,
            "settings": _plain(dict(ours))}


def _plain(data):
    """``data`` as JSON keeps it (tuples as lists), so that a stored identity compares equal."""
    return json.loads(json.dumps(data, default=repr))


def hash_tree(tree) -> str:
    """SHA-256 of a pytree of arrays and Python scalars: structure, dtypes, shapes and bytes."""
    leaves, treedef = jax.tree.flatten(tree)
    h = hashlib.sha256(str(treedef).encode())
    for leaf in leaves:
        if is_array(leaf) or isinstance(leaf, (int, float, complex, bool, np.generic)):
            a = np.ascontiguousarray(np.asarray(leaf))
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
        else:  # (a function or a static field: its token)
            h.update(tokenize(leaf).encode())
    return h.hexdigest()


def differences(stored: dict, mine: dict) -> list[str]:
    out = []
    for k in sorted(set(stored) | set(mine)):
        a, b = stored.get(k), mine.get(k)
        if a == b:
            continue
        if k == "dag" and isinstance(a, dict) and isinstance(b, dict):
            nodes = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
            out.append(f"the DAG's nodes {nodes} differ (added, removed, or their functions, "
                       f"what those hold, deps or options changed)")
        elif k == "shared" and isinstance(a, dict) and isinstance(b, dict):
            names = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
            out.append(f"the shared inputs {names} differ")
        elif k == "cotangents":
            out.append("the cotangents differ")
        else:
            out.append(f"{k} was {a!r}, is now {b!r}")
    return out


def items_hash(values: dict[str, Any]) -> str:
    """The hash of one chunk's input items (``Sweep.items``: the batched inputs' rows)."""
    return hash_tree({k: values[k] for k in sorted(values)})


def rows_hash(rows: Mapping[str, np.ndarray | None], paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        r = rows.get(p)
        if r is None:
            return ""
        h.update(f"{p}{r.dtype.str}{r.shape}".encode())
        h.update(np.ascontiguousarray(r).tobytes())
    return h.hexdigest()
