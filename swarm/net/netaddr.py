"""Addresses that other hosts can dial.

A process bound to every interface (``0.0.0.0``, ``::`` or an empty host) must not
announce that address: peers on other hosts would dial themselves. The address to
announce instead is the one this host's routing table picks to reach the coordinator
(the interface the volunteers and the coordinator share), found without sending a
packet.
"""

from __future__ import annotations

import ipaddress
import socket

WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` (IPv6 hosts bracketed) -> (host without brackets, port); ValueError if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def local_address_towards(host: str) -> str:
    """The local IP address this host would use to reach ``host`` (a connected UDP socket sends nothing)."""
    target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(target[0], socket.SOCK_DGRAM) as probe:
        probe.connect(target[4])
        return probe.getsockname()[0]


def visible_host(bound_host: str, towards: str) -> str:
    """``bound_host`` if it is a specific address, else the interface address that reaches ``towards``."""
    if not is_wildcard(bound_host):
        return bound_host
    address = local_address_towards(towards)
    if ipaddress.ip_address(address).is_unspecified:
        raise ValueError(f"no route from this host to {towards}; pass an explicit announce address")
    return address
