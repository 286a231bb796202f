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
explicit ``public=True`` (a production flag) turns port mapping on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

LOOPBACK_MADDR = "/ip4/127.0.0.1/tcp/0"
RECORD_TTL_S = 60.0


async def start_dht(
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = (LOOPBACK_MADDR,),
    public: bool = False,
) -> DHTNode:
    """Start a DHT peer on the running loop. ``public=False`` (default) keeps NAT port mapping off."""
    return await DHTNode.create(
        initial_peers=list(initial_peers), host_maddrs=list(host_maddrs), nat_port_map=public
    )


async def visible_maddrs(dht: DHTNode) -> list[str]:
    return [str(m) for m in await dht.protocol.p2p.get_visible_maddrs()]


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
