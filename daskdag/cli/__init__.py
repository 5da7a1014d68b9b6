"""daskdag's command line (the ``daskdag`` command, also ``python -m daskdag.cli``).

    daskdag run MODULE[:DAG] --inputs IN.npz --outputs D,E [--wrt a,b] [--cotangents CT.npz]
                [--scheduler ADDRESS [--tls DIR] [--timeout S]] [--progress] --out RESULT.npz
    daskdag sweep MODULE[:DAG] --inputs ITEMS.npz --outputs D,E [--batched a,b] [--wrt a,b]
                [--chunk-size N] [--errors raise|collect] [--store DIR] [--scheduler ...]
                --out RESULT.npz
    daskdag certs DIR [--host NAME ...] [--days N] [--force]

``run`` and ``sweep`` load the DAG dict (``MODULE`` a module name or a ``.py`` file, ``DAG`` the
attribute holding it, default ``dag``, or a zero-argument callable returning it), read the inputs
from an ``.npz`` (one key per free input; ``params.w`` keys build dict inputs), call
:func:`daskdag.compute_grads` / :func:`daskdag.sweep_grads` on Dask's local threaded scheduler
or on ``--scheduler`` (an address or a scheduler ``.json`` file), and write ``<output>.value``
and ``<output>.grad.<input>`` (pytree leaves joined with their key path) to ``RESULT.npz``; a
sweep stacks them over items, and with ``--errors collect`` adds ``<output>.failed``. Exit
codes: :data:`daskdag.cli.usage.EXIT_CODES`.

``daskdag certs DIR`` writes the TLS files a secured Dask cluster needs (:mod:`daskdag.cli.tls`):
``ca.pem``, a new CA whose private key is never written (to add a host or renew, run it again
with ``--force`` and hand the new files to every process); ``cert.pem`` and ``key.pem`` (mode
0600), one certificate shared by every role, for ``localhost``, the recipes' host names and each
``--host`` (Dask trusts the CA alone; browsers check host names, for the dashboard)::

    dask scheduler --tls-ca-file ca.pem --tls-cert cert.pem --tls-key key.pem ...
    dask worker tls://SCHEDULER:8786 --tls-ca-file ca.pem --tls-cert cert.pem --tls-key key.pem ...
    Client("tls://SCHEDULER:8786", security=daskdag.cli.security(DIR))

May import: all of daskdag (the top layer); nothing imports it but the deploy recipes.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from daskdag.cli.commands import parser
    from daskdag.cli.tls import security, write_certs


def main(argv: Sequence[str] | None = None) -> int:
    """The ``daskdag`` command with the arguments ``argv`` (default: this process's); returns
    its exit code. ``daskdag --version`` answers before JAX, Dask and daskdag's modules are
    imported (which take seconds); every other command imports them first."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args in (["--version"], ["-V"]):
        print(f"daskdag {metadata.version('daskdag')}")
        return 0
    return importlib.import_module("daskdag.cli.commands").main(args)


def __getattr__(name: str) -> Any:
    where = {"parser": "daskdag.cli.commands", "security": "daskdag.cli.tls",
             "write_certs": "daskdag.cli.tls"}
    if name in where:
        return getattr(importlib.import_module(where[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["main", "parser", "security", "write_certs"]
