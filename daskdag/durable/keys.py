"""A durable store (a sweep's, :mod:`daskdag.sweeps.store`, or a call's,
:mod:`daskdag.durable.calls`) as keys: JSON read and written whole, children listed, writes made
durable (local files: synced), and the store held by one sweep or call at a time: a lease group
renewed while held, or ``flock`` on a local directory."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from daskdag.errors import StoreError

if TYPE_CHECKING:
    from zarr.abc.store import Store as ZarrStore


def is_zarr(location) -> bool:
    """A Zarr store object (Zarr, imported only where a store is used, is loaded if so)."""
    abc = sys.modules.get("zarr.abc.store")
    return abc is not None and isinstance(location, abc.Store)


def group(attributes: dict) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes}


class Keys:
    """A Zarr store's keys, held by a lease group, renewed while held."""

    LEASE = 60.0  # seconds a lease lasts unless renewed; renewed every third of it
    CONFIRM = 0.2  # seconds between taking a lease and reading it again

    def __init__(self, store: ZarrStore, name: str):
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        self.store, self.name = store, name
        self._buffers, self._sync = default_buffer_prototype(), sync
        self._stop = threading.Event()
        self._me = f"pid {os.getpid()} on {socket.gethostname()} ({uuid.uuid4().hex[:8]})"

    def run(self, coroutine):
        """``coroutine`` run to its end on Zarr's event loop."""
        return self._sync(coroutine)

    def get_json(self, key: str):
        buf = self._sync(self.store.get(key, prototype=self._buffers))
        if buf is None:
            return None
        try:
            return json.loads(buf.to_bytes())
        except ValueError:
            return None

    def set_json(self, key: str, data: dict) -> None:
        self._set(key, json.dumps(data).encode())
        self.synced([key])

    def _set(self, key: str, body: bytes, exclusive: bool = False) -> None:
        buf = self._buffers.buffer.from_bytes(body)
        self._sync(self.store.set_if_not_exists(key, buf) if exclusive
                   else self.store.set(key, buf))

    def delete(self, key: str) -> None:
        self._sync(self.store.delete(key))

    def children(self, prefix: str) -> list[str]:
        async def names():
            return [n async for n in self.store.list_dir(prefix)]
        return self._sync(names())

    def top(self) -> list[str]:
        """The names of the keys and folders at the store's top (none where it is missing)."""
        return sorted(self.children(""))

    def synced(self, keys) -> None:
        """Keys just written, made durable (an object store's writes are)."""

    def hold(self) -> None:
        """Take the lease, or :class:`~daskdag.StoreError` when another sweep or call holds it.
        Stores whose create-if-absent is not atomic (``FsspecStore``) let two both write it: the
        lease is read again after :data:`CONFIRM` seconds, and the one whose write lost
        refuses."""
        lease = self._lease()
        self._set("lock/zarr.json", lease, exclusive=True)
        for attempt in range(2):
            held = (self.get_json("lock/zarr.json") or {}).get("attributes", {})
            if held.get("holder") != self._me:
                if held.get("until", 0) > time.time():
                    raise StoreError(f"store {self.name} is in use by another sweep or call "
                                     f"({held.get('holder', 'another process')}); wait for it "
                                     f"to end, or use another store")
                self._set("lock/zarr.json", lease)  # (its holder stopped renewing)
            if attempt == 0:
                time.sleep(self.CONFIRM)
        threading.Thread(target=self._renew, daemon=True, name="daskdag-store-lease").start()

    def _renew(self) -> None:
        while not self._stop.wait(self.LEASE / 3):
            self._set("lock/zarr.json", self._lease())

    def _lease(self) -> bytes:
        """This holder's lease, lasting :data:`LEASE` seconds from now."""
        return json.dumps(group({"holder": self._me, "until": time.time() + self.LEASE})).encode()

    def release(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):  # (the lease lapses by itself)
            self.delete("lock/zarr.json")


class _Directory(Keys):
    """A store in a local directory: writes synced to disk, held with ``flock`` on the
    directory (released when this process ends, however it ends)."""

    def __init__(self, path: Path):
        from zarr.storage import LocalStore

        super().__init__(LocalStore(path), str(path))
        self.path = path
        self._fd: int | None = None

    def synced(self, keys) -> None:
        dirs = set()
        for key in keys:
            file = self.path / key
            try:
                _fsync(file)
            except FileNotFoundError:
                continue
            dirs.add(file.parent)
        for d in dirs:
            _fsync(d)

    def set_json(self, key: str, data: dict) -> None:
        """Written beside, synced, renamed over, the directory synced: all or nothing."""
        path = self.path / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial")
        try:
            tmp.write_bytes(json.dumps(data).encode())
            _fsync(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.synced([key])

    def top(self) -> list[str]:
        if not self.path.exists():
            return []
        if not self.path.is_dir():
            raise StoreError(f"store {self.name} is a file, not a directory; nothing was "
                             f"written there. Give a directory (made if missing)")
        return sorted(os.listdir(self.path))

    def hold(self) -> None:
        """Make the directory (where missing) and hold it."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StoreError(f"store {self.name} is in use by another sweep or call; wait for "
                             f"it to end, or use another store") from None
        self._fd = fd
        for left in self.path.glob("**/*.partial"):  # (half-written by one that died)
            left.unlink(missing_ok=True)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # (releases the flock)
            self._fd = None


def keys_of(location) -> Keys:
    """The keys of the store at ``location``: a directory, or a Zarr store object."""
    if is_zarr(location):
        from zarr.storage import LocalStore

        if isinstance(location, LocalStore):
            return _Directory(Path(location.root))
        return Keys(location, str(location))
    return _Directory(Path(os.fspath(location)))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
