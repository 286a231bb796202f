"""Transport security of every gRPC channel and server: TLS from the swarm's CA, or clear text.

One CA per swarm (``swarm certs``). The coordinator's certificate names its public host. A
node's certificate names ``swarm-node`` (plus any host it is given), and nodes dial each other
with that name as the TLS target: a volunteer's address changes with its network, so the
certificate proves only that the peer belongs to this swarm; which node it is, the boundary's
link secret proves in the Hello. With ``mutual`` every server also requires a client
certificate from the CA, so nobody without one can open a connection at all.

Clear text is for loopback and for an operator who says ``--insecure`` (logged as a warning).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

NODE_SERVER_NAME = "swarm-node"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Security:
    """PEM bytes of the CA, this process's certificate and key; no CA means clear text."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    mutual: bool = False

    @property
    def tls(self) -> bool:
        return self.ca is not None

    def __str__(self) -> str:
        return "mutual TLS" if self.mutual else "TLS" if self.tls else "clear text"

    @classmethod
    def from_files(
        cls,
        ca: str | Path,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        mutual: bool = False,
    ) -> Security:
        """Read the PEM files (``cert`` and ``key`` together or neither); OSError/ValueError if unusable."""
        if (cert is None) != (key is None):
            raise ValueError("a certificate needs its key and a key its certificate")
        security = cls(
            Path(ca).read_bytes(),
            Path(cert).read_bytes() if cert is not None else None,
            Path(key).read_bytes() if key is not None else None,
            mutual,
        )
        for name, pem in (("CA", security.ca), ("certificate", security.cert)):
            if pem is not None and b"-----BEGIN CERTIFICATE-----" not in pem:
                raise ValueError(f"the {name} file holds no PEM certificate")
        if mutual and security.cert is None:
            raise ValueError("mutual TLS needs this process's certificate and key")
        return security

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError("a TLS server needs a certificate and key (swarm certs)")
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.mutual
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def add_port(self, server: grpc.aio.Server | grpc.Server, address: str) -> int:
        """Bind ``address`` on ``server`` with this security; the bound port."""
        if not self.tls:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.server_credentials())

    def _open(self, api, address: str, options: Sequence[tuple[str, object]], server_name: str | None):
        """A channel from ``api`` (``grpc`` or ``grpc.aio``: the same channel functions)."""
        if not self.tls:
            return api.insecure_channel(address, options=list(options))
        pinned = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        return api.secure_channel(address, self.channel_credentials(), options=[*options, *pinned])

    def aio_channel(
        self, address: str, options: Sequence[tuple[str, object]] = (), server_name: str | None = None
    ) -> grpc.aio.Channel:
        """An asyncio channel to ``address``; ``server_name``: the name the server's certificate must hold
        (default: the host of ``address``)."""
        return self._open(grpc.aio, address, options, server_name)

    def channel(
        self, address: str, options: Sequence[tuple[str, object]] = (), server_name: str | None = None
    ) -> grpc.Channel:
        """A blocking channel, like :meth:`aio_channel`."""
        return self._open(grpc, address, options, server_name)


INSECURE = Security()


def cli_flags(folder: str | Path, name: str, mutual: bool = True) -> list[str]:
    """The command-line flags that give a process certificate ``name`` from ``swarm certs`` in ``folder``."""
    where = Path(folder)
    flags = ["--tls-ca", str(where / "ca.pem"), "--tls-cert", str(where / f"{name}.pem")]
    return [*flags, "--tls-key", str(where / f"{name}.key"), *(["--mutual-tls"] if mutual else [])]


def is_loopback(address: str) -> bool:
    """Whether ``host:port`` (or a bare host) names this machine only."""
    host = address.rpartition(":")[0] if address.count(":") == 1 or address.startswith("[") else address
    host = host.strip("[]") or address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_arguments(parser: argparse.ArgumentParser, server: bool = True) -> None:
    """``--tls-ca/--tls-cert/--tls-key``, ``--mutual-tls`` and ``--insecure``."""
    g = parser.add_argument_group("transport security (files from `swarm certs`)")
    g.add_argument("--tls-ca", help="the swarm's CA certificate (PEM)")
    need = "required with --tls-ca" if server else "for mutual TLS"
    g.add_argument("--tls-cert", help=f"this process's certificate (PEM; {need})")
    g.add_argument("--tls-key", help=f"this process's private key (PEM; {need})")
    g.add_argument(
        "--mutual-tls", action="store_true", help="servers require a client certificate from the CA"
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="clear text gRPC (default only when every address is loopback)",
    )


def from_args(args: argparse.Namespace, prog: str, addresses: Sequence[str], server: bool = True) -> Security:
    """The security the flags ask for; otherwise ``prog``'s message on stderr and exit status 2.

    Without ``--tls-ca`` it is clear text: silently when every address in ``addresses`` is
    loopback, with a warning under ``--insecure``, and an error otherwise.
    """
    try:
        return _security(args, addresses, server)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _security(args: argparse.Namespace, addresses: Sequence[str], server: bool) -> Security:
    if args.tls_ca:
        if args.insecure:
            raise ValueError("--insecure and --tls-ca contradict each other")
        if server and not (args.tls_cert and args.tls_key):
            raise ValueError("a TLS server needs --tls-cert and --tls-key (swarm certs)")
        try:
            return Security.from_files(args.tls_ca, args.tls_cert, args.tls_key, args.mutual_tls)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot use the TLS files: {e}") from None
    if args.tls_cert or args.tls_key or args.mutual_tls:
        raise ValueError("--tls-cert, --tls-key and --mutual-tls need --tls-ca")
    if args.insecure:
        log.warning("clear-text gRPC (--insecure): anyone on the path can read and alter the traffic")
        return INSECURE
    outside = [a for a in addresses if a and not is_loopback(a)]
    if outside:
        raise ValueError(
            f"{', '.join(outside)} is not loopback: give --tls-ca/--tls-cert/--tls-key "
            "(create them with `swarm certs`) or say --insecure"
        )
    return INSECURE
