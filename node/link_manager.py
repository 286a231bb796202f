"""The boundary streams of one plan epoch: dial or accept each one, then tear them all down.

For every boundary the plan shares with another node, the plan says which side dials
(see :mod:`swarm.coordinator.assignment`). Dialled peers' addresses come from the plan (the
coordinator is the authority on who hosts what); only a peer the plan holds no address
for is looked up in the DHT, under the node id the plan names. A link the plan routes through a
relay (``relay_address``: neither end can accept the other) keeps its roles: the DIAL end dials a
loopback :class:`~swarm.net.relay.RelayForwarder` that carries the connection to the relay, the
ACCEPT end parks connections there (:class:`~swarm.net.relay.RelayAcceptor`) that the relay
splices to the dialler and this node connects to its own Stage server. Accepted streams come in
through the node's :class:`~swarm.node.stage_service.StageService`, for which this manager is
the current :class:`~swarm.node.stage_service.Acceptor` while its epoch lasts. Every Hello
carries the epoch, so streams of different epochs never pair up.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import replace

import grpc
from swarm.node.links import (
    CLOSE_FLUSH_S,
    LinkError,
    PlannedPeer,
    RunIdentity,
    StageLink,
    dial,
    rejection_reason,
)
from swarm.node.schedule import StageRunner
from swarm.node.settings import NodeSettings
from swarm.node.stage_service import StageService

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm._proto.swarm.v1 import stage_pb2
from swarm.net.discovery import find_stage
from swarm.net.netaddr import join_host_port, split_host_port
from swarm.net.relay import RelayAcceptor, RelayForwarder, rendezvous_key
from swarm.ops.logs import say
from swarm.ops.metrics import Metrics

log = logging.getLogger(__name__)


def unreachable_boundaries(plan: cpb.Plan) -> list[cpb.BoundaryLink]:
    """Boundaries of ``plan`` where neither side accepts inbound connections (they need a relay)."""
    return [link for link in plan.links if link.peer_node_id and link.role == cpb.LINK_ROLE_UNSPECIFIED]


def planned_peer(link: cpb.BoundaryLink) -> PlannedPeer:
    """Who ``link`` puts on the other side of its boundary, with the boundary's secret and pin."""
    peer_stage = link.boundary + 1 if link.local_stage == link.boundary else link.boundary
    return PlannedPeer(peer_stage, link.peer_node_id, link.link_secret, link.peer_certificate)


def _fail(runner: StageRunner, peer_node_id: str, error: Exception) -> None:
    """A stream to ``peer_node_id`` ended: fail the runner's step, naming the peer."""
    if isinstance(error, LinkError) and not error.peer_node_id:
        error.peer_node_id = peer_node_id
    runner.fail(error)


class LinkManager:
    """Connects ``runners`` (this node's stages, by index) to their neighbours for ``plan``."""

    def __init__(
        self,
        identity: RunIdentity,
        plan: cpb.Plan,
        runners: dict[int, StageRunner],
        settings: NodeSettings,
        metrics: Metrics,
        service: StageService | None,
        dht=None,
        opened: set[int] | None = None,
    ):
        """``opened``: boundaries this node had streams on in earlier epochs (updated here; a
        stream opened again counts in ``swarm_stream_reconnects``)."""
        self.identity = replace(identity, plan_epoch=plan.epoch)
        self.stages = list(plan.stages)
        # (boundary, peer node) -> link: a boundary has a stream per pair of neighbouring replicas
        self.plan_links = {(link.boundary, link.peer_node_id): link for link in plan.links}
        self.runners, self.settings, self.metrics = runners, settings, metrics
        self.service, self.dht = service, dht
        self.opened = opened if opened is not None else set()
        self._ready: dict[tuple[int, str], asyncio.Future] = {}
        self._links: list[StageLink] = []
        self._tasks: list[asyncio.Task] = []
        self._channels: list[grpc.aio.Channel] = []
        self._relayed: list[RelayAcceptor | RelayForwarder] = []

    # -- Acceptor -------------------------------------------------------------------------------

    def peers_of(self, boundary: int) -> list[PlannedPeer]:
        return [
            planned_peer(link)
            for (b, _), link in self.plan_links.items()
            if b == boundary and link.role == cpb.LINK_ROLE_ACCEPT
        ]

    def local_stage(self, boundary: int) -> int:
        return next(link.local_stage for (b, _), link in self.plan_links.items() if b == boundary)

    async def attach(self, boundary: int, node_id: str, link: StageLink) -> None:
        """An accepted stream from ``node_id``: install it and read it until it closes."""
        future = self._ready.get((boundary, node_id))
        if future is None or future.done():
            self.metrics.rejected.labels(rejection_reason(stage_pb2.ERROR_CODE_WRONG_BOUNDARY)).inc()
            await link.send_error(
                stage_pb2.ERROR_CODE_WRONG_BOUNDARY,
                f"boundary {boundary} expects no (further) stream from {node_id[:8]}",
            )
            return
        task = self._install(self.plan_links[boundary, node_id], link)
        future.set_result(link)
        await task

    # -- connecting -----------------------------------------------------------------------------

    def _install(self, plan_link: cpb.BoundaryLink, link: StageLink) -> asyncio.Task:
        boundary, runner = plan_link.boundary, self.runners[plan_link.local_stage]
        deliver = runner.attach(link, plan_link.peer_node_id, downstream=plan_link.local_stage == boundary)
        self._links.append(link)
        if boundary in self.opened:
            self.metrics.reconnects.labels(str(boundary)).inc()
        self.opened.add(boundary)
        task = asyncio.create_task(
            link.pump(deliver, functools.partial(_fail, runner, plan_link.peer_node_id))
        )
        self._tasks.append(task)
        return task

    async def connect(self, run_id: str) -> None:
        """Open or accept every cross-node boundary stream of the plan (bounded by the connect timeout)."""
        timeout = self.settings.timeouts.connect_s
        loop = asyncio.get_running_loop()
        for key, link in self.plan_links.items():
            if link.role == cpb.LINK_ROLE_ACCEPT:
                self._ready[key] = loop.create_future()
        if self._ready:
            if self.service is None:
                raise LinkError(
                    "the plan has this node accept streams, but it serves none: under TLS a dial-only "
                    "node needs its certificate and key (--tls-cert/--tls-key) to accept through a relay"
                )
            self.service.acceptor = self
        for key in self._ready:
            link = self.plan_links[key]
            if link.relay_address:
                acceptor = RelayAcceptor(
                    self._relay(link), self._rendezvous(link), self.service.local_address
                )
                acceptor.start()
                self._relayed.append(acceptor)
        for (b, _), link in self.plan_links.items():
            if link.role != cpb.LINK_ROLE_DIAL:
                continue
            peer = planned_peer(link)
            if link.relay_address:
                forwarder = RelayForwarder(self._relay(link), self._rendezvous(link))
                self._relayed.append(forwarder)
                address = await forwarder.start()
            else:
                address = await self._peer_address(run_id, peer.stage, link)
            stage_link, channel = await dial(
                address,
                self.identity,
                b,
                link.local_stage,
                peer,
                self.metrics,
                self.settings.link,
                timeout=timeout,
                keepalive=self.settings.timeouts.keepalive,
                security=self.settings.security,
                uplink=self.service.uplink if self.service is not None else None,
                tally=self.service.tally if self.service is not None else None,
            )
            self._channels.append(channel)
            self._install(link, stage_link)
            pinned = f" (certificate {link.peer_certificate})" if link.peer_certificate else ""
            where = f"through relay {self._relay(link)}" if link.relay_address else f"at {address}"
            say(f"boundary {b}: dialled stage {peer.stage} {where}{pinned}")
        for (b, peer_id), future in self._ready.items():
            try:
                await asyncio.wait_for(asyncio.shield(future), timeout=timeout)
            except TimeoutError:
                raise LinkError(
                    f"boundary {b}: the neighbour {peer_id[:8]} did not dial in within {timeout:.0f}s", b
                ) from None
            link = self.plan_links[b, peer_id]
            relayed = f" through relay {self._relay(link)}" if link.relay_address else ""
            say(f"boundary {b}: accepted stream from stage {planned_peer(link).stage}{relayed}")

    def _relay(self, link: cpb.BoundaryLink) -> str:
        """The relay address of ``link``; an empty host is the coordinator's (its in-process relay)."""
        host, port = split_host_port(link.relay_address)
        return join_host_port(host or split_host_port(self.settings.coordinator)[0], port)

    def _rendezvous(self, link: cpb.BoundaryLink) -> bytes:
        """The key both ends of the relayed ``link`` present at the relay."""
        me, peer = self.identity.node_id, link.peer_node_id
        up, down = (me, peer) if link.local_stage == link.boundary else (peer, me)
        return rendezvous_key(link.link_secret, link.boundary, up, down, self.identity.plan_epoch)

    async def _peer_address(self, run_id: str, peer_stage: int, link: cpb.BoundaryLink) -> str:
        """The peer's Stage address: the coordinator's (the authority on who hosts what); the DHT
        record of the node the plan names only when the plan holds no address for it."""
        if link.peer_address or self.dht is None:
            return link.peer_address
        try:
            endpoint = await find_stage(self.dht, run_id, peer_stage, link.peer_node_id, 5.0)
        except TimeoutError:
            raise LinkError(f"no address for stage {peer_stage}: not in the plan nor in the DHT") from None
        return endpoint.address

    async def close(self, flush_s: float = CLOSE_FLUSH_S) -> None:
        """Flush (each for at most ``flush_s``) and close every stream of this epoch; stop accepting
        for it."""
        if self.service is not None and self.service.acceptor is self:
            self.service.acceptor = None
        for link in self._links:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(link.close(flush_s), timeout=flush_s + 5)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for channel in self._channels:
            await channel.close()
        for end in self._relayed:
            await end.close()
