"""The node's side of the coordinator protocol: calls with retries, heartbeats, reports, rotations.

Every call is retried with exponential backoff and jitter while the coordinator is
unreachable (a restart is a pause), up to ``Timeouts.coordinator_down_s``. Heartbeats
start right after ``Join`` and run for the node's whole life, whatever it is doing;
their replies carry plan changes, which wake :meth:`CoordinatorClient.wait_change`.
Step, statistics and checkpoint reports leave the training loop's critical path: they
go through one ordered queue drained in the background. A report refused because its
epoch is stale is dropped with a log line (the step is redone under the new epoch); a
refusal that says this node is no longer in the run fences it (:class:`Fenced`), and a
coordinator silent for longer than ``Timeouts.coordinator_down_s`` ends the node too
(:class:`CoordinatorUnreachable`); either surfaces from :meth:`CoordinatorClient.wait_change`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from swarm.node.settings import Timeouts

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm._proto.swarm.v1 import coordinator_pb2_grpc
from swarm.core.subspace import SubspaceRotation
from swarm.io.artifacts import digest
from swarm.net.channel import open_channel
from swarm.net.credentials import session_metadata
from swarm.net.frames import rotation_from_proto
from swarm.net.tls import INSECURE, Security
from swarm.ops.metrics import Metrics

log = logging.getLogger(__name__)

T = TypeVar("T")
# UNKNOWN is not retried: it is what a handler bug looks like, not an unreachable coordinator.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class Fenced(RuntimeError):
    """The coordinator no longer counts this node in the run (declared dead and replaced)."""


class JoinRefused(RuntimeError):
    """The coordinator will not admit this node: its join token is wrong or revoked, or it speaks
    another protocol version. Retrying cannot help."""


class CoordinatorUnreachable(RuntimeError):
    """The coordinator stayed unreachable for longer than ``Timeouts.coordinator_down_s``."""


class CoordinatorClient:
    """One node's channel to the coordinator and the state it learns from it."""

    def __init__(self, address: str, timeouts: Timeouts, metrics: Metrics, security: Security = INSECURE):
        self.address, self.timeouts, self.metrics = address, timeouts, metrics
        self.channel = open_channel(address, security, timeouts.keepalive)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.node_id = ""
        self.credentials: tuple[tuple[str, str], ...] = ()  # session metadata on every call after Join
        self.plan: cpb.Plan | None = None
        self.phase = cpb.NODE_PHASE_JOINING
        self.completed_step = -1
        self.tokens_per_second = 0.0  # of the last step, as reported in heartbeats
        self.capacity = 0.0  # tokens/s of busy time in the last step, as reported in heartbeats
        self.averaging_address = ""  # this node's P2P multiaddr for replica averaging (heartbeats)
        self.subspace_version = 0
        self.run_complete = False
        self.cut_requests = 0
        self.keep_orders = 0  # HeartbeatReply.keep_orders as last heard
        self.keep: list[cpb.StageCheckpoint] = []  # the snapshots this node is to keep, as last listed
        self.audit_suspects: frozenset[str] = frozenset()  # nodes to audit at the raised rate, as last heard
        self.on_keep: Callable[[list[cpb.StageCheckpoint]], None] = lambda orders: None  # called with them
        self.fatal: Fenced | CoordinatorUnreachable | None = None
        self.rotations: dict[int, SubspaceRotation] = {}  # version -> rotation, of rotation_lineage
        self.rotation_lineage = 0
        self._changed = asyncio.Event()
        self._rotation_arrived = asyncio.Event()
        self._reports: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    # -- calls --------------------------------------------------------------------------------

    async def call(self, name: str, request, retry: bool = True):
        """``stub.<name>(request)``, retried with backoff while the coordinator is unreachable."""
        method = getattr(self.stub, name)

        def attempt():
            return method(request, timeout=self.timeouts.rpc_s, metadata=self.credentials)

        return await self._retrying(name, attempt, retry)

    async def _retrying(
        self,
        what: str,
        attempt: Callable[[], Awaitable[T]],
        retry: bool = True,
        progress: Callable[[], int] | None = None,
    ) -> T:
        """``attempt()`` until it succeeds; the give-up clock restarts whenever ``progress()`` grows
        (bytes moved), so a long transfer that keeps moving is never cut off."""
        t = self.timeouts
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + t.coordinator_down_s, t.retry_initial_s
        done = progress() if progress else 0
        while True:
            if self.fatal is not None:
                raise self.fatal
            try:
                return await attempt()
            except grpc.aio.AioRpcError as e:
                if progress is not None and progress() > done:
                    done, deadline, delay = progress(), loop.time() + t.coordinator_down_s, t.retry_initial_s
                if e.code() == grpc.StatusCode.PERMISSION_DENIED or (
                    e.code() == grpc.StatusCode.UNAUTHENTICATED and self.credentials
                ):  # replaced, or our session ended (join token revoked)
                    self._fence(e.details())
                if not retry or e.code() not in RETRYABLE:
                    raise
                if loop.time() + delay > deadline:
                    raise CoordinatorUnreachable(
                        f"coordinator {self.address} unreachable for {t.coordinator_down_s:.0f}s "
                        f"({what}: {e.code().name})"
                    ) from None
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, t.retry_max_s)

    def _fence(self, reason: str) -> None:
        fenced = Fenced(f"the coordinator refused this node ({reason}); it was replaced, exiting")
        self._fail(fenced)
        raise fenced

    def _fail(self, error: Fenced | CoordinatorUnreachable) -> None:
        if self.fatal is None:
            self.fatal = error
            self._changed.set()

    async def join(self, request: cpb.JoinRequest) -> cpb.JoinReply:
        """Join the run; logs what the coordinator found dialling this node's announced address back
        (a warning naming it when it could not reach it: the node is then placed as dial-only)."""
        reply = await self.call("Join", request)
        self.node_id, self.plan, self.run_complete = reply.node_id, reply.plan, reply.run_complete
        self.credentials = session_metadata(reply.node_id, reply.session)
        if request.announce_address and not reply.reachable:
            log.warning("not reachable: %s", reply.reachability)
        else:
            log.info("reachability: %s", reply.reachability)
        return reply

    # -- background tasks ---------------------------------------------------------------------

    def start(self, heartbeat_interval: float, watch_rotations: bool) -> None:
        """Start heartbeats and the report queue (and the rotation stream); right after Join."""
        self._tasks.append(asyncio.create_task(self._heartbeats(heartbeat_interval)))
        self._tasks.append(asyncio.create_task(self._drain_reports()))
        if watch_rotations:
            self._tasks.append(asyncio.create_task(self._watch_rotations()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.channel.close()

    def set_phase(self, phase: int) -> None:
        self.phase = phase
        self.metrics.phase.set(phase)

    def progress(
        self, step: int, tokens_per_second: float, subspace_version: int, capacity: float = 0.0
    ) -> None:
        """The hosted stages completed ``step``: the next heartbeats say so."""
        self.completed_step, self.tokens_per_second, self.capacity = step, tokens_per_second, capacity
        self.subspace_version = subspace_version
        self.metrics.subspace_version.set(subspace_version)

    async def heartbeat(self, hold: float = 0.0) -> bool:
        """One heartbeat now: report phase and progress, take in a new plan, a cut request or the end
        of the run; whether one came. ``hold``: the coordinator may keep the reply that many seconds
        while it has no news for this node (long poll)."""
        epoch = self.plan.epoch if self.plan is not None else 0
        request = cpb.HeartbeatRequest(
            hold_ms=round(hold * 1000),
            cut_requests=self.cut_requests,
            run_complete=self.run_complete,
            node_id=self.node_id,
            step=max(self.completed_step, 0),
            phase=self.phase,
            plan_epoch=epoch,
            tokens_per_second=self.tokens_per_second,
            subspace_version=self.subspace_version,
            averaging_address=self.averaging_address,
            capacity_tokens_per_second=self.capacity,
            keep_orders=self.keep_orders,
        )
        # Not retried: the next heartbeat is the retry, and it must not wait out a backoff.
        reply = await self.call("Heartbeat", request, retry=False)
        if not reply.known:
            self._fence("heartbeat answered: unknown node")
        if reply.session:
            self.credentials = session_metadata(self.node_id, reply.session)
        self.audit_suspects = frozenset(reply.audit_suspects)
        changed = False
        if reply.HasField("plan") and reply.plan.epoch != epoch:
            self.plan, changed = reply.plan, True
        if reply.run_complete and not self.run_complete:
            self.run_complete, changed = True, True
        if reply.cut_requests != self.cut_requests:
            self.cut_requests, changed = reply.cut_requests, True
        if reply.keep_orders != self.keep_orders:
            self.keep_orders, self.keep = reply.keep_orders, list(reply.keep)
            self.on_keep(self.keep)
        if changed:
            self._changed.set()
        return changed

    async def _heartbeats(self, interval: float) -> None:
        """Heartbeat about once per ``interval``, each held by the coordinator until news or the
        interval's end; after news, again at once (a second change may follow within the interval)."""
        loop = asyncio.get_running_loop()
        last_ok = loop.time()
        while True:
            sent, news = loop.time(), False
            try:
                news = await self.heartbeat(hold=interval)
                last_ok = loop.time()
            except Fenced:
                return
            except grpc.aio.AioRpcError as e:
                if loop.time() - last_ok > self.timeouts.coordinator_down_s:
                    down = self.timeouts.coordinator_down_s
                    self._fail(
                        CoordinatorUnreachable(f"no heartbeat answered for {down:.0f}s ({e.code().name})")
                    )
                    return
            if not news:
                await asyncio.sleep(max(0.0, interval - (loop.time() - sent)))

    async def wait_change(self) -> None:
        """Until something changed since the last call returned: a plan, the end of the run, a cut
        request, fencing or :meth:`notify` (held heartbeats bring changes within a round trip)."""
        await self._changed.wait()
        self._changed.clear()
        if self.fatal is not None:
            raise self.fatal

    def notify(self) -> None:
        """Wake :meth:`wait_change` (the node's own state changed, e.g. it is leaving)."""
        self._changed.set()

    # -- reports ------------------------------------------------------------------------------

    def report(self, method: str, request) -> None:
        """Queue a report (``ReportStep``, ``ReportStatistics``, ``ReportCheckpoint``); sent in order."""
        self._reports.put_nowait((method, request))
        self.metrics.pending_reports.set(self._reports.qsize())

    async def flush_reports(self) -> None:
        """Until every queued report has been answered."""
        await self._reports.join()

    async def _drain_reports(self) -> None:
        while True:
            method, request = await self._reports.get()
            try:
                reply = await self.call(method, request)
                if method == "ReportStatistics" and not reply.accepted:
                    log.error("coordinator refused the boundary statistics: %s", reply.reason)
            except grpc.aio.AioRpcError as e:
                # ABORTED: an older epoch's report (its step is redone); anything else is logged too.
                log.warning("%s of step %d dropped: %s", method, getattr(request, "step", -1), e.details())
            except (Fenced, CoordinatorUnreachable) as e:
                log.error("%s not delivered: %s", method, e)
            finally:
                self._reports.task_done()
                self.metrics.pending_reports.set(self._reports.qsize())

    # -- rotations ----------------------------------------------------------------------------

    async def _watch_rotations(self) -> None:
        """Follow the rotation stream; re-open it from the last version held whenever it breaks."""
        while True:
            after = max(self.rotations, default=0)
            request = cpb.WatchRotationsRequest(
                node_id=self.node_id, after_version=after, lineage=self.rotation_lineage
            )
            try:
                async for pb in self.stub.WatchRotations(request, metadata=self.credentials):
                    if pb.lineage < self.rotation_lineage:
                        continue
                    if pb.lineage > self.rotation_lineage:  # some of what it holds was withdrawn
                        self.rotations, self.rotation_lineage = {}, pb.lineage
                    rotation = rotation_from_proto(pb)
                    self.rotations[rotation.version] = rotation
                    self._rotation_arrived.set()
            except grpc.aio.AioRpcError as e:
                log.info("rotation stream broke (%s); re-opening", e.code().name)
            await asyncio.sleep(self.timeouts.retry_initial_s * random.uniform(1, 4))

    async def rotation(self, version: int, lineage: int) -> SubspaceRotation:
        """The rotation to ``version`` in ``lineage`` (the plan's), waiting for it up to
        ``Timeouts.rotation_s``."""

        async def arrived() -> SubspaceRotation:
            while self.rotation_lineage != lineage or version not in self.rotations:
                self._rotation_arrived.clear()
                await self._rotation_arrived.wait()
            return self.rotations[version]

        try:
            return await asyncio.wait_for(arrived(), self.timeouts.rotation_s)
        except TimeoutError:
            raise RuntimeError(f"subspace rotation {version} did not arrive") from None

    # -- artifacts ----------------------------------------------------------------------------

    async def fetch(self, key: str, size: int) -> bytes:
        """A content-addressed artifact, resumed from where a broken download stopped; hash-checked."""
        parts: list[bytes] = []
        received = 0

        async def attempt() -> None:
            nonlocal received
            request = cpb.ArtifactRequest(digest=key, offset=received)
            timeout = max(self.timeouts.rpc_s, 120)
            async for chunk in self.stub.FetchArtifact(request, timeout=timeout, metadata=self.credentials):
                if chunk.offset != received:
                    raise RuntimeError(f"artifact chunk at offset {chunk.offset}, expected {received}")
                parts.append(chunk.data)
                received += len(chunk.data)

        await self._retrying(f"fetch {key[:12]}", attempt, progress=lambda: received)
        data = b"".join(parts)
        if len(data) != size or digest(data) != key:
            raise RuntimeError(f"fetched artifact does not match digest {key[:12]} / size {size}")
        return data

    async def upload(self, key: str, data: bytes) -> None:
        """Upload an artifact in chunks, resuming after what the coordinator already holds."""
        chunk_bytes = self.timeouts.upload_chunk_bytes
        held = 0

        async def attempt() -> None:
            nonlocal held
            status = await self.stub.ArtifactStatus(
                cpb.ArtifactRequest(digest=key, node_id=self.node_id),
                timeout=self.timeouts.rpc_s,
                metadata=self.credentials,
            )
            held = status.held
            if status.complete:
                return
            chunks = [
                cpb.ArtifactChunk(
                    node_id=self.node_id,
                    digest=key,
                    offset=offset,
                    data=data[offset : offset + chunk_bytes],
                    total_size=len(data),
                )
                for offset in range(status.held, len(data), chunk_bytes)
            ]
            reply = await self.stub.UploadArtifact(
                iter(chunks), timeout=max(self.timeouts.rpc_s, 600), metadata=self.credentials
            )
            if not reply.complete:
                raise RuntimeError(f"upload of {key[:12]} ended at {reply.held} of {len(data)} bytes")
            self.metrics.checkpoint_bytes.inc(len(data) - status.held)

        await self._retrying(f"upload {key[:12]}", attempt, progress=lambda: held)
