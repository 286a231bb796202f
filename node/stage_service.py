"""The node's gRPC ``Stage`` service: accepts the boundary streams its neighbours dial.

An accepted stream is checked (Hello: protocol, run, config hash, stage secret,
boundary) and then handed to the daemon as a :class:`~node.links.StageLink`; the
handler stays alive, reading, until the peer closes the stream or the node stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from node.links import RunIdentity, StageLink, check_hello, error_message, hello, rejection_reason
from swarm._proto.swarm.v1 import stage_pb2, stage_pb2_grpc
from swarm.metrics import Metrics
from swarm.transport.frames import PROTOCOL_VERSION
from swarm.transport.shaper import UNSHAPED, LinkProfile

log = logging.getLogger(__name__)


class StageService(stage_pb2_grpc.StageServicer):
    """Accepts boundary streams for the boundaries where this node is the accepting side.

    ``accepting`` maps boundary -> (local stage, peer stage); ``attach(boundary, link)``
    gives the daemon the link and returns the coroutine that reads it until it closes.
    """

    def __init__(
        self,
        identity: RunIdentity,
        accepting: dict[int, tuple[int, int]],
        attach: Callable[[int, StageLink], object],
        metrics: Metrics,
        stages: list[int],
        profile: LinkProfile = UNSHAPED,
    ):
        self.identity, self.accepting, self.attach = identity, accepting, attach
        self.metrics, self.stages, self.profile = metrics, stages, profile

    async def Exchange(self, request_iterator, context: grpc.aio.ServicerContext):
        first = await context.read()
        problem = check_hello(first, self.identity, None, self._peer_stage)
        if problem is not None:
            code, reason = problem
            self.metrics.rejected.labels(rejection_reason(code)).inc()
            log.warning("refused a boundary stream from %s: %s", context.peer(), reason)
            await context.write(error_message(code, reason))
            return
        boundary = first.hello.boundary
        local_stage, _ = self.accepting[boundary]
        await context.write(hello(self.identity, boundary, local_stage))
        link = StageLink(boundary, context.read, context.write, self.metrics, self.profile)
        await self.attach(boundary, link)

    def _peer_stage(self, boundary: int) -> int | None:
        entry = self.accepting.get(boundary)
        return None if entry is None else entry[1]

    async def Ping(self, request: stage_pb2.PingRequest, context) -> stage_pb2.PingReply:
        return stage_pb2.PingReply(
            nonce=request.nonce,
            protocol_version=PROTOCOL_VERSION,
            node_id=self.identity.node_id,
            stages=self.stages,
        )
