"""Durable calls: ``compute_grads``, ``jacobian``, ``compute_jvps`` and ``compute_hvps`` with
``store=``, each stage's forward result (its nodes' values, and the pullback holding their
residuals) written by the task that computed it, wherever it ran (:func:`daskdag.compute_grads`).

The store is the format of durable sweeps (:mod:`daskdag.sweeps.store`), under the same rules
(:mod:`daskdag.durable.rules`) and keys (:mod:`daskdag.durable.keys`); its keys in full:
docs/guides/durable-calls.md, "What is kept". Its root group's attribute "daskdag" is what the
call is (:func:`identity`). Each stage's task has an entry, named for its kind, nodes and what
it computes (``fwd:A+B:forward``), quoted: ``stages/<entry>/result``, a uint8 array of the
pickled forward result, then ``stages/<entry>/zarr.json``, written once that is durable, with
the hash of the stage's input values and of the result's bytes.

An entry is complete when its group records both hashes and the bytes still hash as it says;
the stage's inputs must hash as recorded, else (an upstream node computed something else) the
stage runs again and its entry is written anew: no result is ever mixed with inputs it was not
computed from, and a torn or corrupted one is computed again, never returned. Backward passes
run at every call: they are not stored. The results are pickles: open only stores you trust.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
import hashlib
import json
import os
import pickle
from typing import TYPE_CHECKING, Any, Iterator
from urllib.parse import quote

import cloudpickle
import dask
import numpy as np

from daskdag.durable.identity import common, hash_tree, options
from daskdag.durable.keys import Keys, is_zarr, keys_of
from daskdag.durable.rules import CALL, agree, claim, full
from daskdag.model.request import given_values
from daskdag.model.spec import Spec
from daskdag.running import log
from daskdag.running.jobs import LAZY, Job, as_collection, on_processes, run
from daskdag.running.passes import Derivative
from daskdag.running.compute import active_client
from daskdag.running.lazy import Call
from daskdag.transport import transports

if TYPE_CHECKING:
    from zarr.abc.store import Store as ZarrStore

CHUNK = 64 * 2 ** 20  # bytes per chunk of a stored result


def call(kind: Derivative, x: Any, *data: Any, client, local: str | None, progress: bool,
         store: str | os.PathLike | ZarrStore) -> Any:
    """A call of ``kind`` computed now, as :func:`daskdag.running.jobs.call` computes it, its
    stages kept in ``store`` and read from there where it holds them. The store is held by
    this call while it runs."""
    job, mine = _stored(kind, x, data, client, local, store, lazy=local == "processes")
    with opened(store, mine) as keeper:
        if local == "processes":  # (Dask's multiprocessing scheduler: the call made lazy)
            return on_processes(as_collection(_keeping(job, keeper)), progress)
        return run(job, client, local, progress, keep=keeper)


def lazy(kind: Derivative, x: Any, *data: Any, store: str | os.PathLike | ZarrStore) -> Call:
    """A call of ``kind`` as a Dask collection (:func:`daskdag.running.jobs.lazy`) whose forward
    tasks keep their stages in ``store``, or read them from there: the store is checked (and
    its record written) now; it is not held while the call waits to be computed."""
    job, mine = _stored(kind, x, data, active_client(), None, store, lazy=True)
    with opened(store, mine) as keeper:
        pass
    return as_collection(_keeping(job, keeper))


def _keeping(job: Job, keeper: Stages) -> Job:
    """``job`` whose graph keeps its stages in ``keeper`` (a lazy call's, or one computed by
    Dask's multiprocessing scheduler): every node in it (none kept between calls)."""
    stored = job.stored
    assert stored is not None  # (every kind's job keeps its stages where asked)
    return replace(job, make=lambda place, stop: stored(place, stop, keeper), later=None)


def _stored(kind: Derivative, x: Any, data: tuple, client, local: str | None, store: Any,
            lazy: bool = False) -> tuple[Job, dict]:
    """The job of a durable call, and what its store records of it. Its chains of nodes are not
    fused (``daskdag.fuse-chains``): each node is a stage, kept as it finishes."""
    if not isinstance(store, (str, os.PathLike)) and not is_zarr(store):
        raise TypeError(f"a call's store is a directory or a Zarr store, not "
                        f"{type(store).__name__}")
    with dask.config.set({"daskdag.fuse-chains": False}):  # (each node kept as it finishes)
        program, why = kind.compile(x, data, transport=transports.for_call(client, lazy=lazy))
        job = kind.job(program, x, data, why=why,
                       where=LAZY if lazy and local is None else log.where(client, local))
    lowering = program.value.lowering
    assert lowering is not None
    return job, identity(kind, lowering.spec, lowering.plan.outputs, lowering.wrt, x, data)


def identity(kind: Derivative, spec: Spec, outputs, wrt, x: Any, data: tuple) -> dict:
    """What a call is, as its store records it: what every store records
    (:func:`daskdag.durable.identity.common`), the call's arguments, each input by hash, the
    kind's options (:func:`daskdag.durable.identity.options`) and its data by hash."""
    record = {**common(kind.dag), CALL: kind.call, "outputs": list(outputs), "wrt": list(wrt),
              "inputs": {i: hash_tree(v) for i, v in sorted(given_values(spec, x).items())},
              **options(kind)}
    for value in data:  # (compute_jvps' tangents, compute_hvps' v)
        record["tangents" if kind.call == "compute_jvps" else "directions"] = hash_tree(value)
    return json.loads(json.dumps(record))


@contextlib.contextmanager
def opened(where: str | os.PathLike | ZarrStore, mine: dict) -> Iterator[Stages]:
    """The store at ``where`` held for this call, its record ``mine`` (written in a new store; else
    the stored one must be it: :func:`daskdag.durable.rules.agree`): its :class:`Stages`."""
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
    (:class:`daskdag.graph.assembly.Keeper`): picklable (where it is, not an open store), so
    that a worker writes the stages it computes itself."""

    __slots__ = ("where", "name", "token")

    def __init__(self, where, name: str, token: str):
        self.where, self.name, self.token = where, name, token

    def __reduce__(self):
        return Stages, (self.where, self.name, self.token)

    def __repr__(self) -> str:
        return f"Stages({self.name!r})"

    def load(self, entry: str, inputs: tuple) -> tuple[bool, Any, str]:
        digest = hash_tree(list(inputs))
        keys, path = self._keys(), _path(entry)
        mark = keys.get_json(f"{path}/zarr.json")
        attributes = mark.get("attributes") if isinstance(mark, dict) else None
        if not isinstance(attributes, dict) or not {"inputs", "sha256"} <= set(attributes):
            return False, None, digest
        if attributes["inputs"] != digest:  # (computed from other inputs: run again)
            return False, None, digest
        body = _read(keys, f"{path}/result")
        if body is None or hashlib.sha256(body).hexdigest() != attributes["sha256"]:
            keys.delete(f"{path}/zarr.json")  # (damaged: computed again, never returned)
            return False, None, digest
        return True, pickle.loads(body), digest

    def save(self, entry: str, digest: str, result: Any) -> Any:
        import zarr

        keys, path = self._keys(), _path(entry)
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
            keys.set_json(f"{path}/zarr.json", {
                "zarr_format": 3, "node_type": "group",
                "attributes": {"inputs": digest, "sha256": hashlib.sha256(body).hexdigest(),
                               "nbytes": len(body)}})
        except OSError as e:
            error = full(keys, e, f"stage {entry}",
                         "the stages written before are complete and stay usable")
            if error is None:
                raise
            raise error from e
        return pickle.loads(body)

    def _keys(self) -> Keys:
        return keys_of(self.where)


def _path(entry: str) -> str:
    name = quote(entry, safe="")
    if len(name) > 160:  # (a file name's length is limited)
        name = name[:120] + "-" + hashlib.sha256(entry.encode()).hexdigest()[:32]
    return f"stages/{name}"


def _read(keys: Keys, path: str) -> bytes | None:
    """The bytes of the result array at ``path``, or None where it cannot be read."""
    import zarr

    try:
        return np.asarray(zarr.open_array(keys.store, path=path, mode="r")[:],
                          np.uint8).tobytes()
    except Exception:
        return None
