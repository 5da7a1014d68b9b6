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
    directory = Path(directory)
    paths = {k: directory / name for k, name in FILES.items()}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} already exist; replace them with --force "
                              f"(force=True)")
    from cryptography.hazmat.primitives import serialization

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca, ca_key = _certificate(start, end)
    cert, key = _certificate(start, end, (ca, ca_key), [*DEFAULT_HOSTS, *hosts])
    pem = serialization.Encoding.PEM
    paths["ca"].write_bytes(ca.public_bytes(pem))
    paths["cert"].write_bytes(cert.public_bytes(pem))
    # The key (PKCS#8, unencrypted) with mode 0600, also where the file was wider open.
    fd = os.open(paths["key"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    os.chmod(paths["key"], 0o600)
    return paths


def _certificate(start: datetime.datetime, end: datetime.datetime, issuer: tuple | None = None,
                 hosts: Iterable[str] = ()) -> tuple[Any, Any]:
    """``(certificate, private key)``, valid from ``start`` to ``end``. Without ``issuer``, a
    self-signed CA that may sign certificates but no other CA; else one signed by ``issuer``
    (``(CA certificate, CA key)``) for ``hosts`` (names or IP addresses), for every role: it
    serves (scheduler, workers) and connects (all)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    is_ca = issuer is None
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                         "daskdag cluster CA" if is_ca else "daskdag")])
    usage = x509.KeyUsage(digital_signature=not is_ca, content_commitment=False,
                          key_encipherment=False, data_encipherment=False,
                          key_agreement=not is_ca, key_cert_sign=is_ca, crl_sign=is_ca,
                          encipher_only=False, decipher_only=False)
    builder = (x509.CertificateBuilder()
               .subject_name(name).issuer_name(name if issuer is None else issuer[0].subject)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=0 if is_ca else None),
                              critical=True)
               .add_extension(usage, critical=True))
    if issuer is not None:
        alt_names: list[x509.GeneralName] = []
        for h in dict.fromkeys(hosts):
            try:
                alt_names.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                alt_names.append(x509.DNSName(h))
        ca_ski = issuer[0].extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        builder = (builder
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                         ExtendedKeyUsageOID.CLIENT_AUTH]),
                                  critical=False)
                   .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
                   .add_extension(
                       x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                       critical=False))
    builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                                    critical=False)
    return builder.sign(key if issuer is None else issuer[1], hashes.SHA256()), key


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
