"""What a durable store records of what it holds: the parts that sweeps' and calls' records share
(:func:`common`), how a stored record differs from a call's (:func:`differences`), and the
hashes of values and stored rows."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping

import jax
import numpy as np

from daskdag.errors import DAGError
from daskdag.model.leaves import is_array
from daskdag.model.spec import Node, parse
from daskdag.running.programs import settings
from daskdag.transport import content

FORMAT = 5  # (5: content tokens from one walk; 4: JAX's settings; 3: nodes by content)
RULES = ("vjp", "fwd", "bwd", "jvp")  # a node's own rules, beside its function


def common(dag) -> dict:
    """What every stored record holds: the format, the versions of daskdag and JAX, each node's
    parts (:func:`node_parts`) under ``"dag"``, and the settings the numbers depend on
    (``dask.config``'s ``daskdag.*`` and JAX's, :class:`~daskdag.transport.scope.JaxSettings`)."""
    from daskdag import __version__

    spec = parse(dag)
    digests: dict = {}
    nodes = {n: node_parts(n, node, digests) for n, node in spec.nodes.items()}
    jax_settings, ours = settings()
    return {"format": FORMAT, "daskdag": __version__, "jax": jax.__version__, "dag": nodes,
            "jax settings": plain(jax_settings.as_dict()), "settings": plain(dict(ours))}


def node_parts(name: str, node: Node, digests: dict | None = None) -> dict:
    """A node as a store records it, by part: its function's content tokens
    (:func:`daskdag.transport.content.parts`), its rules' (``"vjp code"``...), its ``"deps"``
    and its ``"options"`` (``jit``, ``vmap``, ``remat``). Raises :class:`~daskdag.DAGError`
    naming the node for a function whose content cannot be read."""
    out: dict = {}
    for rule, fn in (("", node.fn), *((f"{r} ", getattr(node, r)) for r in RULES)):
        if fn is None:
            continue
        try:
            found = content.parts(fn, digests)
        except Exception as e:
            what = f"its {rule.strip()}" if rule else "its function"
            raise DAGError(f"node {name!r}: {what} cannot be recorded in a store: "
                           f"pickling it failed with {type(e).__name__}: {e}") from e
        out.update((rule + part, t) for part, t in found.items())
    out["deps"] = list(node.deps)
    out["options"] = f"jit={node.jit} vmap={node.vmap} remat={node.remat}"
    return out


def _node_differences(name: str, stored, mine) -> str:
    """What differs in node ``name`` between a stored record and a call's (:func:`node_parts`),
    in words."""
    if not isinstance(stored, dict):
        return f"node {name!r} is new"
    if not isinstance(mine, dict):
        return f"node {name!r} is gone"
    words = []
    for part in sorted(set(stored) | set(mine), key=lambda p: (p in ("deps", "options"), p)):
        if stored.get(part) == mine.get(part):
            continue
        if part in ("deps", "options"):
            words.append(f"its {part} (were {stored.get(part)}, are {mine.get(part)})")
        else:
            rule, _, rest = part.partition(" ")
            words.append(f"{content.describe(rest)} (in its {rule})" if rule in RULES
                         else content.describe(part))
    return f"node {name!r}: {', '.join(words)}"


def options(kind, skip: tuple[str, ...] = ()) -> dict:
    """A kind of call's options (its dataclass fields but the DAG, outputs and ``wrt``, and
    ``skip``), as a store records them: plain values as they are (``mode``,
    ``chunk_size``...), others by hash (``cotangents``, ``sparsity``)."""
    return {f.name: _recorded(getattr(kind, f.name)) for f in dataclasses.fields(kind)
            if f.name not in ("dag", "outputs", "wrt", *skip)}


def _recorded(value):
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return hash_tree(value)


def plain(data):
    """``data`` as JSON keeps it (tuples as lists), so that a stored identity compares equal."""
    return json.loads(json.dumps(data, default=repr))


def hash_tree(tree) -> str:
    """SHA-256 of a pytree of arrays and Python scalars: structure, dtypes, shapes and bytes."""
    leaves, treedef = jax.tree.flatten(tree)
    h = hashlib.sha256(str(treedef).encode())
    for leaf in leaves:
        if is_array(leaf) or isinstance(leaf, (int, float, complex, bool, np.generic)):
            h.update(content.array_digest(leaf))
        else:  # (a function or a static field: its content, wherever it is written)
            h.update(content.token(leaf).encode())
    return h.hexdigest()


def differences(stored: dict, mine: dict) -> list[str]:
    """What differs between a stored record and a call's, in words (empty: none)."""
    out = []
    for k in sorted(set(stored) | set(mine)):
        a, b = stored.get(k), mine.get(k)
        if a == b:
            continue
        if (k in ("dag", "shared", "inputs", "jax settings") and isinstance(a, dict)
                and isinstance(b, dict)):
            names = sorted(n for n in {*a, *b} if a.get(n) != b.get(n))
            if k == "dag":
                out.append(f"the DAG's nodes {names} differ (" + "; ".join(
                    _node_differences(n, a.get(n), b.get(n)) for n in names) + ")")
            elif k == "jax settings":
                out.extend(f"JAX's {n} was {a.get(n)!r}, is now {b.get(n)!r}" for n in names)
            else:
                out.append(f"the {'shared ' if k == 'shared' else ''}inputs {names} differ")
        elif k in ("cotangents", "tangents", "directions"):
            out.append(f"the {k} differ")
        else:
            out.append(f"{k} was {a!r}, is now {b!r}")
    return out


def rows_hash(rows: Mapping[str, np.ndarray | None], paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        r = rows.get(p)
        if r is None:
            return ""
        h.update(f"{p}{r.dtype.str}{r.shape}".encode())
        h.update(np.ascontiguousarray(r).tobytes())
    return h.hexdigest()
