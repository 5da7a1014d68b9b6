"""The rules every durable store keeps, a sweep's and a call's alike: what a location may hold
(:func:`claim`), what its record must be (:func:`agree`), and a full disk (:func:`full`)."""

from __future__ import annotations

import errno

from daskdag.durable.identity import FORMAT, differences
from daskdag.durable.keys import Keys
from daskdag.errors import StoreError

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
