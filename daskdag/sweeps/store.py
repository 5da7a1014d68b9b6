"""Durable sweeps: each chunk's results on disk as the chunk finishes, so that a sweep outlives
its client, and the same call resumes it.

A store is a directory:

```text
sweep.json                what the sweep is (identity): format, daskdag's version, each node's
                          content token, outputs, wrt, batched inputs, items, chunk size, the
                          shared inputs' and cotangents' hashes, the settings numbers depend on
lock                      held (``fcntl.flock``) while a sweep writes; says which process
chunks/S-E.pkl            items S to E-1: ``{"results": {output: (value, {input: grad})},
                          "failed": {item: NodeError}}``, pickled, NumPy leaves
chunks/S-E.done           written after its ``.pkl`` is on disk (fsync, then an atomic rename):
                          the ``.pkl``'s SHA-256 and the SHA-256 of the chunk's input items
```

A chunk is complete when its ``.done`` is there and the ``.pkl``'s bytes match its hash: a crash
at any instant leaves each chunk complete or absent, and a truncated or corrupted file is
computed again, never returned. A resumed sweep runs the chunks that are not complete; the
identity and each complete chunk's input items must be those of the call, else
:class:`~daskdag.StoreError` names what changed. The files are pickles: open only stores you
trust, as you would a pickle.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import pickle
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np
from dask.base import tokenize

from daskdag.errors import NodeError, StoreError
from daskdag.model.leaves import is_array
from daskdag.model.spec import parse
from daskdag.running.prepared import settings
from daskdag.sweeps.chunked import Items, stacked
from daskdag.transport.packing import pack_function

FORMAT = 1


@dataclass(frozen=True)
class SweepStore:
    """Where a durable sweep keeps its chunks, and what it does with items whose inputs
    changed since they were stored: ``sweep_grads(..., store=SweepStore(path, ...))``. A plain
    path is ``SweepStore(path)``.

    Args:
        path: the store's directory, made if missing.
        changed_items: ``"raise"``: a :class:`~daskdag.StoreError` naming the items whose
            inputs are not those their chunk was computed from; ``"recompute"``: compute those
            chunks again (and only those), replacing what the store held for them.
    """

    path: str | os.PathLike
    changed_items: str = "raise"

    def __post_init__(self):
        if self.changed_items not in ("raise", "recompute"):
            raise ValueError(f"changed_items must be 'raise' or 'recompute', not "
                             f"{self.changed_items!r}")


class Store:
    """An open store (see the module's docstring), locked for this process until :meth:`close`.

    Args:
        where: a :class:`SweepStore`, or its path.
        identity: what the sweep is (:func:`identity`), without its chunk size.
        chunk_size: items per chunk, or None: the stored sweep's, else ``default``.
        default: the chunk size of a new store when ``chunk_size`` is None.
    """

    def __init__(self, where, identity: dict, chunk_size: int | None, default: int):
        where = where if isinstance(where, SweepStore) else SweepStore(where)
        self.path, self.changed_items = Path(os.fspath(where.path)), where.changed_items
        (self.path / "chunks").mkdir(parents=True, exist_ok=True)
        self._lock = _lock(self.path / "lock")
        for left in self.path.glob("**/.*.tmp"):  # (half-written by a sweep that died)
            left.unlink(missing_ok=True)
        try:
            self.identity = self._agree(identity, chunk_size, default)
        except BaseException:
            self.close()
            raise
        self.chunk_size: int = self.identity["chunk_size"]

    def _agree(self, identity: dict, chunk_size: int | None, default: int) -> dict:
        file = self.path / "sweep.json"
        if not file.exists():
            mine = {**identity, "chunk_size": chunk_size or default}
            _write(file, json.dumps(mine, indent=1, sort_keys=True).encode())
            return mine
        try:
            stored = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise StoreError(f"store {self.path}: its sweep.json cannot be read ({e}); delete the "
                             f"store to start afresh") from None
        mine = {**identity, "chunk_size": chunk_size or stored.get("chunk_size")}
        changed = _differences(stored, mine)
        if changed:
            raise StoreError(f"store {self.path} holds another sweep: {'; '.join(changed)}. Use "
                             f"another store, or delete this one to start afresh")
        return stored

    def complete(self, hashes) -> Iterator[tuple[int, int, dict, dict[int, NodeError]]]:
        """The complete chunks, each read once: ``(start, stop, results, failed)``.
        ``hashes(start, stop)``: the hash of the call's input items there, which must be the
        stored one (else, once every chunk was looked at, :class:`~daskdag.StoreError` names
        the items whose inputs changed; with ``changed_items="recompute"`` their chunks are
        removed, to be computed again). Files a crash or a corruption left incomplete are
        removed."""
        changed = []
        for done in sorted((self.path / "chunks").glob("*.done")):
            data = done.with_suffix(".pkl")
            try:
                start, stop = map(int, done.stem.split("-"))
                mark = json.loads(done.read_text())
                body = data.read_bytes()
                ok = _sha256(body) == mark["sha256"]
            except (OSError, ValueError, KeyError):
                ok = False
            if ok and mark["items"] != hashes(start, stop):
                if self.changed_items == "raise":
                    changed.append(f"{start} to {stop - 1}")
                    continue
                ok = False  # (computed again, written anew)
            if not ok:  # never returned: computed again
                for f in (done, data):
                    f.unlink(missing_ok=True)
                continue
            chunk = pickle.loads(body)
            yield start, stop, chunk["results"], chunk["failed"]
        if changed:
            raise StoreError(f"store {self.path}: the inputs of items {', '.join(changed)} are not "
                             f"those the store computed them from. Use another store, delete "
                             f"this one to start afresh, or pass store=daskdag.SweepStore(path, "
                             f"changed_items='recompute') to compute those items again")

    def write(self, start: int, stop: int, items_hash: str, results: dict | None,
              failed: dict[int, NodeError] | None = None) -> None:
        """Items ``start:stop``'s results (``{output: (value, {input: grad})}``) and failures,
        made durable, then marked complete."""
        body = pickle.dumps({"results": _numpy(results or {}), "failed": _picklable(failed or {})},
                            protocol=5)
        name = f"{start:012d}-{stop:012d}"
        try:
            _write(self.path / "chunks" / f"{name}.pkl", body)
            _write(self.path / "chunks" / f"{name}.done",
                   json.dumps({"sha256": _sha256(body), "items": items_hash}).encode())
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            kept = len(list((self.path / "chunks").glob("*.done")))
            raise StoreError(f"store {self.path} is full ({e.strerror}) while writing items "
                             f"{start} to {stop - 1}: the {kept} chunks written before are "
                             f"complete and stay usable; free some space and run the same call "
                             f"again to resume") from e

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()  # (releases the flock)
            self._lock = None


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
        fns = [None if f is None else pack_function(f"node {n!r}: its function", f, True).token
               for f in (node.fn, node.vjp, node.fwd, node.bwd, node.jvp)]
        nodes[n] = tokenize(fns, list(node.deps), node.jit, node.vmap, node.remat)
    x64, ours = settings()
    return {"format": FORMAT, "daskdag": __version__, "jax": jax.__version__, "dag": nodes,
            "outputs": list(outputs), "wrt": list(wrt), "batched": sorted(batched),
            "items": size, "shared": {k: hash_tree(v) for k, v in sorted(shared.items())},
            "cotangents": hash_tree(cotangents), "errors": errors, "x64": x64,
            "settings": dict(ours)}


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


def _differences(stored: dict, mine: dict) -> list[str]:
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


def _numpy(results: dict) -> dict:
    """Results with NumPy leaves, an output's items stacked."""
    def leaves(tree):
        return jax.tree.map(lambda a: np.asarray(a) if isinstance(a, jax.Array) else a,
                            stacked(tree) if isinstance(tree, Items) else tree)
    return {o: (leaves(v), {i: leaves(g) for i, g in grads.items()})
            for o, (v, grads) in results.items()}


def _picklable(failed: dict[int, NodeError]) -> dict[int, NodeError]:
    out = {}
    for item, e in failed.items():
        try:
            pickle.dumps(e)
            out[item] = e
        except Exception:  # (an exception holding what cannot be pickled: its text stays)
            out[item] = NodeError(e.node, e.phase, RuntimeError(f"{type(e.original).__name__}: "
                                                                f"{e.original}"), item=e.item)
    return out


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(path: Path, data: bytes) -> None:
    """``data`` at ``path``, all or nothing: written beside it, synced, renamed over it, and the
    directory synced."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lock(path: Path):
    """The store's lock, held by this process (open file); :class:`~daskdag.StoreError` when
    another sweep holds it."""
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise StoreError(f"store {path.parent} is in use by another sweep ({holder}); wait for "
                         f"it to end, or use another store") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}")
    f.flush()
    return f


def items_hash(values: dict[str, Any]) -> str:
    """The hash of one chunk's input items (``Sweep.items``: the batched inputs' rows)."""
    return hash_tree({k: values[k] for k in sorted(values)})
