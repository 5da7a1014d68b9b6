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
:func:`daskdag.compute_grads` / :func:`daskdag.sweep_grads` on Dask's local threaded scheduler,
or on ``--scheduler`` (``tcp://``/``tls://`` address or a scheduler ``.json`` file), and write
``<output>.value`` and ``<output>.grad.<input>`` (pytree leaves joined with their key path) to
``RESULT.npz``; a sweep stacks them over items, and with ``--errors collect`` adds
``<output>.failed``. Exit codes: 0 success; 1 a node failed (``NodeError``; or an unexpected
error, with its traceback); 2 bad usage, DAG module or inputs (``DAGError``); 3 the cluster
(an unreachable scheduler, ``ClusterError``); 4 a sweep with ``--errors collect`` in which some
items failed (results written); 5 a sweep's ``--store`` that refuses it (``StoreError``); 130
Ctrl-C.

``daskdag certs DIR`` writes the TLS files a secured Dask cluster needs.

    daskdag certs deploy/certs                    # or: python -m daskdag.cli certs deploy/certs
    daskdag certs deploy/certs --host dask.example.org --host 10.0.0.5 --days 90

writes, in DIR:

- ``ca.pem``: a new certificate authority's certificate. Every process trusts exactly the
  certificates this CA signed. Its private key is never written: to add a host or renew, run the
  command again (``--force``) and hand the new files to every process.
- ``cert.pem`` and ``key.pem`` (mode 0600): one certificate and key shared by the scheduler, the
  workers and the clients (Dask's TLS is mutual: each side shows a certificate signed by the CA).
  Its subject alternative names are ``localhost``, ``127.0.0.1``, ``::1``, the host names the
  recipes in ``deploy/`` use (``scheduler``, ``daskdag-scheduler``) and each ``--host``. Dask does
  not check host names (it trusts the CA alone), browsers and ``curl`` do, for the dashboard.

The processes use them as::

    dask scheduler --tls-ca-file ca.pem --tls-cert cert.pem --tls-key key.pem ...
    dask worker tls://SCHEDULER:8786 --tls-ca-file ca.pem --tls-cert cert.pem --tls-key key.pem ...

and a client as ``Client("tls://SCHEDULER:8786", security=daskdag.cli.security(DIR))``.

The package: :mod:`~daskdag.cli.commands` (the commands, their parser, :func:`main`),
:mod:`~daskdag.cli.loading` (the DAG module), :mod:`~daskdag.cli.npz` (input and result files),
:mod:`~daskdag.cli.connecting` (``--scheduler``), :mod:`~daskdag.cli.tls` (certificates, also
for the deploy recipes), :mod:`~daskdag.cli.usage` (exit codes). May import: all of daskdag
(the top layer); nothing imports it but the deploy recipes.
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
