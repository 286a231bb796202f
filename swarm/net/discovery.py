"""Stage discovery over a hivemind DHT.

The coordinator runs a DHT peer; nodes join it and publish, per hosted stage, a record
``{node_id, address}`` under ``<run_id>/stage/<index>`` with an expiry, refreshed while
they live. Neighbours look each other up there (addresses change when a node restarts
on another port); the coordinator remains the authority on who hosts which stage.

The DHT runs in-process (``DHTNode`` on the caller's event loop; hivemind only
fork-execs its ``p2pd`` daemon), not as ``hivemind.DHT``'s forked process: forking a
process whose gRPC threads are already running can deadlock the child.

Local runs and tests must never send discovery packets off the machine: the default
here is loopback listening with NAT port mapping (UPnP/NAT-PMP) off, and only an
explicit ``public=True`` (a production flag) turns port mapping on. Across hosts, each
process listens on the address it serves gRPC on (:func:`listen_maddr`) and hands out
only the multiaddrs another host can dial (:func:`reachable_maddrs`). A node whose DHT
cannot bootstrap runs without one: the coordinator's plan holds every address it needs.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

log = logging.getLogger(__name__)

LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"
RECORD_TTL_S = 60.0
BOOTSTRAP_TIMEOUT_S = 5.0


class BootstrapFailed(RuntimeError):
    """None of the initial DHT peers answered."""


def listen_maddr(host: str, port: int = 0) -> str:
    """The TCP multiaddr listening on ``host`` (an IP address; "" or "0.0.0.0": every interface)."""
    address = ipaddress.ip_address(host.strip("[]") or "0.0.0.0")
    return f"/ip{address.version}/{address}/tcp/{port}"


def _maddr_ip(maddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    parts = maddr.split("/")
    try:
        return ipaddress.ip_address(parts[2]) if len(parts) > 2 and parts[1] in ("ip4", "ip6") else None
    except ValueError:
        return None


def reachable_maddrs(maddrs: Sequence[str]) -> list[str]:
    """What another host can dial: no loopback, link-local or unspecified addresses (unless that is
    all there is, as for a peer listening on loopback only, whose peers share its host)."""

    def remote(maddr: str) -> bool:
        ip = _maddr_ip(maddr)
        return ip is None or not (ip.is_loopback or ip.is_link_local or ip.is_unspecified)

    kept = [m for m in maddrs if remote(m)]
    return kept or list(maddrs)


async def start_dht(
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = (LOOPBACK_MADDR,),
    public: bool = False,
    announce_maddrs: Sequence[str] = (),
    bootstrap_timeout: float = BOOTSTRAP_TIMEOUT_S,
) -> DHTNode:
    """Start a DHT peer on the running loop. ``public=False`` (default) keeps NAT port mapping off.

    Raises :class:`BootstrapFailed` (after shutting the peer down) when ``initial_peers``
    are given and none of them answers within ``bootstrap_timeout`` seconds.
    """
    node = await DHTNode.create(
        initial_peers=list(initial_peers),
        host_maddrs=list(host_maddrs),
        announce_maddrs=list(announce_maddrs) or None,
        nat_port_map=public,
        wait_timeout=bootstrap_timeout,
        ensure_bootstrap_success=False,
    )
    if initial_peers and not node.protocol.routing_table.peer_id_to_uid:
        await node.shutdown()
        peers = ", ".join(initial_peers)
        raise BootstrapFailed(f"no DHT peer answered within {bootstrap_timeout:.0f}s: {peers}")
    return node


async def visible_maddrs(dht: DHTNode) -> list[str]:
    """The multiaddrs other hosts can dial this peer at (see :func:`reachable_maddrs`)."""
    return reachable_maddrs([str(m) for m in await dht.protocol.p2p.get_visible_maddrs()])


@dataclass(frozen=True)
class StageEndpoint:
    node_id: str
    address: str  # host:port of the node's Stage service; empty if it only dials out


def stage_key(run_id: str, stage: int) -> str:
    return f"{run_id}/stage/{stage}"


async def publish_stage(dht: DHTNode, run_id: str, stage: int, endpoint: StageEndpoint) -> bool:
    """Publish (or refresh) the endpoint of a hosted stage for ``RECORD_TTL_S`` seconds."""
    value = {"node_id": endpoint.node_id, "address": endpoint.address}
    return bool(
        await dht.store(stage_key(run_id, stage), value, expiration_time=get_dht_time() + RECORD_TTL_S)
    )


async def find_stage(
    dht: DHTNode, run_id: str, stage: int, node_id: str | None = None, timeout: float = 30.0
) -> StageEndpoint:
    """Look up a stage's endpoint, waiting until one (published by ``node_id``, if given) appears."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        found = await dht.get(stage_key(run_id, stage), latest=True)
        if found is not None and isinstance(found.value, dict):
            endpoint = StageEndpoint(str(found.value.get("node_id", "")), str(found.value.get("address", "")))
            if node_id is None or endpoint.node_id == node_id:
                return endpoint
        if loop.time() > deadline:
            raise TimeoutError(
                f"no DHT record for stage {stage} of run {run_id} (node {node_id}) in {timeout}s"
            )
        await asyncio.sleep(0.2)
