"""The node daemon: join the run, fetch what it needs once, host stages, train until the run ends.

Life of a node:

1. ``Join`` the coordinator (token checked there) and receive the run configuration,
   the stages to host and the digest of the fixed token embedding.
2. Take the embedding from the on-disk cache, or fetch it in chunks and cache it;
   either way it is verified against its sha256. The version-0 subspace basis and all
   initial weights are regenerated from the run seed: nothing else is downloaded.
3. Serve the ``Stage`` service (if the node has an address neighbours can dial), join
   the DHT and publish its stage endpoints, then open or accept one bidirectional
   stream per boundary shared with another node, following the coordinator's dial
   plan. Consecutive stages on this node talk in memory.
4. Run the steps (:mod:`node.schedule`), reporting each to the coordinator, reporting
   boundary statistics at the end of every rotation interval and applying the rotations
   it broadcasts at their effective step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from node.links import GRPC_OPTIONS, LinkError, LocalLink, RunIdentity, StageLink, dial, rejection_reason
from node.schedule import StageRunner, StepOutcome
from node.stage_service import StageService
from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm._proto.swarm.v1 import coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from swarm.artifacts import ArtifactCache, digest, matrix_from_bytes
from swarm.config import RunConfig, config_hash, pick_device
from swarm.data import BatchSampler
from swarm.discovery import RECORD_TTL_S, StageEndpoint, find_stage, publish_stage, start_dht
from swarm.metrics import Metrics
from swarm.pipeline import initial_basis
from swarm.train import batch_ids, load_dataset
from swarm.transport.frames import PROTOCOL_VERSION, rotation_from_proto
from swarm.transport.shaper import LinkProfile
from swarm.worker import StageWorker

log = logging.getLogger("swarm-node")

PLAN_POLL_S = 0.2  # heartbeat period while waiting for a complete stage plan
UNREACHABLE_GRACE_S = 10 * PLAN_POLL_S  # how long a node stays joined after finding no way to its peer


@dataclass
class NodeSettings:
    """Everything a volunteer chooses about its node (the CLI maps flags onto this)."""

    coordinator: str
    token: str
    listen: str = "127.0.0.1:0"  # Stage service address; "" = dial-only (no inbound port)
    announce: str = ""  # address neighbours dial; default: the bound listen address
    device: str = "auto"
    max_stages: int = 1
    data_dir: Path = field(default_factory=lambda: Path("swarm-node-data"))
    metrics_port: int = -1  # -1: no metrics server; 0: a free port
    link: LinkProfile = field(default_factory=LinkProfile)
    use_dht: bool = True
    public_dht: bool = False
    name: str = ""
    connect_timeout: float = 60.0


@dataclass
class NodeResult:
    node_id: str
    stages: list[int]
    steps: int
    embedding_fetched: bool
    outcomes: list[StepOutcome]


def say(message: str) -> None:
    """One line on stdout for operators (and for ``swarm up``, which relays it)."""
    print(message, flush=True)


class NodeDaemon:
    def __init__(self, settings: NodeSettings):
        self.settings = settings
        self.metrics = Metrics("node")
        self.device = pick_device(settings.device)
        self.runners: dict[int, StageRunner] = {}
        self._link_ready: dict[int, asyncio.Future] = {}
        self._links: list[StageLink | LocalLink] = []
        self._tasks: list[asyncio.Task] = []
        self._rotation_events: dict[int, asyncio.Event] = {}
        self._channels: list[grpc.aio.Channel] = []
        self.dht = None
        self.server: grpc.aio.Server | None = None
        self.completed_step = -1

    # -- main -------------------------------------------------------------------------------

    async def run(self) -> NodeResult:
        s = self.settings
        if s.metrics_port >= 0:
            port = self.metrics.serve(s.metrics_port)
            say(f"node metrics on 127.0.0.1:{port}")
        channel = grpc.aio.insecure_channel(s.coordinator, options=GRPC_OPTIONS)
        self._channels.append(channel)
        self.coordinator = coordinator_pb2_grpc.CoordinatorStub(channel)
        self.address = await self._start_server_socket()
        reply = await self._join(self.address)
        try:
            return await self._run_joined(reply)
        finally:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.coordinator.Leave(cpb.LeaveRequest(node_id=self.node_id, reason="done"), timeout=5)
            await self._shutdown()

    async def _run_joined(self, reply: cpb.JoinReply) -> NodeResult:
        self.node_id = reply.node_id
        self.config = RunConfig.from_dict(json.loads(reply.config_json))
        if config_hash(self.config) != reply.config_hash:
            raise RuntimeError("coordinator sent a run configuration that does not match its hash")
        self.identity = RunIdentity(reply.run_id, reply.config_hash, reply.auth_token, reply.node_id)
        stages, links = await self._wait_for_plan(reply)
        say(f"node {self.node_id[:8]} hosts stages {stages} of run {reply.run_id}")
        fixed, fetched = await self._embedding(reply.embedding_digest, reply.embedding_size)
        self._build_runners(stages, fixed)
        self._tasks.append(asyncio.create_task(self._heartbeats(reply.heartbeat_interval_ms / 1000)))
        if self._rotating:
            self._tasks.append(asyncio.create_task(self._watch_rotations()))
        await self._connect(links, reply)
        outcomes = await self._train()
        return NodeResult(self.node_id, stages, self.config.train.steps, fetched, outcomes)

    # -- joining ----------------------------------------------------------------------------

    async def _start_server_socket(self) -> str:
        """Bind the Stage service early so the announce address is known at Join; "" if dial-only."""
        if not self.settings.listen:
            return ""
        self.server = grpc.aio.server(options=GRPC_OPTIONS)
        host, _, port = self.settings.listen.rpartition(":")
        bound = self.server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise RuntimeError(f"cannot listen on {self.settings.listen}")
        return self.settings.announce or f"{host or socket.gethostname()}:{bound}"

    async def _join(self, address: str) -> cpb.JoinReply:
        s = self.settings
        request = cpb.JoinRequest(
            protocol_version=PROTOCOL_VERSION,
            token=s.token,
            node_name=s.name or socket.gethostname(),
            announce_address=address,
            max_stages=s.max_stages,
            device=str(self.device),
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.connect_timeout
        while True:
            try:
                return await self.coordinator.Join(request, timeout=10)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or loop.time() > deadline:
                    raise RuntimeError(
                        f"join refused by {s.coordinator}: {e.code().name}: {e.details()}"
                    ) from None
                await asyncio.sleep(0.5)

    def _cross_boundaries(self, stages: list[int]) -> set[int]:
        """Boundaries between one of ``stages`` and a stage hosted elsewhere."""
        mine, last = set(stages), self.config.n_stages - 1
        out = {s - 1 for s in stages if s > 0 and s - 1 not in mine}
        return out | {s for s in stages if s < last and s + 1 not in mine}

    async def _wait_for_plan(self, reply: cpb.JoinReply) -> tuple[list[int], dict[int, cpb.BoundaryLink]]:
        """Heartbeat until this node has stages and every cross-node boundary has a peer."""
        stages, links = list(reply.stages), {link.boundary: link for link in reply.links}
        deadline = asyncio.get_running_loop().time() + self.settings.connect_timeout
        while not stages or any(
            b not in links or not links[b].peer_node_id for b in self._cross_boundaries(stages)
        ):
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"no complete stage plan within {self.settings.connect_timeout:.0f}s")
            await asyncio.sleep(PLAN_POLL_S)
            hb = await self.coordinator.Heartbeat(cpb.HeartbeatRequest(node_id=reply.node_id), timeout=10)
            stages, links = list(hb.stages), {link.boundary: link for link in hb.links}
        for link in links.values():
            if link.role == cpb.LINK_ROLE_UNSPECIFIED:
                # The peer learns this plan only from its next poll: leaving at once would let it
                # wait out its whole connect timeout instead of failing with this same message.
                await asyncio.sleep(UNREACHABLE_GRACE_S)
                raise LinkError(
                    f"boundary {link.boundary}: neither this node nor {link.peer_node_id[:8]} accepts "
                    "inbound connections; give one a reachable --listen/--announce address (no relays yet)"
                )
        return stages, links

    async def _embedding(self, key: str, size: int) -> tuple[torch.Tensor, bool]:
        """The fixed token embedding: from the verified cache, else fetched in chunks and cached."""
        cache = ArtifactCache(self.settings.data_dir / "artifacts")
        data = cache.get(key)
        if data is not None:
            say(f"embedding {key[:12]}: cache hit ({len(data)} bytes)")
            return matrix_from_bytes(data), False
        if cache.corrupt_discarded:
            say(f"embedding {key[:12]}: cached copy failed its hash check, fetching again")
        parts, received = [], 0
        async for chunk in self.coordinator.FetchArtifact(
            cpb.ArtifactRequest(digest=key, offset=0), timeout=120
        ):
            if chunk.offset != received:
                raise RuntimeError(f"artifact chunk at offset {chunk.offset}, expected {received}")
            parts.append(chunk.data)
            received += len(chunk.data)
        data = b"".join(parts)
        if len(data) != size or digest(data) != key:
            raise RuntimeError(f"fetched embedding does not match digest {key[:12]} / size {size}")
        cache.put(key, data)
        say(f"embedding {key[:12]}: fetched {len(data)} bytes")
        return matrix_from_bytes(data), True

    # -- stages and links -------------------------------------------------------------------

    @property
    def _rotating(self) -> bool:
        return self.config.rotation.interval > 0 and self.config.model.constrained

    def _build_runners(self, stages: list[int], fixed: torch.Tensor) -> None:
        basis = initial_basis(self.config)
        for s in stages:
            worker = StageWorker(self.config, s, fixed, basis, device=self.device)
            batches = self._batches() if worker.is_first else None
            rotation_ready = self._rotation_ready if self._rotating else None
            self.runners[s] = StageRunner(worker, self.metrics, batches, rotation_ready)
        for s, runner in self.runners.items():
            nxt = self.runners.get(s + 1)
            if nxt is not None:
                runner.downstream = LocalLink(nxt.deliver_from_upstream)
                nxt.upstream = LocalLink(runner.deliver_from_downstream)

    def _batches(self):
        t = self.config.train
        dataset = load_dataset(self.config, self.settings.data_dir / "data-cache")
        sampler = BatchSampler(dataset.train, t.batch_size, t.seq_len, t.seed)
        expected = [0]

        def batch_for_step(step: int) -> torch.Tensor:
            if step != expected[0]:
                raise RuntimeError(f"stage 0 asked for step {step}, sampler is at {expected[0]}")
            expected[0] += 1
            return batch_ids(*sampler.next_batch())

        return batch_for_step

    def _sides(self, boundary: int) -> tuple[int, int, StageRunner]:
        """(local stage, peer stage, local runner) at ``boundary``."""
        if boundary in self.runners:
            return boundary, boundary + 1, self.runners[boundary]
        return boundary + 1, boundary, self.runners[boundary + 1]

    def _install(self, boundary: int, link: StageLink) -> asyncio.Task:
        local, peer, runner = self._sides(boundary)
        if peer > local:
            runner.downstream, deliver = link, runner.deliver_from_downstream
        else:
            runner.upstream, deliver = link, runner.deliver_from_upstream
        self._links.append(link)
        return asyncio.create_task(link.pump(deliver, runner.fail))

    async def _attach(self, boundary: int, link: StageLink) -> None:
        """Called by the Stage service for an accepted stream; reads it until it closes."""
        future = self._link_ready.get(boundary)
        if future is None or future.done():
            self.metrics.rejected.labels(rejection_reason(stage_pb2.ERROR_CODE_WRONG_BOUNDARY)).inc()
            await link.send_error(
                stage_pb2.ERROR_CODE_WRONG_BOUNDARY, f"boundary {boundary} expects no stream"
            )
            return
        task = self._install(boundary, link)
        future.set_result(link)
        await task

    async def _connect(self, links: dict[int, cpb.BoundaryLink], reply: cpb.JoinReply) -> None:
        accepting = {}
        for b, link in links.items():
            local, peer, _ = self._sides(b)
            if link.role == cpb.LINK_ROLE_ACCEPT:
                accepting[b] = (local, peer)
                self._link_ready[b] = asyncio.get_running_loop().create_future()
        if self.server is not None:
            service = StageService(
                self.identity, accepting, self._attach, self.metrics, list(self.runners), self.settings.link
            )
            stage_pb2_grpc.add_StageServicer_to_server(service, self.server)
            await self.server.start()
        await self._publish(reply)
        for b, link in links.items():
            if link.role != cpb.LINK_ROLE_DIAL:
                continue
            local, peer, _ = self._sides(b)
            address = await self._peer_address(reply.run_id, peer, link)
            stage_link, channel = await dial(
                address,
                self.identity,
                b,
                local,
                peer,
                self.metrics,
                self.settings.link,
                timeout=self.settings.connect_timeout,
            )
            self._channels.append(channel)
            self._tasks.append(self._install(b, stage_link))
            say(f"boundary {b}: dialled stage {peer} at {address}")
        for b, future in self._link_ready.items():
            try:
                await asyncio.wait_for(future, timeout=self.settings.connect_timeout)
            except TimeoutError:
                raise LinkError(f"boundary {b}: the neighbour did not dial in within the timeout") from None
            say(f"boundary {b}: accepted stream from stage {self._sides(b)[1]}")

    async def _publish(self, reply: cpb.JoinReply) -> None:
        if not self.settings.use_dht or not reply.dht_initial_peers:
            return
        self.dht = await start_dht(list(reply.dht_initial_peers), public=self.settings.public_dht)
        self._tasks.append(asyncio.create_task(self._refresh_endpoints(reply.run_id)))

    async def _refresh_endpoints(self, run_id: str) -> None:
        """Keep this node's stage records alive in the DHT (they expire after ``RECORD_TTL_S``)."""
        endpoint = StageEndpoint(self.node_id, self.address)
        while True:
            for s in self.runners:
                await publish_stage(self.dht, run_id, s, endpoint)
            await asyncio.sleep(RECORD_TTL_S / 3)

    async def _peer_address(self, run_id: str, peer_stage: int, link: cpb.BoundaryLink) -> str:
        """The peer's Stage address: its DHT record if it is the node the plan names, else the plan's."""
        if self.dht is None:
            return link.peer_address
        try:
            endpoint = await find_stage(self.dht, run_id, peer_stage, link.peer_node_id, 10.0)
            return endpoint.address or link.peer_address
        except TimeoutError:
            log.warning("no DHT record for stage %d; using the coordinator's address", peer_stage)
            return link.peer_address

    # -- coordinator side channels ------------------------------------------------------------

    async def _heartbeats(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            request = cpb.HeartbeatRequest(node_id=self.node_id, step=max(self.completed_step, 0))
            with contextlib.suppress(grpc.aio.AioRpcError):
                hb = await self.coordinator.Heartbeat(request, timeout=5)
                if not hb.known:
                    log.error("the coordinator no longer knows this node")

    async def _watch_rotations(self) -> None:
        request = cpb.WatchRotationsRequest(node_id=self.node_id, after_version=0)
        async for pb in self.coordinator.WatchRotations(request):
            rotation = rotation_from_proto(pb)
            for runner in self.runners.values():
                if rotation.version == runner.worker.version + 1:
                    runner.worker.schedule_rotation(rotation)
            self._rotation_event(rotation.version).set()
            say(f"rotation to subspace version {rotation.version} at step {rotation.effective_step}")

    def _rotation_event(self, version: int) -> asyncio.Event:
        return self._rotation_events.setdefault(version, asyncio.Event())

    async def _rotation_ready(self, step: int) -> None:
        """Before a step at which a rotation is due, wait until it has arrived."""
        interval = self.config.rotation.interval
        if step == 0 or step % interval:
            return
        try:
            await asyncio.wait_for(self._rotation_event(step // interval).wait(), timeout=120)
        except TimeoutError:
            raise RuntimeError(f"rotation for step {step} did not arrive") from None

    async def _report(self, outcome: StepOutcome) -> None:
        s = outcome.stats
        request = cpb.StepReport(
            node_id=self.node_id,
            stage=outcome.stage,
            step=outcome.step,
            tokens=s.tokens,
            bytes_sent_forward=outcome.wire_bytes_forward,
            bytes_sent_backward=outcome.wire_bytes_backward,
            wall_seconds=outcome.seconds,
        )
        if s.loss_count:
            request.loss = s.loss_sum / s.loss_count
        await self.coordinator.ReportStep(request, timeout=10)
        worker = self.runners[outcome.stage].worker
        interval = self.config.rotation.interval
        if self._rotating and worker.statistic is not None and (outcome.step + 1) % interval == 0:
            st = worker.statistic
            ack = await self.coordinator.ReportStatistics(
                cpb.StatisticsReport(
                    node_id=self.node_id,
                    stage=outcome.stage,
                    step=outcome.step,
                    boundary=outcome.stage - 1,
                    subspace_version=worker.version,
                    gram_times_basis_f64_le=st.gram_times_basis.cpu()
                    .double()
                    .numpy()
                    .astype("<f8")
                    .tobytes(),
                    off_energy=st.off_energy,
                    total_energy=st.total_energy,
                    rows=st.count,
                ),
                timeout=10,
            )
            if not ack.accepted:
                raise RuntimeError(f"coordinator rejected the boundary statistics: {ack.reason}")

    async def _train(self) -> list[StepOutcome]:
        outcomes = []
        for step in range(self.config.train.steps):
            results = await asyncio.gather(*(r.run_step(step) for r in self.runners.values()))
            for outcome in results:
                await self._report(outcome)
                if outcome.stats.loss_count:
                    say(f"step {step} loss {outcome.stats.loss_sum / outcome.stats.loss_count:.4f}")
            outcomes.extend(results)
            self.completed_step = step
        return outcomes

    async def _shutdown(self) -> None:
        for link in self._links:
            with contextlib.suppress(Exception):
                await link.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.server is not None:
            await self.server.stop(grace=2)
        for channel in self._channels:
            await channel.close()
        if self.dht is not None:
            await self.dht.shutdown()
