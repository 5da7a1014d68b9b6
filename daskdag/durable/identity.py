"""What a durable store records of what it holds: the parts that sweeps' and calls' records share
(:func:`common`), how a stored record differs from a call's (:func:`differences`), the hashes of
values and stored rows; and the rules every store keeps, a sweep's and a call's alike: what a
location may hold (:func:`claim`), what its record must be (:func:`agree`), a full disk
(:func:`full`)."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
from collections.abc import Mapping

import jax
import numpy as np

from daskdag.durable.keys import Keys
from daskdag.errors import DAGError, StoreError
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
    values = {f.name: getattr(kind, f.name) for f in dataclasses.fields(kind)
              if f.name not in ("dag", "outputs", "wrt", *skip)}
    return {k: v if v is None or isinstance(v, (str, bool, int, float)) else hash_tree(v)
            for k, v in values.items()}


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


#: The root attributes that name what a store holds: a call's record names its function; a
#: sweep's names its kind's (none: ``sweep_grads``, as stores written before other kinds swept).
CALL, SWEEP = "call", "sweep"


def recorded(keys: Keys) -> dict | None:
    """What a store records (its root group's ``daskdag`` attribute), else None."""
    root = keys.get_json("zarr.json")
    attributes = root.get("attributes") if isinstance(root, dict) else None
    found = attributes.get("daskdag") if isinstance(attributes, dict) else None
    return found if isinstance(found, dict) else None


def what(record: dict) -> str:
    """What a record is, in words: ``"a sweep_grads sweep"``, ``"a compute_grads call"``..."""
    call = record.get(CALL)
    return f"a {record.get(SWEEP, 'sweep_grads')} sweep" if call is None else f"a {call} call"


def claim(keys: Keys, kind: str = "sweep") -> None:
    """Refuse, before anything is written, a location that holds something other than a
    daskdag store: a :class:`~daskdag.StoreError` naming what is there (and the ``kind`` of
    store wanted: ``"sweep"``, ``"call"``). Empty or missing is a new store (a lease left by
    one that died before writing is nothing)."""
    found = [n for n in keys.top() if n != "lock"]
    if not found or recorded(keys) is not None:
        return
    shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
    root = keys.get_json("zarr.json")
    node = root.get("node_type") if isinstance(root, dict) else None
    held = (f"is a Zarr {node} that is not a daskdag {kind}'s store (its zarr.json has no "
            f"'daskdag' attribute)" if isinstance(node, str)
            else f"is not empty, and is not a daskdag {kind}'s store")
    raise StoreError(f"store {keys.name} {held}: it holds {shown}. Nothing was written there; "
                     f"give the {kind} a new or empty location")


def agree(keys: Keys, mine: dict, update=None) -> dict | None:
    """The store's record, which must be ``mine`` (else a :class:`~daskdag.StoreError` saying
    what changed, nothing written); None in a new store, where the caller writes its own.
    ``update(stored)``: ``mine`` completed from the stored record (a sweep's chunk size)."""
    stored = recorded(keys)
    if stored is None:
        return None
    if stored.get("format") != FORMAT:
        raise StoreError(
            f"store {keys.name} was written by daskdag {stored.get('daskdag')} in store "
            f"format {stored.get('format')}; this daskdag ({mine['daskdag']}) reads "
            f"format {FORMAT} only, which records JAX's settings that change results, and "
            f"nodes by what they compute. Finish that sweep with daskdag "
            f"{stored.get('daskdag')}, or use another store, or delete this one to start "
            f"afresh")
    if what(stored) != what(mine):
        raise StoreError(f"store {keys.name} holds {what(stored)}, not {what(mine)}: use "
                         f"another store, or delete this one to start afresh")
    changed = differences(stored, update(stored) if update else mine)
    if changed:
        kind = "sweep" if mine.get(CALL) is None else "call"
        raise StoreError(f"store {keys.name} holds another {kind}: {'; '.join(changed)}. Use "
                         f"another store, or delete this one to start afresh")
    return stored


def full(keys: Keys, error: OSError, writing: str, kept: str) -> StoreError | None:
    """The :class:`~daskdag.StoreError` of a full disk (or quota) met while ``writing``, saying
    that ``kept`` stays usable; None for another error."""
    if error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return StoreError(f"store {keys.name} is full ({error.strerror}) while writing {writing}: "
                      f"{kept}; free some space and run the same call again to resume")
