"""``swarm certs``: the swarm's certificate authority and the certificates it signs.

``init`` creates ``ca.pem``/``ca.key`` and ``coordinator.pem``/``coordinator.key`` naming the
coordinator's hosts; ``issue NAME`` signs ``NAME.pem``/``NAME.key`` for a node (it names
``swarm-node``, see :mod:`swarm.net.tls`, plus any host given). Keys are ECDSA P-256,
written mode 0600; every certificate serves as both server and client certificate (mutual TLS).
Nothing is overwritten: an existing file is an error.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from swarm.net.tls import NODE_SERVER_NAME

CA_DAYS = 3650
LEAF_DAYS = 825
DEFAULT_COORDINATOR_HOSTS = ("localhost", "127.0.0.1")


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "subspace-swarm"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _alt_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_pair(directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Path:
    for suffix in (".pem", ".key"):
        if (directory / f"{name}{suffix}").exists():
            raise FileExistsError(f"{directory / (name + suffix)} exists: not overwritten")
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write(directory / f"{name}.key", key_pem, private=True)
    _write(directory / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM), private=False)
    return directory / f"{name}.pem"


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{directory / 'ca.key'} is not an EC key made by swarm certs")
    return cert, key


def _sign(
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    issuer: tuple[x509.Certificate | None, ec.EllipticCurvePrivateKey],
    days: int,
    hosts: Sequence[str] = (),
) -> x509.Certificate:
    issuer_cert, issuer_key = issuer
    now = dt.datetime.now(dt.UTC)
    is_ca = issuer_cert is None
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject if is_ca else issuer_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # tolerate clocks a little behind
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=0 if is_ca else None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )
    if is_ca:
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        builder = (
            builder.add_extension(
                x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(_alt_names(hosts)), critical=False)
        )
    return builder.sign(issuer_key, hashes.SHA256())


def issue(directory: str | Path, name: str, hosts: Sequence[str]) -> Path:
    """Sign ``NAME.pem``/``NAME.key`` with the CA in ``directory`` for ``hosts``; the certificate path."""
    if not name or "/" in name or name.startswith(".") or name == "ca":
        raise ValueError(f"{name!r} cannot name a certificate")
    if not hosts:
        raise ValueError("a certificate must name at least one host")
    where = Path(directory)
    ca = _load_ca(where)
    key = ec.generate_private_key(ec.SECP256R1())
    return _write_pair(where, name, _sign(_name(name), key.public_key(), ca, LEAF_DAYS, hosts), key)


def issue_node(directory: str | Path, name: str, hosts: Sequence[str] = ()) -> Path:
    """A node's certificate: it names ``swarm-node``, itself (what a mutual-TLS plan pins) and ``hosts``."""
    return issue(directory, name, [NODE_SERVER_NAME, name, *hosts])


def init(directory: str | Path, coordinator_hosts: Sequence[str] = DEFAULT_COORDINATOR_HOSTS) -> Path:
    """A new CA in ``directory`` (created) and the coordinator's certificate; the CA's path."""
    where = Path(directory)
    where.mkdir(parents=True, exist_ok=True)
    if (where / "ca.pem").exists() or (where / "ca.key").exists():
        raise FileExistsError(f"{where} already holds a CA: not overwritten")
    key = ec.generate_private_key(ec.SECP256R1())
    ca = _sign(_name("subspace-swarm CA"), key.public_key(), (None, key), CA_DAYS)
    path = _write_pair(where, "ca", ca, key)
    issue(where, "coordinator", coordinator_hosts)
    return path
