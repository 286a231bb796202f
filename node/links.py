"""Boundary streams between stages: one bidirectional gRPC stream per boundary, either side dialling.

Whichever side opened it, a stream starts with a ``Hello`` each way (protocol version,
run id, config hash, boundary, stage, the run's stage secret, the sender's node id and
plan epoch); a mismatch is answered with an ``Error`` and the stream closes. A Hello from
another plan epoch, or from a node the plan does not name for that boundary, is refused:
a replaced node cannot feed frames into the run. After that the stream is symmetric: the
upstream side sends activation frames and MAPL/RVQ syncs, the downstream side
gradient frames and syncs. :class:`StageLink` wraps either end (the client call or the
server context) behind one ``send`` and a reader that hands every message, already
validated and converted, to a ``deliver`` callback. Sends go through a bounded queue
drained by the link's own task, so a stage computes its next microbatch while the last
one is on the wire; a full queue makes ``send`` wait (backpressure, bounded memory).
:class:`LocalLink` connects two stages hosted by the same node without a socket.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from swarm._proto.swarm.v1 import stage_pb2, stage_pb2_grpc
from swarm.codecs.base import PayloadError
from swarm.net.channel import DEFAULT_KEEPALIVE, KeepAlive, open_channel
from swarm.net.frames import PROTOCOL_VERSION, frame_from_message, to_message
from swarm.net.shaper import UNSHAPED, LinkProfile, ShapedSender
from swarm.net.tls import INSECURE, NODE_SERVER_NAME, Security
from swarm.net.uplink import UplinkMeter
from swarm.ops.metrics import Metrics
from swarm.runtime.audit import CommitmentTally
from swarm.runtime.wire import ActivationFrame, BoundarySync, GradientFrame

log = logging.getLogger(__name__)
SEND_QUEUE_MESSAGES = 4  # messages a boundary holds queued for sending before send() waits
ERROR_SEND_S = 5.0  # an Error for the peer waits at most this long for room in the send queue
CLOSE_FLUSH_S = 10.0  # tearing a link down waits at most this long for its queued messages to go out
DIAL_RETRY_S = 0.3  # between attempts to open a boundary stream to an unreachable peer
PLAN_RETRY_S = 0.05  # first retry after a peer answered from an older plan epoch (it is about to switch)

Item = ActivationFrame | GradientFrame | BoundarySync
Deliver = Callable[[Item], None]


class LinkError(RuntimeError):
    """The peer refused the stream or reported an error on it; ``boundary`` says which and
    ``peer_node_id`` who, when known."""

    def __init__(self, message: str, boundary: int | None = None, peer_node_id: str = ""):
        super().__init__(message)
        self.boundary, self.peer_node_id = boundary, peer_node_id


class BadFrameError(LinkError):
    """The peer across ``boundary`` sent a frame that failed validation: it is reported for eviction."""


@dataclass(frozen=True)
class RunIdentity:
    """What both ends of a boundary stream must agree on."""

    run_id: str
    config_hash: str
    node_id: str
    plan_epoch: int = 0


@dataclass(frozen=True)
class PlannedPeer:
    """Who the plan puts on the other side of a boundary, and the boundary's secret (both sides
    hold it for this epoch; each side's Hello proves it)."""

    stage: int
    node_id: str
    secret: str
    certificate: str = ""  # the name of its TLS certificate (mutual TLS), when the plan knows it


def hello(identity: RunIdentity, boundary: int, stage: int, secret: str) -> stage_pb2.StageMessage:
    return stage_pb2.StageMessage(
        hello=stage_pb2.Hello(
            protocol_version=PROTOCOL_VERSION,
            run_id=identity.run_id,
            config_hash=identity.config_hash,
            boundary=boundary,
            stage=stage,
            auth_token=secret,
            node_id=identity.node_id,
            plan_epoch=identity.plan_epoch,
        )
    )


def check_hello(
    msg: stage_pb2.StageMessage | object,
    identity: RunIdentity,
    boundary: int | None,
    peers_of: Callable[[int], Sequence[PlannedPeer]],
) -> tuple[int, str] | None:
    """``None`` if ``msg`` is an acceptable Hello, else ``(ErrorCode, reason)``.

    ``peers_of(boundary)`` gives the stage and node of each replica the plan puts on the other
    side of that boundary (empty for a boundary this node does not serve).
    """
    if not isinstance(msg, stage_pb2.StageMessage) or msg.WhichOneof("body") != "hello":
        return stage_pb2.ERROR_CODE_UNEXPECTED_MESSAGE, "the first message of a stream must be a Hello"
    h = msg.hello
    if h.protocol_version != PROTOCOL_VERSION:
        return (
            stage_pb2.ERROR_CODE_PROTOCOL_VERSION,
            f"protocol {h.protocol_version}, want {PROTOCOL_VERSION}",
        )
    if h.run_id != identity.run_id or h.config_hash != identity.config_hash:
        return stage_pb2.ERROR_CODE_CONFIG_MISMATCH, f"peer is in run {h.run_id} config {h.config_hash[:12]}"
    peers = [p for p in peers_of(h.boundary) if p.stage == h.stage]
    if (boundary is not None and h.boundary != boundary) or not peers:
        return (
            stage_pb2.ERROR_CODE_WRONG_BOUNDARY,
            f"boundary {h.boundary} stage {h.stage} is not served here",
        )
    if h.plan_epoch != identity.plan_epoch:  # secrets are per epoch: one side has the newer plan
        return (
            stage_pb2.ERROR_CODE_PLAN_EPOCH,
            f"node {h.node_id[:8]} at plan epoch {h.plan_epoch}; "
            f"this side follows epoch {identity.plan_epoch}",
        )
    peer = planned(peers, h.node_id)
    candidates = [peer] if peer is not None else peers
    if not any(hmac.compare_digest(h.auth_token.encode(), p.secret.encode()) for p in candidates):
        return stage_pb2.ERROR_CODE_UNAUTHENTICATED, f"wrong secret for boundary {h.boundary}"
    if peer is None:
        names = ", ".join(p.node_id[:8] for p in peers)
        return (
            stage_pb2.ERROR_CODE_PLAN_EPOCH,
            f"node {h.node_id[:8]} at plan epoch {h.plan_epoch}; this side follows epoch "
            f"{identity.plan_epoch}, which puts node(s) {names} there",
        )
    return None


def planned(peers: Sequence[PlannedPeer], node_id: str) -> PlannedPeer | None:
    """The planned peer that is ``node_id``, if any."""
    return next((p for p in peers if p.node_id == node_id), None)


def rejection_reason(code: int) -> str:
    """The ``rejected`` counter label of an error code: ``ERROR_CODE_BAD_PAYLOAD`` -> ``bad_payload``."""
    return stage_pb2.ErrorCode.Name(code).removeprefix("ERROR_CODE_").lower()


def error_message(code: int, reason: str) -> stage_pb2.StageMessage:
    return stage_pb2.StageMessage(error=stage_pb2.Error(code=code, message=reason))


def sync_to_message(sync: BoundarySync) -> stage_pb2.StageMessage:
    return stage_pb2.StageMessage(
        sync=stage_pb2.BoundarySync(
            step=sync.step,
            boundary=sync.boundary,
            mapl_gradients=sync.mapl_gradients,
            codebook_delta=sync.codebook_delta,
            mapl_projection=sync.mapl_projection,
        )
    )


class UnexpectedMessage(PayloadError):
    """A well-formed message that has no place on an open stream (a second Hello, an empty body)."""


def item_from_message(msg: stage_pb2.StageMessage) -> Item:
    """Convert a stream message to the runner's item; :class:`LinkError` for a peer's Error."""
    body = msg.WhichOneof("body")
    if body in ("hello", None):
        raise UnexpectedMessage(f"{body or 'empty'} message on an open boundary stream")
    if body == "sync":
        s = msg.sync
        return BoundarySync(s.step, s.boundary, s.mapl_gradients, s.codebook_delta, s.mapl_projection)
    if body == "error":
        name = stage_pb2.ErrorCode.Name(msg.error.code)
        raise LinkError(f"peer reported {name}: {msg.error.message}")
    return frame_from_message(msg)


class LocalLink:
    """Two stages on one node: frames are handed over in memory (still encoded bytes)."""

    def __init__(self, deliver: Deliver | None = None):
        self.deliver = deliver  # set before the first send

    async def send(self, item: Item) -> int:
        self.deliver(item)
        return item.nbytes

    async def send_error(self, code: int, reason: str) -> None:
        """The receiving stage on this node raises the error itself; nothing to send."""

    async def close(self, flush_s: float = 0.0) -> None:
        """Nothing to flush in memory."""


class StageLink:
    """One end of a boundary stream over gRPC, whichever side dialled."""

    def __init__(
        self,
        boundary: int,
        read: Callable[[], Awaitable[object]],
        write: Callable[[stage_pb2.StageMessage], Awaitable[None]],
        metrics: Metrics,
        profile: LinkProfile = UNSHAPED,
        finish: Callable[[], Awaitable[None]] | None = None,
        queue_messages: int = SEND_QUEUE_MESSAGES,
        uplink: UplinkMeter | None = None,
        tally: CommitmentTally | None = None,
    ):
        """``uplink``: measures the node's uplink from this stream's backlogged writes; ``tally``:
        keeps the commitments of the frames sent and received."""
        self.boundary, self._read, self.metrics, self._finish = boundary, read, metrics, finish
        self.uplink, self.tally = uplink, tally
        self._raw_write = write
        self._sender = ShapedSender(self._write, profile) if profile.shaped else None
        self._outbox: asyncio.Queue[stage_pb2.StageMessage | None] = asyncio.Queue(maxsize=queue_messages)
        self._send_failure: LinkError | None = None
        self._closed = False
        self._drainer = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        """Write queued messages in order; after a failure, discard the rest (no sender stays blocked)."""
        while True:
            msg = await self._outbox.get()
            self._show_depth()
            if msg is None:
                return
            if self._send_failure is not None:
                continue
            size, backlogged, started = msg.ByteSize(), not self._outbox.empty(), time.monotonic()
            try:
                if self._sender is not None:
                    await self._sender.send(msg, size)
                else:
                    await self._write(msg)
                if backlogged and self.uplink is not None:
                    self.uplink.record(size, time.monotonic() - started)
            except Exception as e:
                failure = e if isinstance(e, LinkError) else LinkError(f"boundary {self.boundary}: {e}")
                failure.boundary = self.boundary
                self._send_failure = failure

    def _show_depth(self) -> None:
        self.metrics.send_queue_depth.labels(str(self.boundary)).set(self._outbox.qsize())

    async def _enqueue(self, msg: stage_pb2.StageMessage) -> None:
        if self._send_failure is not None:
            raise self._send_failure
        await self._outbox.put(msg)
        self._show_depth()

    async def _write(self, msg: stage_pb2.StageMessage) -> None:
        """Write one message; a stream the peer already closed becomes a :class:`LinkError`."""
        try:
            await self._raw_write(msg)
        except Exception as e:  # grpc raises AioRpcError or its internal ExecuteBatchError here
            raise LinkError(
                f"boundary {self.boundary}: the stream to the peer is closed ({e})", self.boundary
            ) from None

    async def send(self, item: Item) -> int:
        """Queue one item for sending (waits while the queue is full); returns its serialized size.

        Raises the :class:`LinkError` of an earlier message that could not be written.
        """
        msg = sync_to_message(item) if isinstance(item, BoundarySync) else to_message(item)
        if self.tally is not None and isinstance(item, (ActivationFrame, GradientFrame)):
            self.tally.record("sent", self.boundary, item)
        size = msg.ByteSize()
        await self._enqueue(msg)
        self.metrics.wire_bytes.labels(str(self.boundary), _direction(item), "sent").inc(size)
        return size

    async def send_error(self, code: int, reason: str) -> None:
        try:
            await asyncio.wait_for(self._enqueue(error_message(code, reason)), ERROR_SEND_S)
        except Exception:  # the stream may already be gone; the error is logged by the caller
            log.debug("could not send error on boundary %d", self.boundary)

    async def read_into(self, deliver: Deliver) -> None:
        """Deliver every message until the stream ends; malformed messages are counted and answered."""
        while True:
            msg = await self._read()
            if msg is grpc.aio.EOF or msg is None:
                return
            try:
                item = item_from_message(msg)
            except UnexpectedMessage as e:
                await self._refuse(stage_pb2.ERROR_CODE_UNEXPECTED_MESSAGE, e)
                continue
            except PayloadError as e:
                await self._refuse(stage_pb2.ERROR_CODE_BAD_PAYLOAD, e)
                continue
            self.metrics.wire_bytes.labels(str(self.boundary), _direction(item), "received").inc(
                msg.ByteSize()
            )
            if self.tally is not None and isinstance(item, (ActivationFrame, GradientFrame)):
                self.tally.record("received", self.boundary, item)
            deliver(item)

    async def _refuse(self, code: int, error: PayloadError) -> None:
        """Count a rejected message under its error code and answer it; the stream stays open."""
        self.metrics.rejected.labels(rejection_reason(code)).inc()
        log.warning("boundary %d: rejected message: %s", self.boundary, error)
        await self.send_error(code, str(error))

    async def pump(self, deliver: Deliver, fail: Callable[[Exception], None]) -> None:
        """:meth:`read_into` until the stream ends, then tell ``fail`` why it ended.

        A peer's Error, a broken stream and a stream the peer closed all end up in
        ``fail`` as a :class:`LinkError`, so a stage waiting for this neighbour stops at
        once instead of at its step timeout (items delivered before stay queued ahead of it).
        """
        b = self.boundary
        try:
            await self.read_into(deliver)
        except LinkError as e:
            log.error("boundary %d failed: %s", b, e)
            fail(LinkError(str(e), b))
        except grpc.aio.AioRpcError as e:
            log.error("boundary %d failed: %s", b, e.details())
            fail(LinkError(f"boundary {b}: stream broke: {e.code().name}: {e.details()}", b))
        else:
            fail(LinkError(f"boundary {b}: the peer closed the stream", b))

    async def close(self, flush_s: float = CLOSE_FLUSH_S) -> None:
        """Send what is queued (for at most ``flush_s``), flush the emulated link, then half-close
        the stream (dialling side). Closing a closed link does nothing."""
        if self._closed:
            return
        self._closed = True

        async def flush() -> None:
            await self._outbox.put(None)
            await self._drainer

        try:
            await asyncio.wait_for(flush(), flush_s)
        except TimeoutError:  # the peer stopped reading: what is queued is lost with the stream
            self._drainer.cancel()
            await asyncio.gather(self._drainer, return_exceptions=True)
        if self._sender is not None:
            await self._sender.close()
        if self._finish is not None:
            await self._finish()


def _direction(item: Item) -> str:
    if isinstance(item, ActivationFrame):
        return "forward"
    return "backward" if isinstance(item, GradientFrame) else "sync"


class _NotYet(Exception):
    """The peer is not at this plan epoch yet (or already past it): worth another try."""


async def dial(
    address: str,
    identity: RunIdentity,
    boundary: int,
    local_stage: int,
    peer: PlannedPeer,
    metrics: Metrics,
    profile: LinkProfile = UNSHAPED,
    timeout: float = 30.0,
    keepalive: KeepAlive = DEFAULT_KEEPALIVE,
    security: Security = INSECURE,
    uplink: UplinkMeter | None = None,
    tally: CommitmentTally | None = None,
) -> tuple[StageLink, grpc.aio.Channel]:
    """Open the boundary stream to ``address`` and exchange Hellos; retries until ``timeout``.

    A peer that is unreachable, or that answers from another plan epoch, is tried again
    until the deadline; any other refusal is a :class:`LinkError` at once.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    not_yet = PLAN_RETRY_S
    while True:
        channel = open_channel(address, security, keepalive, peer.certificate or NODE_SERVER_NAME)
        try:
            call = stage_pb2_grpc.StageStub(channel).Exchange()
            await call.write(hello(identity, boundary, local_stage, peer.secret))
            reply = await asyncio.wait_for(call.read(), timeout=max(1.0, deadline - loop.time()))
            if isinstance(reply, stage_pb2.StageMessage) and reply.WhichOneof("body") == "error":
                if reply.error.code == stage_pb2.ERROR_CODE_PLAN_EPOCH:
                    raise _NotYet(reply.error.message)
                item_from_message(reply)  # raises LinkError with the peer's reason
            problem = check_hello(reply, identity, boundary, lambda b: [peer])
            if problem is not None:
                raise LinkError(f"boundary {boundary}: peer at {address} answered badly: {problem[1]}")
            link = StageLink(
                boundary,
                call.read,
                call.write,
                metrics,
                profile,
                call.done_writing,
                uplink=uplink,
                tally=tally,
            )
            return link, channel
        except (TimeoutError, grpc.aio.AioRpcError, _NotYet) as e:
            await channel.close()
            if loop.time() > deadline:
                raise LinkError(f"boundary {boundary}: could not reach {address}: {e}", boundary) from None
            # A peer that has not taken in the new plan yet will have it within a heartbeat's round
            # trip, unless it is still building its stages (a newcomer): back off to the usual pace.
            if isinstance(e, _NotYet):
                await asyncio.sleep(not_yet)
                not_yet = min(2 * not_yet, DIAL_RETRY_S)
            else:
                await asyncio.sleep(DIAL_RETRY_S)
        except LinkError:
            await channel.close()
            raise
