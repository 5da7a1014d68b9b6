"""TLS for a Dask cluster: ``daskdag certs DIR`` writes a CA and one certificate and key
(:func:`write_certs`); :func:`security` reads them back as a ``distributed.Security`` for the
roles a process plays. The deploy recipes (``deploy/``) use both."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    ``DEFAULT_HOSTS``. Existing files are kept unless ``force``: replacing them locks out every
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
    """``{"ca"|"cert"|"key": path}`` in ``directory``, created; ``FileExistsError`` naming the
    files already there, unless ``force``."""
    directory = Path(directory)
    paths = {k: directory / name for k, name in FILES.items()}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} already exist; replace them with --force "
                              f"(force=True)")
    directory.mkdir(parents=True, exist_ok=True)
    return paths


def _new_ca(start: datetime.datetime, end: datetime.datetime) -> tuple[Any, Any]:
    """``(certificate, private key)`` of a new self-signed CA, valid from ``start`` to ``end``,
    that may sign certificates but no other CA."""
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
    """The subject alternative names of ``hosts`` (names or IP addresses; repeats dropped)."""
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
    """``(certificate, private key)`` for ``hosts``, signed by the CA, for every role: it serves
    (scheduler, workers) and connects (all)."""
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
    """Write the three as PEM, the key (PKCS#8, unencrypted) with mode 0600, also where the
    file existed with wider permissions."""
    from cryptography.hazmat.primitives import serialization

    pem = serialization.Encoding.PEM
    paths["ca"].write_bytes(ca.public_bytes(pem))
    paths["cert"].write_bytes(cert.public_bytes(pem))
    key_bytes = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(paths["key"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_bytes)
    os.chmod(paths["key"], 0o600)


ROLES = ("scheduler", "worker", "client")


def security(directory: str | os.PathLike[str], roles: Iterable[str] = ("client",)
             ) -> distributed.Security:
    """A ``distributed.Security`` from a directory [`write_certs`][daskdag.cli.write_certs]
    filled: encryption required, the CA trusted, the certificate shown for each of ``roles`` (of
    ``ROLES``; a client's by default; a scheduler that starts its workers as batch jobs, as
    dask-jobqueue's does, needs all three). Paths are absolute, as jobs started elsewhere need them.

    >>> client = Client("tls://scheduler:8786", security=daskdag.cli.security("deploy/certs"))
    """
    from distributed import Security

    roles = tuple(roles)
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise ValueError(f"roles {unknown}: each is one of {ROLES}")
    d = Path(directory).expanduser().resolve()
    missing = [str(d / f) for f in FILES.values() if not (d / f).is_file()]
    if missing:
        raise FileNotFoundError(f"no TLS files {missing}: create them with `daskdag certs {d}`")
    cert, key = str(d / FILES["cert"]), str(d / FILES["key"])
    return Security(tls_ca_file=str(d / FILES["ca"]), require_encryption=True,
                    **{f"tls_{r}_{k}": v for r in roles for k, v in (("cert", cert), ("key", key))})
