"""Reaching the scheduler that ``--scheduler`` (``--tls``, ``--timeout``) names."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from daskdag.cli.tls import security
from daskdag.cli.usage import Unreachable, UsageError

if TYPE_CHECKING:
    import distributed


def connect(args: argparse.Namespace) -> distributed.Client | None:
    """The ``distributed.Client`` that ``--scheduler`` (``--tls``, ``--timeout``) names, or
    ``None`` for Dask's local threaded scheduler."""
    if args.scheduler is None:
        if args.tls is not None:
            raise UsageError("--tls needs --scheduler (the local scheduler has no connections)")
        return None
    from distributed import Client

    address = args.scheduler
    sec = None
    if args.tls is not None:
        try:
            sec = security(args.tls)
        except FileNotFoundError as e:
            raise UsageError(str(e)) from e
    is_file = address.endswith(".json")
    if is_file:
        path = Path(address).expanduser()
        where, kwargs = f"the scheduler of file {address}", {"scheduler_file": str(path)}
        named = address
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            named = json.loads(path.read_text()).get("address", "")
    else:
        if args.tls is not None:
            if "://" not in address:
                address = "tls://" + address
            elif not address.startswith("tls://"):
                raise UsageError(f"--tls needs a tls:// scheduler address, got {address!r}")
        where, kwargs, named = f"the scheduler at {address}", {"address": address}, address
    if str(named).startswith("tls://") and sec is None:
        from distributed import Security

        if Security().get_connection_args("client").get("ssl_context") is None:
            raise UsageError(f"the scheduler at {named} speaks TLS: give --tls DIR (the files "
                             f"`daskdag certs DIR` wrote), or set TLS in Dask's configuration")
    try:
        return Client(**kwargs, security=sec, timeout=args.timeout, set_as_default=False)
    except (OSError, TimeoutError) as e:
        if is_file and not path.exists():
            raise Unreachable(f"cannot reach {where}: the file does not exist "
                              f"(waited {args.timeout:g} s for it)") from e
        raise Unreachable(f"cannot reach {where} within {args.timeout:g} s "
                          f"({type(e).__name__}: {e})") from e
    except ValueError as e:
        raise UsageError(f"bad --scheduler {address!r}: {e}") from e


@contextlib.contextmanager
def connected(args: argparse.Namespace) -> Iterator[distributed.Client | None]:
    """:func:`connect`'s client, closed on leaving."""
    client = connect(args)
    try:
        yield client
    finally:
        if client is not None:
            client.close(timeout=10)
