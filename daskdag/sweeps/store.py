"""Durable sweeps: each chunk's results written to a Zarr (v3) store as the chunk finishes, so
that a sweep outlives its client, and the same call resumes it. Its keys are described in
docs/guides/sweeps.md ("What is in the store"); what every store shares: :mod:`daskdag.durable`.

Items are complete when a ``done/<start>-<stop>`` group covers them and their rows still hash as
it says, so a crash leaves each piece complete or absent. A resumed sweep runs the pieces that
are not complete; each complete piece's input items must be the call's, else a
:class:`~daskdag.StoreError` names what changed. Trees and errors are pickles: open only stores
you trust.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator
from urllib.parse import quote

import jax
import numpy as np

from daskdag.durable.identity import (SWEEP, agree, claim, common, full, hash_tree, options,
                                      plain, rows_hash)
from daskdag.durable.keys import Keys, group, is_zarr, keys_of
from daskdag.errors import NodeError, StoreError
from daskdag.sweeps.planning import item
from daskdag.sweeps.progress import picklable
from daskdag.sweeps.results import missing_value

if TYPE_CHECKING:
    from zarr.abc.store import Store as ZarrStore


def identity(kind, sweep, errors: str) -> dict:
    """What ``sweep`` (a :class:`~daskdag.sweeps.planning.Sweep` of ``kind``) is, as a store
    records it: what every store records (:mod:`daskdag.durable.identity`), the sweep's
    arguments, its shared inputs and cotangents by hash, and for another kind than gradients the
    kind and its options (a record without them is a gradient sweep's)."""
    record = {**common(kind.dag), "outputs": list(sweep.plan.outputs),
              "wrt": list(sweep.plan.wrt), "batched": sorted(sweep.batched), "items": sweep.size,
              "shared": {k: hash_tree(v) for k, v in sorted(sweep.values.items())
                         if k not in sweep.batched},
              "cotangents": hash_tree(sweep.cotangents), "errors": errors}
    if kind.sweep_call != "sweep_grads":
        record.update({SWEEP: kind.sweep_call, **plain(options(kind, skip=("cotangents",)))})
    return record


def items_hash(values: dict[str, Any]) -> str:
    """The hash of one chunk's input items (the batched inputs' rows)."""
    return hash_tree({k: values[k] for k in sorted(values)})


@dataclass(frozen=True)
class SweepStore:
    """Where a durable sweep keeps its results, and how it uses them:
    ``sweep_grads(..., store=SweepStore(location, ...))``. A plain path or Zarr store is
    ``SweepStore(it)``.

    Args:
        location: a directory (made if missing), or a Zarr store object
            (``zarr.storage.LocalStore``, ``FsspecStore``, ``ObjectStore``, ...).
        changed_items: ``"raise"``: a [`StoreError`][daskdag.StoreError] naming the items whose
            inputs are not those their results were computed from; ``"recompute"``: compute
            those chunks again (and only those), replacing what the store held for them.
        lazy: return dask arrays reading the store (``da.from_zarr``) instead of NumPy arrays
            in memory, so that a sweep larger than memory keeps none of its results in this
            process; default: lazy where the items are dask arrays.
    """

    location: str | os.PathLike | ZarrStore
    changed_items: str = "raise"
    lazy: bool | None = None

    def __post_init__(self):
        if self.changed_items not in ("raise", "recompute"):
            raise ValueError(f"changed_items must be 'raise' or 'recompute', not "
                             f"{self.changed_items!r}")
        if not isinstance(self.location, (str, os.PathLike)) and not is_zarr(self.location):
            raise TypeError(f"a sweep's store is a directory or a Zarr store, not "
                            f"{type(self.location).__name__}")


class Store:
    """An open store, held by this process until :meth:`close`. ``identity``: what the sweep
    is, without its chunk size; ``chunk_size``: None for the stored sweep's, else ``default``."""

    def __init__(self, where, identity: dict, chunk_size: int | None, default: int):
        where = where if isinstance(where, SweepStore) else SweepStore(where)
        self.changed_items, self.lazy = where.changed_items, where.lazy
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self.saved = 0  # items of the pieces written
        self.keys = keys_of(where.location)
        self.name = self.keys.name
        claim(self.keys)
        self.keys.hold()
        try:
            self.identity = self._agree(identity, chunk_size, default)
            if "done" not in self.root:
                self.root.create_group("done")
        except BaseException:
            self.close()
            raise
        self.chunk_size: int = self.identity["chunk_size"]
        trees = self.root.attrs.get("trees")
        self.trees: dict = trees if isinstance(trees, dict) else {}

    def _agree(self, identity: dict, chunk_size: int | None, default: int) -> dict:
        """The stored sweep's identity, which must be the call's; in a new store, the call's."""
        import zarr

        stored = agree(self.keys, identity, lambda stored: {
            **identity, "chunk_size": chunk_size or stored.get("chunk_size")})
        if stored is None:
            mine = {**identity, "chunk_size": chunk_size or default}
            self.root = zarr.create_group(self.keys.store, zarr_format=3,
                                          attributes={"daskdag": mine})
            self.keys.synced(["zarr.json"])
            return mine
        self.root = zarr.open_group(self.keys.store, mode="r+", zarr_format=3)
        return stored

    def complete(self, hashes, read: bool = True
                 ) -> Iterator[tuple[int, int, dict | None, dict[int, NodeError]]]:
        """The complete pieces: ``(start, stop, results, failed)``, ``results`` (NumPy rows)
        only when ``read``. ``hashes(start, stop)``: the hash of the call's input items there,
        which must be the stored one (else, once every piece was looked at, a
        :class:`~daskdag.StoreError`; with ``changed_items="recompute"`` their marks are
        removed). Incomplete pieces are removed. One chunk of every array is read at a time."""
        marks = self._marks()
        changed = []
        arrays = self._arrays()
        size = self.chunk_size
        for k in sorted({start // size for start, _ in marks}):
            rows = {path: _read_chunk(self.keys, a, path, k, size) for path, a in arrays.items()}
            for start, stop in sorted(m for m in marks if m[0] // size == k):
                mark = self._mark(start, stop)
                lo, hi = start - k * size, stop - k * size
                if mark is None or mark["rows"] != rows_hash(
                        {p: None if r is None else r[lo:hi] for p, r in rows.items()},
                        mark["arrays"]):  # computed again
                    self.keys.delete(_mark_key(start, stop))
                    continue
                if mark["items"] != hashes(start, stop):
                    if self.changed_items == "raise":
                        changed.append(f"{start} to {stop - 1}")
                    else:  # computed again, written anew
                        self.keys.delete(_mark_key(start, stop))
                    continue
                failed = pickle.loads(base64.b64decode(mark["failed"])) if mark["failed"] \
                    else {}  # (the rows of failed items are NaN)
                try:
                    piece = {p: rows[p][lo:hi] for p in mark["arrays"]}  # type: ignore[index]
                    results = self._results(piece.__getitem__) if read else None
                except KeyError:  # an array the piece does not cover
                    if len(failed) == stop - start:  # no item of it has rows to read
                        yield start, stop, None, failed
                    else:  # computed again
                        self.keys.delete(_mark_key(start, stop))
                    continue
                yield start, stop, results, failed
        if changed:
            raise StoreError(f"store {self.name}: the inputs of items {', '.join(changed)} are not "
                             f"those the store computed them from. Use another store, delete "
                             f"this one to start afresh, or pass store=daskdag.SweepStore(path, "
                             f"changed_items='recompute') to compute those items again")

    def write(self, start: int, stop: int, items_hash: str, results: dict | None,
              failed: dict[int, NodeError] | None = None) -> None:
        """Items ``start:stop``'s results (NumPy rows; those of ``failed`` items written as
        never computed) and failures, made durable, then marked complete."""
        try:
            rows = self._put(start, stop, results, failed or ()) if results else \
                self._blank(start, stop)
            self.keys.synced([_chunk_key(self._arrays()[p], p, start // self.chunk_size)
                              for p in rows])
            failures = base64.b64encode(pickle.dumps(
                {i: picklable(e) for i, e in failed.items()}, protocol=5)).decode() \
                if failed else None
            self.keys.set_json(_mark_key(start, stop), group({
                "items": items_hash, "arrays": sorted(rows),
                "rows": rows_hash(rows, sorted(rows)), "failed": failures}))
            self.saved += stop - start
        except OSError as e:
            error = full(self.keys, e, f"items {start} to {stop - 1}",
                         f"the {len(self._marks())} pieces written before are complete and "
                         f"stay usable")
            if error is None:
                raise
            raise error from e

    def later(self, write) -> None:
        """Run ``write()`` on the store's writer thread, in order, while the sweep goes on; an
        earlier write's error raises here, else in :meth:`flush`."""
        self._raise_failed()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="daskdag-store")
        self._pending.append(self._writer.submit(write))

    def flush(self, raise_errors: bool = True) -> None:
        """Wait for the writes :meth:`later` took; raise the first one's error, if
        ``raise_errors``."""
        wait(self._pending)
        if raise_errors:
            self._raise_failed()
        self._pending = []

    def _raise_failed(self) -> None:
        for f in self._pending:
            if f.done() and f.exception() is not None:
                self._pending = []
                raise f.exception()  # type: ignore[misc]
        self._pending = [f for f in self._pending if not f.done()]

    def view(self, shapes) -> dict:
        """The results as dask arrays reading the store. ``shapes()``: one item's
        (:func:`~daskdag.sweeps.results.item_shapes`), for results no item gave."""
        import dask.array as da
        missing = [o for o in self.identity["outputs"] if o not in self.trees]
        if missing:
            values, grads = shapes()
            for o in missing:
                self._create(o, values[o], {i: grads[o][i] for i in self.identity["wrt"]})
        arrays = self._arrays()
        return self._results(lambda path: da.from_zarr(arrays[path]))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if getattr(self, "keys", None) is not None:
            self.keys.release()
            self.keys = None  # type: ignore[assignment]

    def _put(self, start: int, stop: int, results: dict, blank=()) -> dict[str, np.ndarray]:
        """Write ``results``' rows, those of the items ``blank`` as never written; returns
        them by array path."""
        rows = {}
        arrays = None
        for o, (value, grads) in results.items():
            if o not in self.trees:
                self._create(o, item(value), {i: item(g) for i, g in grads.items()})
            arrays = self._arrays()
            for path, leaf in self._leaves(o, value, grads):
                rows[path] = np.ascontiguousarray(np.asarray(leaf, arrays[path].dtype))
        if blank and arrays is not None:
            at = [i - start for i in blank]
            for path, r in rows.items():
                rows[path] = r = r.copy()  # the caller's arrays stay as they are
                r[at] = arrays[path].fill_value
        return self._set_rows(start, stop, rows)

    def _set_rows(self, start: int, stop: int, rows: dict[str, np.ndarray]
                  ) -> dict[str, np.ndarray]:
        """``rows`` written into their arrays at once (one trip to Zarr's event loop)."""
        arrays = self._arrays()

        async def put():
            await asyncio.gather(*(arrays[p].async_array.setitem(slice(start, stop), r)
                                   for p, r in rows.items()))
        self.keys.run(put())
        return rows

    def _blank(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``start:stop`` of every array reset to never written (NaN, or 0)."""
        return self._set_rows(start, stop, {
            path: np.full((stop - start, *a.shape[1:]), a.fill_value, a.dtype)
            for path, a in self._arrays().items()})

    def _create(self, output: str, value, grads: dict) -> None:
        """The arrays of ``output``'s value and gradients, shaped by one item's (a ``None``
        value stays unknown)."""
        made = ["zarr.json"]  # the metadata written, made durable before any mark needs it

        def make(prefix: str, tree):
            leaves, treedef = jax.tree.flatten(tree)
            for k, leaf in enumerate(leaves):
                dtype = np.dtype(leaf.dtype)
                self.root.create_array(
                    f"{prefix}/{k}", shape=(self.identity["items"], *leaf.shape),
                    chunks=(self.chunk_size, *leaf.shape), dtype=dtype,
                    fill_value=missing_value(dtype), overwrite=True)
                parts = f"{prefix}/{k}".split("/")
                made.extend("/".join([*parts[:n], "zarr.json"]) for n in range(1, len(parts) + 1))
            return base64.b64encode(pickle.dumps(treedef)).decode()

        trees = {"value": None if value is None else make(f"values/{_q(output)}", value),
                 "grads": {i: make(f"grads/{_q(output)}/{_q(i)}", g) for i, g in grads.items()}}
        self.trees = {**self.trees, output: trees}
        self.root.attrs["trees"] = self.trees
        self._arrays_cache = None
        self.keys.synced(dict.fromkeys(made))

    def _leaves(self, o: str, value, grads: dict):
        """``(array path, rows)`` of each leaf of ``o``'s results."""
        yield from ((f"values/{_q(o)}/{k}", leaf) for k, leaf in enumerate(jax.tree.leaves(value)))
        for i, g in grads.items():
            yield from ((f"grads/{_q(o)}/{_q(i)}/{k}", leaf)
                        for k, leaf in enumerate(jax.tree.leaves(g)))

    def _results(self, leaf) -> dict:
        """``{output: (value, {input: grad})}`` with each array's leaf ``leaf(path)``."""
        def tree(encoded, prefix):
            if encoded is None:
                return None
            treedef = pickle.loads(base64.b64decode(encoded))
            return treedef.unflatten([leaf(f"{prefix}/{k}") for k in range(treedef.num_leaves)])
        return {o: (tree(t["value"], f"values/{_q(o)}"),
                    {i: tree(g, f"grads/{_q(o)}/{_q(i)}") for i, g in t["grads"].items()})
                for o, t in self.trees.items()}

    _arrays_cache: dict | None = None

    def _arrays(self) -> dict[str, Any]:
        """Every result array, by path."""
        if self._arrays_cache is None:
            paths: list[str] = []
            self._results(paths.append)
            self._arrays_cache = {p: self.root[p] for p in paths}
        return self._arrays_cache

    def _marks(self) -> list[tuple[int, int]]:
        out = []
        for name in self.keys.children("done"):
            try:
                start, stop = map(int, name.split("-"))
            except ValueError:
                continue
            out.append((start, stop))
        return out

    def _mark(self, start: int, stop: int) -> dict | None:
        data = self.keys.get_json(_mark_key(start, stop))
        try:
            mark = data["attributes"]
            return mark if {"items", "rows", "arrays", "failed"} <= set(mark) else None
        except (TypeError, KeyError):
            return None


def _read_chunk(keys: Keys, array, path: str, k: int, size: int) -> np.ndarray | None:
    """Chunk ``k`` of ``array``, or None where it cannot be decoded (then removed)."""
    try:
        return np.asarray(array[k * size:(k + 1) * size])
    except Exception:
        keys.delete(_chunk_key(array, path, k))
        return None


def _chunk_key(array, path: str, k: int) -> str:
    return f"{path}/" + array.metadata.encode_chunk_key((k,) + (0,) * (array.ndim - 1))


def _mark_key(start: int, stop: int) -> str:
    return f"done/{start:012d}-{stop:012d}/zarr.json"


def _q(name: str) -> str:
    return quote(name, safe="")
