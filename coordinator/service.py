"""The ``swarm.v1.Coordinator`` gRPC service (grpc.aio) and the server that hosts it.

All handlers run on one event loop and never await while they change the membership,
so the in-memory plan needs no lock; every change is written through to SQLite
(:mod:`coordinator.state`) and a restarted coordinator resumes from there.

Calls after ``Join`` are authorised by the node id alone (a random uuid4 only the node
and the coordinator know). ``Status``, ``GetRunConfig`` and ``FetchArtifact`` are open.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NoReturn

import grpc

from coordinator.assignment import assign, links_for, stages_of
from coordinator.rotation import Rejected, RotationCollector
from coordinator.state import CoordinatorState, NodeRecord, SavedStatistic
from swarm._proto.swarm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from swarm.artifacts import CHUNK_BYTES, digest, matrix_to_bytes
from swarm.config import RunConfig, config_hash
from swarm.metrics import Metrics
from swarm.pipeline import initial_artifacts
from swarm.subspace import SubspaceRotation
from swarm.transport.frames import PROTOCOL_VERSION, rotation_to_proto

MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # a second coordinator on a taken port must fail, not share it
]


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    """Membership, stage assignment, artifacts, rotations and progress of one run.

    ``token`` is the join secret; ``state_path`` the SQLite file (created, or resumed if it
    holds this run); ``run_id`` names a new run (None: a fresh id); ``dht_peers`` are the
    multiaddrs handed to joining nodes. Call :meth:`start` on the serving loop and
    :meth:`close` after the server stopped (:class:`CoordinatorServer` does both).
    """

    def __init__(
        self,
        config: RunConfig,
        token: str,
        state_path: str | Path,
        run_id: str | None,
        metrics: Metrics,
        dht_peers: list[str],
        dead_after_s: float = 15.0,
        heartbeat_interval_ms: int = 1000,
    ):
        self.config = config
        self.config_json = config.to_json()
        self.config_hash = config_hash(config)
        self.token = token.encode()
        self.metrics = metrics
        self.dht_peers = list(dht_peers)
        self.dead_after_s = dead_after_s
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.state = CoordinatorState(state_path)
        try:
            run = self.state.open_run(run_id, config)
        except BaseException:
            self.state.close()
            raise
        self.run_id, self.auth_token, self.plan_epoch = run.id, run.auth_token, run.plan_epoch
        fixed, basis = initial_artifacts(config)
        embedding = matrix_to_bytes(fixed)
        self.embedding_digest = digest(embedding)
        self.artifacts = {self.embedding_digest: embedding}
        self.watchers: set[asyncio.Queue[SubspaceRotation | None]] = set()
        self.closing = False
        self.rotation = RotationCollector(config, basis, self.state.last_rotation())
        for stat in self.state.statistics():
            with contextlib.suppress(Rejected):
                self._offer(stat)
        # Resumed nodes that were alive get a full dead_after_s to heartbeat again.
        self.nodes = {node.id: node for node in self.state.nodes()}
        now = time.monotonic()
        self.last_seen = dict.fromkeys(self.nodes, now)
        self.reaper: asyncio.Task[None] | None = None
        metrics.subspace_version.set(self.rotation.version)
        self._update_alive()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start declaring silent nodes dead (needs a running event loop)."""
        self.reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    def end_streams(self) -> None:
        """Finish every WatchRotations stream (before the server's grace period starts)."""
        self.closing = True
        for queue in self.watchers:
            queue.put_nowait(None)

    async def close(self) -> None:
        """Stop the reaper and close the state file."""
        self.end_streams()
        if self.reaper is not None:
            self.reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reaper
        self.state.close()

    async def _reap_forever(self) -> None:
        period = min(1.0, self.dead_after_s / 4)
        while True:
            await asyncio.sleep(period)
            self.reap()

    def reap(self) -> None:
        """Declare dead every alive node silent for longer than ``dead_after_s``; reassign its stages."""
        now = time.monotonic()
        silent = [
            n for n in self.nodes.values() if n.alive and now - self.last_seen[n.id] > self.dead_after_s
        ]
        for node in silent:
            self._remove(node)

    # -- membership ---------------------------------------------------------------------------

    def _owners(self) -> list[str | None]:
        owners: list[str | None] = [None] * self.config.n_stages
        for node in self.nodes.values():
            for s in node.stages:
                owners[s] = node.id
        return owners

    def _replan(self, before: list[str | None]) -> None:
        """Hand free stages to standbys (join order), persist changed nodes, bump the epoch on change."""
        standbys = [(n.id, n.max_stages) for n in self.nodes.values() if n.alive and not n.stages]
        owners = assign(self._owners(), standbys)
        for node in self.nodes.values():
            stages = stages_of(owners, node.id)
            if stages != node.stages:
                node.stages = stages
                self.state.upsert_node(node)
        if owners != before:
            self.plan_epoch += 1
            self.state.set_plan_epoch(self.plan_epoch)
        self._update_alive()

    def _remove(self, node: NodeRecord) -> None:
        before = self._owners()
        node.alive, node.stages = False, []
        self.state.upsert_node(node)
        self._replan(before)

    def _update_alive(self) -> None:
        self.metrics.nodes_alive.set(sum(n.alive for n in self.nodes.values()))

    def _links(self, node_id: str) -> list[coordinator_pb2.BoundaryLink]:
        addresses = {n.id: n.address for n in self.nodes.values() if n.alive}
        return links_for(node_id, self._owners(), addresses)

    def _alive_node(self, node_id: str) -> NodeRecord | None:
        node = self.nodes.get(node_id)
        return node if node is not None and node.alive else None

    def _require_host(self, node_id: str, stage: int) -> None:
        node = self._alive_node(node_id)
        if node is None:
            raise Rejected("unknown_node", f"unknown node {node_id!r}; join again")
        if stage not in node.stages:
            raise Rejected("not_hosting", f"node {node_id} does not host stage {stage}")

    async def _reject(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, label: str, msg: str
    ) -> NoReturn:
        """Count a rejected message under ``label`` and abort the call."""
        self.metrics.rejected.labels(reason=label).inc()
        await context.abort(code, msg)

    # -- RPCs ---------------------------------------------------------------------------------

    async def Join(self, request, context):
        if request.protocol_version != PROTOCOL_VERSION:
            await self._reject(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "protocol_version",
                f"protocol version {request.protocol_version}, coordinator speaks {PROTOCOL_VERSION}",
            )
        if not hmac.compare_digest(request.token.encode(), self.token):
            await self._reject(context, grpc.StatusCode.UNAUTHENTICATED, "auth", "wrong join token")
        node = NodeRecord(
            id=uuid.uuid4().hex,
            name=request.node_name,
            address=request.announce_address,
            device=request.device,
            max_stages=max(1, request.max_stages),
            stages=[],
            alive=True,
        )
        before = self._owners()
        self.nodes[node.id] = node
        self.last_seen[node.id] = time.monotonic()
        self.state.upsert_node(node)
        self._replan(before)
        return coordinator_pb2.JoinReply(
            node_id=node.id,
            run_id=self.run_id,
            config_json=self.config_json,
            config_hash=self.config_hash,
            stages=node.stages,
            embedding_digest=self.embedding_digest,
            embedding_size=len(self.artifacts[self.embedding_digest]),
            subspace_version=self.rotation.version,
            links=self._links(node.id),
            plan_epoch=self.plan_epoch,
            heartbeat_interval_ms=self.heartbeat_interval_ms,
            auth_token=self.auth_token,
            dht_initial_peers=self.dht_peers,
        )

    async def Heartbeat(self, request, context):
        node = self._alive_node(request.node_id)
        if node is None:
            return coordinator_pb2.HeartbeatReply(known=False, plan_epoch=self.plan_epoch)
        self.last_seen[node.id] = time.monotonic()
        return coordinator_pb2.HeartbeatReply(
            known=True,
            plan_epoch=self.plan_epoch,
            stages=node.stages,
            links=self._links(node.id),
            subspace_version=self.rotation.version,
        )

    async def Leave(self, request, context):
        node = self._alive_node(request.node_id)
        if node is not None:
            self._remove(node)
        return coordinator_pb2.LeaveReply()

    async def GetRunConfig(self, request, context):
        return coordinator_pb2.RunConfigReply(
            run_id=self.run_id, config_json=self.config_json, config_hash=self.config_hash
        )

    async def FetchArtifact(self, request, context) -> AsyncIterator[coordinator_pb2.ArtifactChunk]:
        data = self.artifacts.get(request.digest)
        if data is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no artifact {request.digest!r}")
        if request.offset > len(data):
            await context.abort(
                grpc.StatusCode.OUT_OF_RANGE, f"offset {request.offset} beyond artifact size {len(data)}"
            )
        for offset in range(request.offset, len(data), CHUNK_BYTES):
            yield coordinator_pb2.ArtifactChunk(
                offset=offset,
                data=data[offset : offset + CHUNK_BYTES],
                total_size=len(data),
                digest=request.digest,
            )

    async def WatchRotations(self, request, context) -> AsyncIterator[common_pb2.Rotation]:
        queue: asyncio.Queue[SubspaceRotation | None] = asyncio.Queue()
        self.watchers.add(queue)
        try:
            sent = request.after_version
            for rotation in self.state.rotations(after_version=sent):
                yield rotation_to_proto(rotation)
                sent = rotation.version
            while not self.closing and (rotation := await queue.get()) is not None:
                if rotation.version > sent:
                    yield rotation_to_proto(rotation)
                    sent = rotation.version
        finally:
            self.watchers.discard(queue)

    def _offer(self, stat: SavedStatistic) -> SubspaceRotation | None:
        """Feed a statistic to the collector; persist it, or the rotation it completes, and publish."""
        rotation = self.rotation.offer(stat.step, stat.boundary, stat.version, stat.data)
        if rotation is None:
            self.state.add_statistic(stat)
            return None
        self.state.add_rotation(rotation)
        self.metrics.subspace_version.set(rotation.version)
        for queue in self.watchers:
            queue.put_nowait(rotation)
        return rotation

    async def ReportStatistics(self, request, context):
        stat = SavedStatistic(
            request.step, request.boundary, request.subspace_version, request.gram_times_basis_f64_le
        )
        try:
            self._require_host(request.node_id, request.stage)
            if request.boundary != request.stage - 1:
                raise Rejected("malformed", f"stage {request.stage} reports boundary {request.boundary}")
            self._offer(stat)
        except Rejected as e:
            self.metrics.rejected.labels(reason=e.label).inc()
            return coordinator_pb2.StatisticsAck(accepted=False, reason=str(e))
        return coordinator_pb2.StatisticsAck(accepted=True)

    async def ReportStep(self, request, context):
        try:
            self._require_host(request.node_id, request.stage)
        except Rejected as e:
            await self._reject(context, grpc.StatusCode.FAILED_PRECONDITION, e.label, str(e))
        loss = request.loss if request.HasField("loss") else None
        self.state.record_step(
            request.step,
            request.stage,
            loss,
            request.tokens,
            request.bytes_sent_forward,
            request.bytes_sent_backward,
            request.wall_seconds,
        )
        self.metrics.step.labels(stage=str(request.stage)).set(request.step)
        if loss is not None and request.stage == self.config.n_stages - 1:
            self.metrics.loss.set(loss)
        return coordinator_pb2.StepAck()

    async def Status(self, request, context):
        now = time.monotonic()
        nodes = [
            coordinator_pb2.NodeStatus(
                node_id=n.id,
                node_name=n.name,
                address=n.address,
                stages=n.stages,
                last_heartbeat_age_s=now - self.last_seen[n.id],
                alive=n.alive,
                device=n.device,
            )
            for n in self.nodes.values()
        ]
        completed = self.state.completed_step(self.config.n_stages)
        steps = [
            coordinator_pb2.StepSummary(
                step=step,
                loss=loss,
                tokens=tokens or 0,
                bytes_sent_forward=fwd or 0,
                bytes_sent_backward=bwd or 0,
                wall_seconds=wall or 0.0,
            )
            for step, loss, tokens, fwd, bwd, wall in self.state.step_summaries(
                self.config.n_stages, request.since_step
            )
        ]
        return coordinator_pb2.StatusReply(
            run_id=self.run_id,
            step=max(0, completed),
            subspace_version=self.rotation.version,
            nodes=nodes,
            config_hash=self.config_hash,
            steps_completed=completed + 1,
            steps=steps,
        )


def host_port(host: str, port: int) -> str:
    """``host:port``, bracketing an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class CoordinatorServer:
    """A ``grpc.aio`` server hosting one :class:`CoordinatorService` on ``host:port`` (0: a free port)."""

    def __init__(self, service: CoordinatorService, host: str = "127.0.0.1", port: int = 0):
        self.service = service
        self.host = host
        self.requested_port = port
        self.port = 0
        self.server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return host_port(self.host, self.port)

    async def start(self) -> int:
        """Bind, start serving and start the service's reaper; returns the bound port."""
        self.server = grpc.aio.server(options=GRPC_OPTIONS)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self.service, self.server)
        address = host_port(self.host, self.requested_port)
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"cannot bind {address}: {e}") from None
        await self.server.start()
        self.service.start()
        return self.port

    async def stop(self, grace: float = 2.0) -> None:
        """End the rotation streams, stop the server (in-flight calls get ``grace`` s), close the service.

        Stopping a stopped server does nothing.
        """
        if self.server is None:
            return
        server, self.server = self.server, None
        self.service.end_streams()
        await server.stop(grace)
        await self.service.close()

    async def __aenter__(self) -> CoordinatorServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
