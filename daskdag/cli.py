"""daskdag's command line.

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
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import daskdag
from daskdag.errors import ClusterError, DAGError, NodeError, StoreError
from daskdag.model.spec import parse
from daskdag.running.compute import active_client

if TYPE_CHECKING:
    import distributed

# The names under which the recipes in deploy/ reach the scheduler: Compose's service name and
# the Kubernetes Service the dask-kubernetes operator creates for the DaskCluster "daskdag".
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1", "scheduler", "daskdag-scheduler")
FILES = {"ca": "ca.pem", "cert": "cert.pem", "key": "key.pem"}


def write_certs(directory: str | os.PathLike[str], hosts: Iterable[str] = (), days: int = 365,
                force: bool = False) -> dict[str, Path]:
    """Write ``ca.pem``, ``cert.pem`` and ``key.pem`` into ``directory``; return their paths.

    ``hosts`` (names or IP addresses) are added to the certificate's alternative names, after
    :data:`DEFAULT_HOSTS`. Existing files are kept unless ``force``: replacing them locks out every
    process still holding the old ones.
    """
    paths = _cert_paths(directory, force)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca, ca_key = _new_ca(start, end)
    cert, key = _new_cert(ca, ca_key, [*DEFAULT_HOSTS, *hosts], start, end)
    _write_pems(paths, ca, cert, key)
    return paths


def _cert_paths(directory: str | os.PathLike[str], force: bool) -> dict[str, Path]:
    """In: the certificates' directory, and whether existing files may be replaced. Out:
    ``{"ca"|"cert"|"key": path}`` in it (see :data:`FILES`), the directory created;
    ``FileExistsError`` naming the files already there, unless ``force``."""
    directory = Path(directory)
    paths = {k: directory / name for k, name in FILES.items()}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} already exist; replace them with --force "
                              f"(force=True)")
    directory.mkdir(parents=True, exist_ok=True)
    return paths


def _new_ca(start: datetime.datetime, end: datetime.datetime) -> tuple[Any, Any]:
    """In: the validity period, ``start`` and ``end`` (aware ``datetime`` objects). Out:
    ``(certificate, private key)`` of a new self-signed CA, "daskdag cluster CA", that may sign
    certificates but no other CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "daskdag cluster CA")])
    ca = (x509.CertificateBuilder()
          .subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True, crl_sign=True,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    return ca, ca_key


def _alt_names(hosts: Iterable[str]) -> list:
    """In: host names and IP addresses (as text; repeats are dropped). Out: the certificate's
    subject alternative names, ``x509.IPAddress`` for addresses, ``x509.DNSName`` for names."""
    from cryptography import x509

    names: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


def _new_cert(ca: Any, ca_key: Any, hosts: Iterable[str], start: datetime.datetime,
              end: datetime.datetime) -> tuple[Any, Any]:
    """In: the CA (certificate and key, from :func:`_new_ca`), the hosts the certificate names
    (:func:`_alt_names`) and its validity period. Out: ``(certificate, private key)``, signed by
    the CA, for every role: it serves (scheduler, workers) and connects (all)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "daskdag")]))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=True, key_cert_sign=False, crl_sign=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(_alt_names(hosts)), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def _write_pems(paths: dict[str, Path], ca: Any, cert: Any, key: Any) -> None:
    """In: the paths of :func:`_cert_paths`, the CA's certificate, the shared certificate and
    its private key. Out: nothing; the three written as PEM, the key (PKCS#8, unencrypted) with
    mode 0600, also where the file existed with wider permissions."""
    from cryptography.hazmat.primitives import serialization

    pem = serialization.Encoding.PEM
    paths["ca"].write_bytes(ca.public_bytes(pem))
    paths["cert"].write_bytes(cert.public_bytes(pem))
    key_bytes = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(paths["key"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_bytes)
    os.chmod(paths["key"], 0o600)


def security(directory: str | os.PathLike[str]) -> distributed.Security:
    """A ``distributed.Security`` for a client, from a directory :func:`write_certs` filled.

    >>> client = Client("tls://scheduler:8786", security=daskdag.cli.security("deploy/certs"))
    """
    from distributed import Security

    d = Path(directory).expanduser()
    missing = [str(d / f) for f in FILES.values() if not (d / f).is_file()]
    if missing:
        raise FileNotFoundError(f"no TLS files {missing}: create them with `daskdag certs {d}`")
    return Security(tls_ca_file=str(d / FILES["ca"]), tls_client_cert=str(d / FILES["cert"]),
                    tls_client_key=str(d / FILES["key"]), require_encryption=True)


# ------------------------------------------------------------------------------------------------
# daskdag run / daskdag sweep

EXIT_OK, EXIT_NODE, EXIT_USAGE, EXIT_CLUSTER, EXIT_ITEMS_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
EXIT_STORE = 5

EXIT_CODES = """exit codes:
  0    success (RESULT.npz written)
  1    a node failed (daskdag.NodeError: its message, and the hint if any), or an unexpected
       error (with its traceback)
  2    bad usage, DAG module or inputs (argparse errors, daskdag.DAGError, a module, attribute,
       file or npz key that is missing or wrong, an output that is not a scalar given no
       --cotangents)
  3    cluster problems: a scheduler that does not answer within --timeout, daskdag.ClusterError
  4    (sweep --errors collect) some items failed: RESULT.npz is written, with <output>.failed
  5    (sweep --store) the store holds another sweep, or another sweep is writing to it
       (daskdag.StoreError: what changed)
  130  interrupted (Ctrl-C)"""

TARGET_HELP = ("an importable module (pkg.mod, looked up from the current directory "
               "first, as `python -m` does) or a .py file (path/to/pipeline.py, loaded with its "
               "directory first on sys.path, as `python path/to/pipeline.py` does); DAG is the "
               "attribute holding the dict {name: (fn, [deps])} (dotted: obj.attr), or a "
               "zero-argument callable returning it. Default attribute: dag")

NPZ_LAYOUT = """npz layout:
  --inputs: one key per free input of the DAG, named after it. A dict-shaped input is given leaf
    by leaf, its key path joined with dots: params.w, params.b -> params = {'w': ..., 'b': ...}.
    A DAG with a single free input also takes a file with the single key arr_0 (what
    numpy.savez(file, x) writes). Keys that name no free input are an error (exit 2).
  --cotangents: the same, keyed by output names (sweep: one item's cotangent, for every item).
  RESULT.npz: <output>.value and <output>.grad.<input or node in --wrt>, pytree leaves joined
    with their key path (D.value.a, D.grad.params.w); None and non-array leaves are left out.
    sweep: every array has a leading item axis; with --errors collect, <output>.failed holds
    the indices of the failed items (their rows are NaN).
  Arrays become JAX arrays: float64 ones are computed in float32 unless JAX_ENABLE_X64=1 is set
    (on a cluster's workers too)."""


class UsageError(Exception):
    """A bad command line, DAG module or input file: exit 2, its message on stderr."""


class Unreachable(Exception):
    """No scheduler answered: exit 3."""


def load_dag(target: str) -> dict:
    """The DAG named by ``MODULE[:DAG]`` (see :data:`TARGET_HELP`), as a dict, not yet validated
    (:func:`daskdag.model.spec.parse` does that); ``UsageError`` naming what was looked for when
    it is not there."""
    module_part, attr = _split_target(target)
    if _is_file(module_part):
        module, where = _exec_file(module_part)
    else:
        module, where = _import_module(module_part), module_part
    return dict(_dag_object(module, where, attr))


def _split_target(target: str) -> tuple[str, str]:
    """In: ``MODULE[:DAG]``. Out: ``(MODULE, DAG)``, ``DAG`` ``"dag"`` where none is given (or
    what follows the last ``:`` is no dotted name, as in ``C:\\dags\\p.py``)."""
    module_part, sep, attr = target.rpartition(":")
    if not sep or not all(p.isidentifier() for p in attr.split(".")):
        module_part, attr = target, "dag"
    return module_part, attr


def _is_file(module_part: str) -> bool:
    """In: the ``MODULE`` of a target. Out: whether it names a ``.py`` file (a path) rather than
    an importable module."""
    return module_part.endswith(".py") or "/" in module_part or os.sep in module_part


def _exec_file(module_part: str) -> tuple[ModuleType, str]:
    """In: the path of a ``.py`` file. Out: ``(module, where)``: the module it defines, run with
    its directory first on ``sys.path`` (where it stays, as with ``python path/file.py``) and
    kept in ``sys.modules`` (so that pickling, by value to a cluster, finds it), and its
    resolved path as text for messages; ``UsageError`` where the file is missing or running it
    raised."""
    import importlib.util

    path = Path(module_part).expanduser()
    if not path.is_file():
        raise UsageError(f"no DAG module file {str(path)!r}" + ("" if path.suffix == ".py" else
                         " (a module name is written pkg.mod, a file path/to/file.py)"))
    path = path.resolve()
    name = path.stem if path.stem.isidentifier() else "daskdag_cli_dag"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) != str(path):
        name = f"daskdag_cli_{abs(hash(str(path)))}"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]  # (a .py file)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException as e:
        sys.modules.pop(name, None)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise UsageError(f"loading DAG module {str(path)!r} failed: {type(e).__name__}: {e}") from e
    return module, str(path)


def _import_module(module_part: str) -> ModuleType:
    """In: a module name, ``pkg.mod``. Out: the module, imported with the current directory on
    ``sys.path`` (first, as ``python -m`` has it, unless it is there already); ``UsageError``
    where there is no such module or importing it raised."""
    import importlib

    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as e:
        if e.name and (module_part == e.name or module_part.startswith(e.name + ".")):
            raise UsageError(f"no module named {module_part!r} (looked for {e.name!r} on "
                             f"sys.path, the current directory first); for a file write "
                             f"path/to/{module_part.rpartition('.')[2]}.py") from e
        raise UsageError(f"importing DAG module {module_part!r} failed: {e}") from e
    except Exception as e:
        raise UsageError(f"importing DAG module {module_part!r} failed: "
                         f"{type(e).__name__}: {e}") from e


def _dag_object(module: ModuleType, where: str, attr: str) -> Any:
    """In: the DAG module, its name or path for messages, and the (dotted) attribute ``DAG``.
    Out: the mapping there, or what calling it with no arguments returns where it is a callable;
    ``UsageError`` where there is no such attribute (listing the module's dicts and callables),
    the call raised, or the result is no mapping."""
    from collections.abc import Mapping

    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            have = sorted(k for k, v in vars(module).items()
                          if not k.startswith("_") and (isinstance(v, Mapping) or callable(v))
                          and not isinstance(v, type(sys)))
            raise UsageError(f"DAG module {where!r} has no attribute {attr!r}"
                             + (f"; dicts and callables there: {', '.join(have[:20])}" if have else ""))
        obj = getattr(obj, part)
    if not isinstance(obj, Mapping) and callable(obj):
        try:
            obj = obj()
        except Exception as e:
            raise UsageError(f"{where}:{attr} is callable, but calling it with no arguments "
                             f"failed: {type(e).__name__}: {e}") from e
    if not isinstance(obj, Mapping):
        raise UsageError(f"{where}:{attr} is a {type(obj).__name__}, not the DAG dict "
                         f"{{name: (fn, [deps])}} (nor a zero-argument callable returning it)")
    return obj


def _names(text: str | None, option: str) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError(f"{option} names nothing: give comma-separated names")
    return names


def load_npz(path: str | os.PathLike[str], names: Sequence[str], what: str,
             needed: Iterable[str] = (), single_ok: bool = False) -> dict:
    """``{name: value}`` from ``path``, keys matched against ``names`` (dotted keys: leaves of a
    dict-shaped value). ``needed`` must all be there; ``single_ok``: one name and a file with
    the single key ``arr_0`` (``numpy.savez(file, x)``) gives it."""
    import numpy as np

    p = Path(path).expanduser()
    if not p.is_file():
        raise UsageError(f"no {what} file {str(p)!r}")
    try:
        with np.load(p, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:
        raise UsageError(f"cannot read {what} file {str(p)!r} as .npz: {type(e).__name__}: {e}") from e
    if single_ok and len(names) == 1 and list(arrays) == ["arr_0"]:
        arrays = {names[0]: arrays["arr_0"]}
    by_length = sorted(names, key=len, reverse=True)
    values, extra = {}, []
    for key, a in arrays.items():
        name = next((n for n in by_length if key == n or key.startswith(n + ".")), None)
        if name is None:
            extra.append(key)
            continue
        if key == name:
            if name in values:
                raise UsageError(f"{what} file {str(p)!r} gives {name!r} both whole and leaf by leaf")
            values[name] = a
            continue
        node = values.setdefault(name, {})
        if not isinstance(node, dict):
            raise UsageError(f"{what} file {str(p)!r} gives {name!r} both whole and leaf by leaf")
        *parents, leaf = key[len(name) + 1:].split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"{what} file {str(p)!r}: key {key!r} goes below a leaf")
        if leaf in node:
            raise UsageError(f"{what} file {str(p)!r}: key {key!r} goes below a leaf")
        node[leaf] = a
    keys = ", ".join(arrays) or "none"
    for n in needed:
        if n not in values:
            raise UsageError(f"{what} file {str(p)!r} has no value for {n!r}; its keys: {keys}")
    if extra:
        raise UsageError(f"{what} file {str(p)!r} has keys that name no "
                         f"{'free input' if what == 'inputs' else 'requested output'}: "
                         f"{', '.join(extra)} (expected: {', '.join(names) or 'none'})")
    return values


def _to_jax(tree: Any) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.tree.map(jnp.asarray, tree)


def flatten(prefix: str, tree: Any) -> dict:
    """``{prefix.key.path: array}`` for the array leaves of ``tree`` (None and non-array leaves
    are left out)."""
    import jax
    import numpy as np
    from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

    def part(k: Any) -> str:
        if isinstance(k, DictKey):
            return str(k.key)
        if isinstance(k, SequenceKey):
            return str(k.idx)
        if isinstance(k, GetAttrKey):
            return k.name
        if isinstance(k, FlattenedIndexKey):
            return str(k.key)
        return str(k).strip(".[]'\"")

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, (bool, int, float, complex)) or hasattr(leaf, "__array__"):
            a = np.asarray(leaf)
            if a.dtype.kind in "biufc":
                out[".".join([prefix, *map(part, path)])] = a
    return out


def result_arrays(results: dict, inputs: Sequence[str], wrt: Sequence[str] | None) -> dict:
    """The RESULT.npz arrays of ``{output: Result}``, given the DAG's free inputs (``Spec.inputs``)
    and ``--wrt``."""
    alone = len(inputs) == 1 and (wrt is None or list(wrt) == list(inputs))
    arrays = {}
    for o, r in results.items():
        if r.value is not None:
            arrays.update(flatten(f"{o}.value", r.value))
        grads = {inputs[0]: r.grad} if alone else r.grad
        for i, g in grads.items():
            arrays.update(flatten(f"{o}.grad.{i}", g))
    return arrays


def save(path: Path, arrays: dict) -> None:
    """``numpy.savez`` to exactly ``path`` (no .npz appended), atomically."""
    import numpy as np

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _shape(a: Any) -> str:
    return f"{a.dtype}[{','.join(map(str, a.shape))}]"


def summary(arrays: dict, outputs: Iterable[str], failed: dict | None = None) -> str:
    """A table: output, its value's shape and dtype, its gradients' shapes (and failed items)."""
    rows = [("output", "value", "gradients") + (("failed",) if failed is not None else ())]
    for o in outputs:
        vals = [(f"{k[len(o) + 7:]}: " if k != f"{o}.value" else "") + _shape(a)
                for k, a in arrays.items() if k == f"{o}.value" or k.startswith(f"{o}.value.")]
        grads = [f"{k[len(o) + 6:]}: {_shape(a)}" for k, a in arrays.items()
                 if k.startswith(f"{o}.grad.")]
        rows.append((o, ", ".join(vals) or "-", ", ".join(grads) or "-")
                    + ((str(len(failed.get(o, ()))),) if failed is not None else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


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
    if not is_file and args.tls is not None:
        if "://" not in address:
            address = "tls://" + address
        elif not address.startswith("tls://"):
            raise UsageError(f"--tls needs a tls:// scheduler address, got {address!r}")
    named = address
    if is_file:
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            named = json.loads(Path(address).expanduser().read_text()).get("address", "")
    if str(named).startswith("tls://") and sec is None:
        from distributed import Security

        if Security().get_connection_args("client").get("ssl_context") is None:
            raise UsageError(f"the scheduler at {named} speaks TLS: give --tls DIR (the files "
                             f"`daskdag certs DIR` wrote), or set TLS in Dask's configuration")
    if is_file:
        where = f"the scheduler of file {address}"
        kwargs = {"scheduler_file": str(Path(address).expanduser())}
    else:
        where = f"the scheduler at {address}"
        kwargs = {"address": address}
    try:
        return Client(**kwargs, security=sec, timeout=args.timeout, set_as_default=False)
    except (OSError, TimeoutError) as e:
        if is_file and not Path(address).expanduser().exists():
            raise Unreachable(f"cannot reach {where}: the file does not exist "
                              f"(waited {args.timeout:g} s for it)") from e
        raise Unreachable(f"cannot reach {where} within {args.timeout:g} s "
                          f"({type(e).__name__}: {e})") from e
    except ValueError as e:
        raise UsageError(f"bad --scheduler {address!r}: {e}") from e


def _output_path(text: str) -> Path:
    p = Path(text).expanduser()
    if p.is_dir():
        raise UsageError(f"--out {text!r} is a directory; name the .npz file to write")
    if not p.parent.is_dir():
        raise UsageError(f"--out {text!r}: no directory {str(p.parent)!r}")
    return p


def _prepare(args: argparse.Namespace, command: str) -> tuple:
    """What ``run`` and ``sweep`` share. In: the parsed command line and the command's name. Out:
    ``(--out path, DAG dict, its Spec, outputs, wrt, x, cotangents)``, ``x`` and the cotangents
    as JAX arrays; ``UsageError`` for a bad option, module or file, ``DAGError`` (the parser's)
    for a malformed DAG."""
    out = _output_path(args.out)
    dag = load_dag(args.target)
    spec = parse(dag)
    outputs: list[str] = _names(args.outputs, "--outputs")  # type: ignore[assignment]  # (required)
    wrt = _names(args.wrt, "--wrt")
    for o in outputs:
        if o not in spec.nodes:
            kind = "a free input, not a node" if o in spec.inputs else "not a node of the DAG"
            raise UsageError(f"--outputs names {o!r}, which is {kind}; nodes: {', '.join(spec.nodes)}")
    needed = spec.ancestors(outputs)
    values = load_npz(args.inputs, spec.inputs, "inputs",
                      needed=[i for i in spec.inputs if i in needed], single_ok=True)
    cts = None
    if args.cotangents:
        cts = _to_jax(load_npz(args.cotangents, outputs, "cotangents"))
    x = values[spec.inputs[0]] if len(spec.inputs) == 1 else values
    if args.scheduler is None:
        _refuse_import_client(command)
    return out, dag, spec, outputs, wrt, _to_jax(x), cts


def _refuse_import_client(command: str) -> None:
    """In: the command's name. Out: nothing; ``UsageError`` where importing the DAG module
    started a ``distributed`` client, which a local run (no --scheduler) would not use."""
    c = active_client()
    if c is not None:
        raise UsageError(f"the DAG module started a distributed client ({c}) when imported; "
                         f"daskdag {command} runs locally unless --scheduler is given: pass "
                         f"its address there, or do not start a client at import")


def cmd_run(args: argparse.Namespace) -> int:
    import dask


    out, dag, spec, outputs, wrt, x, cts = _prepare(args, "run")
    client = connect(args)
    try:
        # Progress bars and the nodes' prints go to stderr: stdout carries the summary alone.
        with contextlib.redirect_stdout(sys.stderr), dask.config.set(scheduler="threads"):
            results = daskdag.compute_grads(dag, x, outputs, wrt=wrt, cotangents=cts,
                                            client=client, progress=args.progress)
    finally:
        if client is not None:
            client.close(timeout=10)
    arrays = result_arrays(results, spec.inputs, wrt)
    save(out, arrays)
    if not args.quiet:
        print(summary(arrays, outputs))
        print(f"wrote {out}")
    return EXIT_OK


def cmd_sweep(args: argparse.Namespace) -> int:
    import numpy as np


    out, dag, spec, outputs, wrt, xs, cts = _prepare(args, "sweep")
    batched = _names(args.batched, "--batched")
    client = connect(args)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            results = daskdag.sweep_grads(dag, xs, outputs, batched=batched, wrt=wrt, cotangents=cts,
                                          chunk_size=args.chunk_size, client=client,
                                          progress=not args.quiet, errors=args.errors,
                                          store=args.store)
    finally:
        if client is not None:
            client.close(timeout=10)
    arrays = result_arrays(results, spec.inputs, wrt)
    failed = {o: sorted(r.failed) for o, r in results.items()}
    if args.errors == "collect":
        for o in outputs:
            arrays[f"{o}.failed"] = np.asarray(failed[o], dtype=np.int64)
    save(out, arrays)
    for o, r in results.items():
        if r.value is None:
            print(f"daskdag sweep: note: no value saved for {o!r} (no item gave one, and its "
                  f"shape could not be traced)", file=sys.stderr)
    if not args.quiet:
        print(summary(arrays, outputs, failed if args.errors == "collect" else None))
        print(f"wrote {out}")
    errors: dict = {}  # item -> its error (the same for every output)
    for r in results.values():
        errors.update(r.failed)
    if errors:
        print(f"daskdag sweep: {len(errors)} item{'s' if len(errors) != 1 else ''} failed "
              f"(rows of NaN; indices in <output>.failed):", file=sys.stderr)
        for item in sorted(errors)[:10]:
            print(f"  {_one_line(errors[item])}", file=sys.stderr)
        if len(errors) > 10:
            print(f"  ... and {len(errors) - 10} more", file=sys.stderr)
        return EXIT_ITEMS_FAILED
    return EXIT_OK


def _one_line(e: BaseException) -> str:
    lines = str(e).splitlines() or [type(e).__name__]
    return lines[0]


def _node_message(e: BaseException) -> str:
    """A NodeError's first line, and its hint if any."""
    lines = str(e).splitlines()
    hint = [ln for ln in lines[1:] if ln.startswith("Hint:")]
    return "\n".join(lines[:1] + hint[-1:])


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return v
    return parse


def _common(p: argparse.ArgumentParser, sweep: bool) -> None:
    p.add_argument("target", metavar="MODULE[:DAG]", help=TARGET_HELP)
    p.add_argument("--inputs", required=True, metavar="FILE.npz",
                   help="input values, one key per free input of the DAG" +
                        (" (batched ones with a leading item axis)" if sweep else ""))
    p.add_argument("--outputs", required=True, metavar="D,E", help="node names, comma-separated")
    p.add_argument("--wrt", metavar="a,b", help="inputs (or nodes) to differentiate, comma-separated; "
                   "default: every " + ("batched " if sweep else "given ") + "input with a "
                   "floating-point leaf")
    p.add_argument("--cotangents", metavar="FILE.npz",
                   help="seeds for outputs that are not real scalars, keyed by output name"
                        + (" (one item's, for every item)" if sweep else ""))
    p.add_argument("--out", required=True, metavar="RESULT.npz", help="where to write the results")
    p.add_argument("--scheduler", metavar="ADDRESS",
                   help="a distributed scheduler: tcp://HOST:8786, tls://HOST:8786, or a scheduler "
                        "file (*.json); default: Dask's local threaded scheduler, in this process")
    p.add_argument("--tls", metavar="DIR", help="TLS files (ca.pem, cert.pem, key.pem) written by "
                   "`daskdag certs DIR`; the address gets tls:// if it has no scheme")
    p.add_argument("--timeout", type=_positive(float), default=30.0, metavar="SECONDS",
                   help="how long to try to reach the scheduler (default 30)")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="print no summary" + (" and no progress bar" if sweep else ""))
    p.add_argument("--traceback", action="store_true", help="print the traceback of errors")


def _wrap(text: str) -> str:
    """``text``'s first paragraph wrapped to 79 columns, the rest (examples) kept as is."""
    import textwrap

    first, sep, rest = text.partition("\n\n")
    return textwrap.fill(first, 79) + sep + rest


def parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    top = argparse.ArgumentParser(
        prog="daskdag", description="daskdag's command line.", epilog=EXIT_CODES,
        formatter_class=fmt)
    commands = top.add_subparsers(dest="command", required=True, metavar="{certs,run,sweep}")
    certs = commands.add_parser(
        "certs", help="write a CA and a certificate/key for a TLS-secured Dask cluster",
        description="Write ca.pem, cert.pem and key.pem (one certificate for scheduler, workers "
                    "and clients, signed by a new CA whose key is discarded) into DIR.")
    certs.add_argument("directory", metavar="DIR")
    certs.add_argument("--host", action="append", default=[], metavar="NAME",
                       help="another host name or IP address for the certificate (repeatable); "
                            f"always included: {', '.join(DEFAULT_HOSTS)}")
    certs.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    certs.add_argument("--force", action="store_true", help="replace existing files")

    run = commands.add_parser(
        "run", help="values and gradients of a DAG's outputs (daskdag.compute_grads) into an .npz",
        formatter_class=fmt, epilog=f"{NPZ_LAYOUT}\n\n{EXIT_CODES}",
        description=_wrap(
                    "Load the DAG, read its inputs, compute the outputs' values and gradients "
                    "with daskdag.compute_grads, each node once, and write them to RESULT.npz; "
                    "print a summary (output, value shape, gradient shapes) to stdout. Progress "
                    "bars and the nodes' prints go to stderr.\n\n"
                    "  daskdag run pipeline.py:dag --inputs in.npz --outputs D,E --out res.npz\n"
                    "  daskdag run mypkg.pipe:make_dag --inputs in.npz --outputs D --wrt x \\\n"
                    "      --scheduler tls://scheduler:8786 --tls certs/ --out res.npz"))
    _common(run, sweep=False)
    run.add_argument("--progress", action="store_true",
                     help="show Dask's progress bar over the call's tasks (on stderr)")

    sweep = commands.add_parser(
        "sweep", help="the same over many items (daskdag.sweep_grads), with a progress bar",
        formatter_class=fmt, epilog=f"{NPZ_LAYOUT}\n\n{EXIT_CODES}",
        description=_wrap(
                    "Load the DAG, read the items' inputs (batched inputs with a leading item "
                    "axis), compute every item's values and gradients with daskdag.sweep_grads "
                    "and write them, stacked, to RESULT.npz. A progress bar over items goes to "
                    "stderr unless --quiet.\n\n"
                    "  daskdag sweep pipeline.py --inputs items.npz --outputs D,E --out res.npz\n"
                    "  daskdag sweep pipeline.py --inputs items.npz --batched x --outputs D \\\n"
                    "      --errors collect --scheduler scheduler.json --out res.npz"))
    _common(sweep, sweep=True)
    sweep.add_argument("--batched", metavar="a,b",
                       help="the inputs that carry the item axis (default: all given); the others "
                            "are shared by every item")
    sweep.add_argument("--chunk-size", type=_positive(int), metavar="N",
                       help="items per chunk (default: daskdag's choice)")
    sweep.add_argument("--errors", choices=("raise", "collect"), default="raise",
                       help="raise: stop at the first failing item (exit 1); collect: keep going, "
                            "save the failed items' indices as <output>.failed, exit 4")
    sweep.add_argument("--store", metavar="DIR",
                       help="keep each chunk's results in DIR as it finishes; run the same "
                            "command again to resume a sweep that was cut short (it computes "
                            "only what DIR lacks); a DIR holding another sweep exits 5")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)

    if args.command == "certs":
        try:
            paths = write_certs(args.directory, args.host, days=args.days, force=args.force)
        except FileExistsError as e:
            top.exit(1, f"daskdag certs: {e}\n")
        for p in paths.values():
            print(p)
        return EXIT_OK

    name = f"daskdag {args.command}"

    def fail(code: int, message: str, e: BaseException) -> int:
        if args.traceback:
            import traceback

            traceback.print_exception(e)
        sys.stderr.write(f"{name}: error: {message}\n")
        return code

    try:
        return (cmd_run if args.command == "run" else cmd_sweep)(args)
    except KeyboardInterrupt as e:
        return fail(EXIT_INTERRUPTED, "interrupted", e)
    except NodeError as e:
        return fail(EXIT_NODE, _node_message(e) + ("" if args.traceback else
                    "\n(run with --traceback for the full traceback)"), e)
    except (UsageError, DAGError) as e:
        return fail(EXIT_USAGE, str(e), e)
    except ValueError as e:  # what a node raises is a NodeError: this is daskdag's word on the
        # call, such as an output that is not a scalar, given no --cotangents
        cli = (" (here: --cotangents FILE.npz, one key per output)"
               if "cotangents=" in str(e) else "")
        return fail(EXIT_USAGE, f"{e}{cli}" + ("" if args.traceback else
                    " (run with --traceback for the traceback)"), e)
    except (Unreachable, ClusterError) as e:
        return fail(EXIT_CLUSTER, str(e), e)
    except StoreError as e:
        return fail(EXIT_STORE, str(e), e)


if __name__ == "__main__":
    sys.exit(main())
