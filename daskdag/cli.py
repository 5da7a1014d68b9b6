"""daskdag's command line: ``daskdag certs DIR`` writes the TLS files a secured Dask cluster needs.

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
import datetime
import ipaddress
import os
import sys
from pathlib import Path

# The names under which the recipes in deploy/ reach the scheduler: Compose's service name and
# the Kubernetes Service the dask-kubernetes operator creates for the DaskCluster "daskdag".
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1", "scheduler", "daskdag-scheduler")
FILES = {"ca": "ca.pem", "cert": "cert.pem", "key": "key.pem"}


def write_certs(directory, hosts=(), days: int = 365, force: bool = False) -> dict[str, Path]:
    """Write ``ca.pem``, ``cert.pem`` and ``key.pem`` into ``directory``; return their paths.

    ``hosts`` (names or IP addresses) are added to the certificate's alternative names, after
    :data:`DEFAULT_HOSTS`. Existing files are kept unless ``force``: replacing them locks out every
    process still holding the old ones.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = Path(directory)
    paths = {k: directory / name for k, name in FILES.items()}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} already exist; replace them with --force "
                              f"(force=True)")
    directory.mkdir(parents=True, exist_ok=True)

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "daskdag cluster CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
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
          .add_extension(ca_ski, critical=False)
          .sign(ca_key, hashes.SHA256()))

    key = ec.generate_private_key(ec.SECP256R1())
    names = []
    for h in dict.fromkeys([*DEFAULT_HOSTS, *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "daskdag")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=True, key_cert_sign=False, crl_sign=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            # One certificate for every role: it serves (scheduler, workers) and connects (all).
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))

    pem = serialization.Encoding.PEM
    paths["ca"].write_bytes(ca.public_bytes(pem))
    paths["cert"].write_bytes(cert.public_bytes(pem))
    key_bytes = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(paths["key"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_bytes)
    os.chmod(paths["key"], 0o600)  # also when the file existed with wider permissions
    return paths


def security(directory):
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="daskdag", description="daskdag's command line.")
    commands = parser.add_subparsers(dest="command", required=True)
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
    args = parser.parse_args(argv)

    if args.command == "certs":
        try:
            paths = write_certs(args.directory, args.host, days=args.days, force=args.force)
        except FileExistsError as e:
            parser.exit(1, f"daskdag certs: {e}\n")
        for p in paths.values():
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
