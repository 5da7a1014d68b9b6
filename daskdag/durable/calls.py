"""Durable calls: ``compute_grads``, ``jacobian``, ``compute_jvps`` and ``compute_hvps`` with
``store=``, each stage's forward result (its nodes' values, and the pullback holding their
residuals) written by the task that computed it, wherever it ran; the store's keys in full:
docs/guides/durable-calls.md, "What is kept". A stage's entry, named for what its task computes
(``fwd:A+B:forward``), is ``stages/<entry>/result``, the pickled result, then its group, written
once that is durable, with the hash of the stage's input values and of the result's bytes. An
entry is used only where both hashes hold, else the stage runs again: no result is mixed with
other inputs, and a torn one is never returned. The results are pickles: open only stores you
trust.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import cloudpickle
import dask
import numpy as np

from daskdag.durable.identity import CALL, agree, claim, common, full, hash_tree, options, plain
from daskdag.durable.keys import group, is_zarr, keys_of
from daskdag.model.request import given_values
from daskdag.model.spec import Spec
from daskdag.running.programs import active_client, in_words
from daskdag.running.jobs import LAZY, as_collection, on_processes, run
from daskdag.running.lazy import Call
from daskdag.running.passes import CompiledJob, Derivative
from daskdag.transport import transports

if TYPE_CHECKING:
    from zarr.abc.store import Store as ZarrStore

CHUNK = 64 * 2 ** 20  # bytes per chunk of a stored result


def call(kind: Derivative, x: Any, *data: Any, client, local: str | None, progress: bool,
         store: str | os.PathLike | ZarrStore) -> Any:
    """A call of ``kind`` computed now (:func:`daskdag.running.jobs.call`), holding ``store``:
    its stages are read from there where it holds them, else kept there."""
    job, mine = _stored(kind, x, data, client, local, store, lazy=local == "processes")
    with opened(store, mine) as keeper:
        if local == "processes":  # (Dask's multiprocessing scheduler: the call made lazy)
            return on_processes(as_collection(replace(job, keeper=keeper)), progress)
        return run(job, client, local, progress, keep=keeper)


def lazy(kind: Derivative, x: Any, *data: Any, store: str | os.PathLike | ZarrStore) -> Call:
    """A call of ``kind`` as a Dask collection (:func:`daskdag.running.jobs.lazy`) whose forward
    tasks read their stages from ``store`` or keep them there. The store is checked (and its
    record written) now, and not held while the call waits to be computed."""
    job, mine = _stored(kind, x, data, active_client(), None, store, lazy=True)
    with opened(store, mine) as keeper:
        pass
    return as_collection(replace(job, keeper=keeper))


def _stored(kind: Derivative, x: Any, data: tuple, client, local: str | None, store: Any,
            lazy: bool = False) -> tuple[CompiledJob, dict]:
    """The job of a durable call, and what its store records of it. Its chains of nodes are not
    fused (``daskdag.fuse-chains``): each node is a stage, kept as it finishes."""
    if not isinstance(store, (str, os.PathLike)) and not is_zarr(store):
        raise TypeError(f"a call's store is a directory or a Zarr store, not "
                        f"{type(store).__name__}")
    with dask.config.set({"daskdag.fuse-chains": False}):
        program, why = kind.compile(x, data, transport=transports.for_call(client, lazy=lazy))
        job = kind.job(program, x, data, why=why,
                       where=LAZY if lazy and local is None else in_words(client, local))
    lowered = program.value.lowered
    assert lowered is not None
    return job, identity(kind, lowered.spec, lowered.plan.outputs, lowered.wrt, x, data)


def identity(kind: Derivative, spec: Spec, outputs, wrt, x: Any, data: tuple) -> dict:
    """What a call is, as its store records it: what every store records
    (:func:`daskdag.durable.identity.common`), the call's arguments, each input by hash, the
    kind's options (:func:`daskdag.durable.identity.options`) and its data by hash."""
    record = {**common(kind.dag), CALL: kind.call, "outputs": list(outputs), "wrt": list(wrt),
              "inputs": {i: hash_tree(v) for i, v in sorted(given_values(spec, x).items())},
              **options(kind)}
    for value in data:  # (compute_jvps' tangents, compute_hvps' v)
        record["tangents" if kind.call == "compute_jvps" else "directions"] = hash_tree(value)
    return plain(record)


@contextlib.contextmanager
def opened(where: str | os.PathLike | ZarrStore, mine: dict) -> Iterator[Stages]:
    """The :class:`Stages` of the store at ``where``, held for this call, whose record is
    ``mine`` (written in a new store; else :func:`daskdag.durable.identity.agree` checks it)."""
    import zarr

    keys = keys_of(where)
    claim(keys, "call")
    keys.hold()
    try:
        if agree(keys, mine) is None:
            zarr.create_group(keys.store, zarr_format=3, attributes={"daskdag": mine})
            keys.synced(["zarr.json"])
        token = hashlib.sha256(json.dumps([keys.name, mine], sort_keys=True).encode())
        yield Stages(where, keys.name, token.hexdigest()[:16])
    finally:
        keys.release()


class Stages:
    """A call's stages in its store, as its forward tasks read and write them
    (:class:`daskdag.graph.assembly.Keeper`). It pickles as where the store is, not an open
    store, so that a worker writes the stages it computes itself."""

    __slots__ = ("name", "token", "where")

    def __init__(self, where, name: str, token: str):
        self.where, self.name, self.token = where, name, token

    def __reduce__(self):
        return Stages, (self.where, self.name, self.token)

    def __repr__(self) -> str:
        return f"Stages({self.name!r})"

    def load(self, entry: str, inputs: tuple) -> tuple[bool, Any, str]:
        import zarr

        digest = hash_tree(list(inputs))
        keys, path = keys_of(self.where), _path(entry)
        mark = keys.get_json(f"{path}/zarr.json")
        attributes = mark.get("attributes") if isinstance(mark, dict) else None
        if (not isinstance(attributes, dict) or not {"inputs", "sha256"} <= set(attributes)
                or attributes["inputs"] != digest):  # (none, or computed from other inputs)
            return False, None, digest
        try:
            body = np.asarray(zarr.open_array(keys.store, path=f"{path}/result", mode="r")[:],
                              np.uint8).tobytes()
        except Exception:  # noqa: BLE001 (unreadable: the stage runs again)
            body = None
        if body is None or hashlib.sha256(body).hexdigest() != attributes["sha256"]:
            keys.delete(f"{path}/zarr.json")  # (damaged: computed again, never returned)
            return False, None, digest
        return True, pickle.loads(body), digest

    def save(self, entry: str, digest: str, result: Any) -> Any:
        import zarr

        keys, path = keys_of(self.where), _path(entry)
        body = cloudpickle.dumps(result, protocol=5)
        try:
            keys.delete(f"{path}/zarr.json")  # (incomplete until its mark is written again)
            array = zarr.create_array(keys.store, name=f"{path}/result", shape=(len(body),),
                                      chunks=(min(len(body), CHUNK) or 1,), dtype="uint8",
                                      compressors=None, fill_value=0, overwrite=True,
                                      zarr_format=3)
            array[:] = np.frombuffer(body, np.uint8)
            keys.synced([f"{path}/result/zarr.json", *(
                f"{path}/result/" + array.metadata.encode_chunk_key((k,))
                for k in range(-(-len(body) // CHUNK)))])
            keys.set_json(f"{path}/zarr.json", group({
                "inputs": digest, "sha256": hashlib.sha256(body).hexdigest(),
                "nbytes": len(body)}))
        except OSError as e:
            error = full(keys, e, f"stage {entry}",
                         "the stages written before are complete and stay usable")
            if error is None:
                raise
            raise error from e
        return pickle.loads(body)


def _path(entry: str) -> str:
    name = quote(entry, safe="")
    if len(name) > 160:  # (a file name's length is limited)
        name = name[:120] + "-" + hashlib.sha256(entry.encode()).hexdigest()[:32]
    return f"stages/{name}"
