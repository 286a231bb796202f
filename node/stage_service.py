"""The node's gRPC ``Stage`` service: accepts the boundary streams its neighbours dial, and serves
the chunks of the snapshots it holds (:class:`~swarm.node.snapshot_server.SnapshotServer`) and, to
auditors, the boundary frames its streams kept (``FetchEvidence``: :mod:`swarm.node.auditor`).

The service lives as long as the node; what it accepts changes with the plan. Each
epoch's :class:`~swarm.node.link_manager.LinkManager` registers itself as the current
:class:`Acceptor`; an accepted stream is checked against it (Hello: protocol, run,
config hash, stage secret, boundary, planned peer node and plan epoch) and then handed
over as a :class:`~swarm.node.links.StageLink`. The handler stays alive, reading, until the
peer closes the stream, the node stops, or the epoch's links are torn down.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
from typing import Protocol

import grpc
from swarm.node.links import (
    PlannedPeer,
    RunIdentity,
    StageLink,
    check_hello,
    error_message,
    hello,
    planned,
    rejection_reason,
)
from swarm.node.snapshot_server import SnapshotServer

from swarm._proto.swarm.v1 import stage_pb2, stage_pb2_grpc
from swarm.net.frames import PROTOCOL_VERSION, activation_to_proto, gradient_to_proto
from swarm.net.shaper import UNSHAPED, LinkProfile
from swarm.net.uplink import UplinkMeter
from swarm.ops.metrics import Metrics
from swarm.runtime.audit import DIRECTIONS, SIDES, CommitmentTally
from swarm.runtime.wire import ActivationFrame

log = logging.getLogger(__name__)
HELLO_S = 10.0  # a stream whose Hello has not arrived by then is dropped (it holds a server slot)
# Streams from one host still waiting for their Hello: a planned neighbour opens one per boundary
# it shares with this node; more is someone holding server slots open.
MAX_PENDING_PER_HOST = 8


class Acceptor(Protocol):
    """What one plan epoch accepts: the boundaries where this node is the accepting side."""

    identity: RunIdentity
    stages: list[int]

    def peers_of(self, boundary: int) -> list[PlannedPeer]: ...

    def local_stage(self, boundary: int) -> int: ...

    async def attach(self, boundary: int, node_id: str, link: StageLink) -> None: ...


_REFUSE_ALL = stage_pb2.ERROR_CODE_PLAN_EPOCH, "this node follows no plan yet"


def _certificate_problem(context: grpc.aio.ServicerContext, peer: PlannedPeer) -> tuple[int, str] | None:
    """Under mutual TLS with the peer's certificate in the plan: refuse a client whose certificate
    has another name (a node of the swarm's CA holding a leaked secret is still not that node)."""
    if not peer.certificate:
        return None
    names = context.auth_context().get("x509_common_name", [])
    if names == [peer.certificate.encode()]:
        return None
    shown = b",".join(names).decode(errors="replace") or "none"
    return (
        stage_pb2.ERROR_CODE_UNAUTHENTICATED,
        f"client certificate {shown}, the plan names {peer.certificate}",
    )


class StageService(stage_pb2_grpc.StageServicer):
    """Accepts boundary streams for whichever :class:`Acceptor` is current (``None``: refuse all)."""

    def __init__(
        self, metrics: Metrics, profile: LinkProfile = UNSHAPED, tally: CommitmentTally | None = None
    ):
        self.metrics, self.profile = metrics, profile
        self.uplink = UplinkMeter()  # from every boundary stream of this node (accepted or dialled)
        self.tally = tally  # the commitments of the frames on every stream it accepts
        self.acceptor: Acceptor | None = None
        self.node_id = ""
        self.local_address = ""  # host:port this node reaches its own server at (where a relay's streams go)
        self.pending: collections.Counter[str] = collections.Counter()  # host -> streams before Hello
        self.snapshots: SnapshotServer | None = None  # set once the node joined a run
        self.evidence_secret = ""  # the current epoch's Plan.evidence_secret (empty: no audits)

    async def Exchange(self, request_iterator, context: grpc.aio.ServicerContext):
        host = context.peer().rpartition(":")[0]  # "ipv4:10.0.0.2:51234" -> "ipv4:10.0.0.2"
        if self.pending[host] >= MAX_PENDING_PER_HOST:
            self.metrics.rejected.labels("stream_limit").inc()
            why = f"more than {MAX_PENDING_PER_HOST} streams from {host} are waiting for their Hello"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
        self.pending[host] += 1
        try:
            first = await asyncio.wait_for(context.read(), HELLO_S)
        except TimeoutError:
            self.metrics.rejected.labels("hello_timeout").inc()
            log.warning("dropped a boundary stream from %s: no Hello within %.0fs", context.peer(), HELLO_S)
            return
        finally:
            self.pending[host] -= 1
            if not self.pending[host]:
                del self.pending[host]
        acceptor = self.acceptor
        problem = _REFUSE_ALL
        if acceptor is not None:
            problem = check_hello(first, acceptor.identity, None, acceptor.peers_of)
        if problem is None:
            peer = planned(acceptor.peers_of(first.hello.boundary), first.hello.node_id)
            problem = _certificate_problem(context, peer)
        if problem is not None:
            code, reason = problem
            self.metrics.rejected.labels(rejection_reason(code)).inc()
            log.warning("refused a boundary stream from %s: %s", context.peer(), reason)
            await context.write(error_message(code, reason))
            return
        boundary = first.hello.boundary
        await context.write(hello(acceptor.identity, boundary, acceptor.local_stage(boundary), peer.secret))
        link = StageLink(
            boundary,
            context.read,
            context.write,
            self.metrics,
            self.profile,
            uplink=self.uplink,
            tally=self.tally,
        )
        try:
            await acceptor.attach(boundary, peer.node_id, link)
        finally:  # what is queued goes out before the call ends (e.g. a refusal's Error)
            await link.close()

    async def FetchSnapshot(self, request: stage_pb2.SnapshotRequest, context: grpc.aio.ServicerContext):
        if self.snapshots is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node has joined no run yet")
        async for chunk in self.snapshots.serve(request, context):
            yield chunk

    async def FetchEvidence(self, request: stage_pb2.EvidenceRequest, context: grpc.aio.ServicerContext):
        secret = self.evidence_secret
        if not secret or not hmac.compare_digest(request.access.encode(), secret.encode()):
            self.metrics.rejected.labels("evidence_access").inc()
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, "evidence needs this epoch's evidence secret"
            )
        if request.side not in SIDES or request.direction not in DIRECTIONS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"side must be one of {SIDES}, direction of {DIRECTIONS}"
            )
        frame = None
        if self.tally is not None:
            frame = self.tally.kept(
                request.step, request.boundary, request.direction, request.microbatch, request.side
            )
        if frame is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, "no such frame kept (never seen, or older than the window)"
            )
        if isinstance(frame, ActivationFrame):
            return stage_pb2.EvidenceReply(activation=activation_to_proto(frame))
        return stage_pb2.EvidenceReply(gradient=gradient_to_proto(frame))

    async def Ping(self, request: stage_pb2.PingRequest, context) -> stage_pb2.PingReply:
        acceptor = self.acceptor
        return stage_pb2.PingReply(
            nonce=request.nonce,
            protocol_version=PROTOCOL_VERSION,
            node_id=self.node_id,
            stages=acceptor.stages if acceptor is not None else [],
        )
