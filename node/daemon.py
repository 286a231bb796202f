"""The node daemon: join the run, then follow the coordinator's plan epochs until the run ends.

Life of a node:

1. ``Join`` (token checked there); heartbeats start at once and report the node's phase
   for as long as it lives, so a node busy fetching, loading or computing is never taken
   for dead.
2. Take the fixed token embedding from the verified disk cache, or fetch it once.
3. For each plan epoch: build the hosted stages (restored from the epoch's checkpoint
   cut when it resumes past step 0), connect the boundary streams, train. A plan change
   cancels the epoch and starts the next; a broken boundary is reported to the
   coordinator, which starts a new epoch from the latest cut; a node with no stages
   (a standby) waits for as long as the run lasts.
4. When every stage has finished the last step, or on SIGTERM after a final snapshot
   cut, ``Leave`` and exit 0. A node the coordinator declared dead (a frozen volunteer)
   is fenced: it exits with a clear message and writes nothing into the run.

The parts: :mod:`swarm.node.coordinator_client` (calls, retries, heartbeats, reports,
rotations), :mod:`swarm.node.link_manager` (boundary streams of an epoch),
:mod:`swarm.node.stage_host` (stages, steps, snapshots).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from dataclasses import dataclass

import grpc
import torch
from swarm.node.auditor import Auditor
from swarm.node.checkpointer import Checkpointer
from swarm.node.coordinator_client import CoordinatorClient, CoordinatorUnreachable, Fenced, JoinRefused
from swarm.node.keeper import Keeper, bad_holder_report
from swarm.node.link_manager import LinkManager, unreachable_boundaries
from swarm.node.links import CLOSE_FLUSH_S, BadFrameError, LinkError, RunIdentity
from swarm.node.own_states import OwnStates
from swarm.node.replica_averaging import ReplicaGroup, Sibling
from swarm.node.settings import NodeSettings
from swarm.node.snapshot_fetch import SnapshotFetcher
from swarm.node.snapshot_server import SnapshotServer
from swarm.node.stage_host import StageHost, microbatch_owners
from swarm.node.stage_service import StageService

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm._proto.swarm.v1 import stage_pb2, stage_pb2_grpc
from swarm.core.config import RunConfig, config_hash
from swarm.core.device import pick_device
from swarm.io.artifacts import ArtifactCache, matrix_from_bytes
from swarm.io.checkpoint import SnapshotStore
from swarm.io.data import TokenDataset, load_dataset
from swarm.io.prepared import PreparedDataset
from swarm.net.channel import server_options
from swarm.net.discovery import (
    RECORD_TTL_S,
    StageEndpoint,
    listen_maddr,
    publish_stage,
    start_dht,
    visible_maddrs,
)
from swarm.net.frames import PROTOCOL_VERSION
from swarm.net.health import Health
from swarm.net.netaddr import is_wildcard, join_host_port, split_host_port, visible_host
from swarm.net.relay import RelayMetrics, RelayServer
from swarm.ops.logs import say, set_context
from swarm.ops.metrics import Metrics, MetricsServer
from swarm.runtime.audit import CommitmentTally
from swarm.runtime.averaging import ReplicaAverager
from swarm.runtime.faults import ACCUSE

log = logging.getLogger("swarm-node")


def _peer_across(plan: cpb.Plan, error: Exception) -> str:
    """The node a :class:`LinkError` names, else the one across the boundary it names when that
    boundary has a single peer ("" when it names none)."""
    if peer := getattr(error, "peer_node_id", ""):
        return peer
    boundary = getattr(error, "boundary", None)
    peers = {link.peer_node_id for link in plan.links if link.boundary == boundary}
    return peers.pop() if len(peers) == 1 else ""


@dataclass
class NodeResult:
    node_id: str
    stages: list[int]
    steps: int
    embedding_fetched: bool
    left_early: bool = False
    final_cut: int | None = None  # the step of the snapshot cut it left after, if any


class NodeDaemon:
    stage_service_name = stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name

    def __init__(self, settings: NodeSettings):
        self.settings = settings
        self.metrics = Metrics("node")
        self.device = pick_device(settings.device)
        self.client = CoordinatorClient(
            settings.coordinator, settings.timeouts, self.metrics, settings.security
        )
        self.coordinator_host = split_host_port(settings.coordinator)[0]
        listen_host = split_host_port(settings.listen)[0] if settings.listen else ""
        # The address this node's DHT and metrics bind by default: its Stage service's, else the
        # interface that reaches the coordinator (loopback for a local coordinator).
        self.own_host = listen_host or visible_host("", self.coordinator_host)
        self.http: MetricsServer | None = None
        self.health: Health | None = None
        self.server: grpc.aio.Server | None = None
        self.service: StageService | None = None
        self.tally = CommitmentTally()  # the commitments of the frames its streams sent and received
        self.relay: RelayServer | None = None
        self.dht = None
        self.leaving = asyncio.Event()
        self._cuts_taken = 0
        self._final_cut: int | None = None  # the cut this node stopped at to leave
        self._dataset_lock = threading.Lock()  # builds run in threads; a cancelled one may still load
        self._loaded_dataset: TokenDataset | PreparedDataset | None = None
        self._tasks: list[asyncio.Task] = []
        self._boundaries_opened: set[int] = set()  # by every epoch so far (reconnect metric)
        self._averagers: dict[int, ReplicaAverager] = {}  # per stage replicated here, on the DHT's P2P

    # -- main -------------------------------------------------------------------------------

    async def run(self) -> NodeResult:
        s = self.settings
        if s.metrics_port >= 0:
            self.http = self.metrics.serve(s.metrics_port, s.metrics_host or self.own_host)
            say(f"node metrics on {join_host_port(self.http.host, self.http.port)} (/metrics, /healthz)")
        try:
            self.address = await self._start_server()
            relay_address = await self._start_relay()
            reply = await self._join(relay_address)
            self.node_id = reply.node_id
            set_context(node=self.node_id[:8])
            self.config = self._config(reply)
            rotating = self.config.rotation.interval > 0 and self.config.model.constrained
            self.client.start(reply.heartbeat_interval_ms / 1000, rotating)
            if reply.run_complete:
                say("the run is already complete; nothing to do")
                return NodeResult(self.node_id, [], 0, False)
            try:
                return await self._run_joined(reply)
            except asyncio.CancelledError:  # stopped at once: still tell the coordinator, briefly
                with contextlib.suppress(Exception):
                    request = cpb.LeaveRequest(node_id=self.node_id, reason="stopped by signal")
                    await asyncio.wait_for(self.client.call("Leave", request, retry=False), 2)
                raise
        finally:
            await self._shutdown()

    def _config(self, reply: cpb.JoinReply) -> RunConfig:
        config = RunConfig.from_dict(json.loads(reply.config_json))
        if config_hash(config) != reply.config_hash:
            raise RuntimeError("coordinator sent a run configuration that does not match its hash")
        return config

    async def _run_joined(self, reply: cpb.JoinReply) -> NodeResult:
        self.identity = RunIdentity(reply.run_id, reply.config_hash, reply.node_id)
        self._cuts_taken = self.client.cut_requests
        self.client.set_phase(cpb.NODE_PHASE_FETCHING)
        fixed, fetched = await self._embedding(reply.embedding_digest, reply.embedding_size)
        store = SnapshotStore(self.settings.data_dir / "snapshots", self.config.checkpoint.keep)
        self.checkpointer = Checkpointer(
            store,
            self.client,
            self.metrics,
            self.settings.snapshot_chunk_bytes,
            self.config.checkpoint.moments,
        )
        self._serve_snapshots(store, reply.snapshot_access)
        # with replicas, an epoch may resume from the states the stages held after their last steps
        self.own_states = OwnStates() if self.config.train.replicas > 1 else None
        await self._publish(reply)
        hosted, finished = await self._follow_plans(fixed)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._flush(), timeout=self.settings.timeouts.leave_s)
            if not finished and self._final_cut is not None:
                await asyncio.wait_for(
                    self._cut_complete(self._final_cut), timeout=self.settings.timeouts.leave_s
                )
        reason = "run complete" if finished else "leaving (SIGTERM)"
        with contextlib.suppress(grpc.aio.AioRpcError, Fenced):
            await self.client.call(
                "Leave", cpb.LeaveRequest(node_id=self.node_id, reason=reason), retry=False
            )
        return NodeResult(
            self.node_id,
            hosted,
            self.config.train.steps,
            fetched,
            not finished,
            None if finished else self._final_cut,
        )

    def _serve_snapshots(self, store: SnapshotStore, access: str) -> None:
        """Serve the snapshots in ``store`` to peers naming ``access``; fetch from peers; keep what the
        coordinator orders this node to keep."""
        s = self.settings
        if self.service is not None:
            self.service.snapshots = SnapshotServer(
                store, self.metrics, s.snapshot_mbps, s.snapshot_share, self.service.uplink
            )
            self.service.snapshots.access = access

        def report_bad(ref: cpb.StageCheckpoint, holder: str) -> None:
            self.client.report("ReportCheckpoint", bad_holder_report(self.node_id, ref, holder))

        self.fetcher = SnapshotFetcher(
            store.root,
            lambda: self.node_id,
            self.metrics,
            report_bad,
            self.client.fetch,
            s.security,
            s.timeouts.keepalive,
        )
        self.keeper = Keeper(self.fetcher, store, self.client)
        self.client.on_keep = self.keeper.take
        self.keeper.take(self.client.keep)

    async def _cut_complete(self, step: int) -> None:
        """Until every stage's snapshot of ``step`` is stored: then leaving loses nothing."""
        while (await self.client.call("Status", cpb.StatusRequest(since_step=1 << 62))).latest_cut <= step:
            await asyncio.sleep(0.2)
        say(f"snapshot cut after step {step} is complete")

    async def _flush(self) -> None:
        await self.checkpointer.flush()
        await self.client.flush_reports()

    async def close(self) -> None:
        """Stop serving gRPC health and ``/metrics``, kept up after :meth:`run` returns (a lingering
        node still answers probes and scrapes; its Stage service reports NOT_SERVING)."""
        if self.server is not None:
            await self.health.stop()
            await self.server.stop(grace=2)
            self.server = None
        if self.http is not None:
            self.http.close()
            self.http = None

    def request_leave(self) -> None:
        """SIGTERM: finish the current step, snapshot at a cut every stage takes, then Leave."""
        if self.leaving.is_set():
            return
        self.leaving.set()
        plan = self.client.plan
        if plan is not None and plan.stages and not self.client.run_complete:
            say("leaving: asking for a snapshot cut first")
            self._tasks.append(asyncio.create_task(self._request_cut()))
        self.client.notify()

    async def _request_cut(self) -> None:
        """Ask for a cut under the current epoch; again if the epoch moved before it was taken."""
        while self.client.fatal is None:
            request = cpb.CutRequest(node_id=self.node_id, plan_epoch=self.client.plan.epoch)
            try:
                await self.client.call("RequestCut", request)
                return
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.ABORTED:
                    log.warning("cut request refused: %s", e.details())
                    return
            await asyncio.sleep(0.5)

    # -- epochs -----------------------------------------------------------------------------

    async def _follow_plans(self, fixed: torch.Tensor) -> tuple[list[int], bool]:
        """Run every plan epoch this node has a part in; (stages hosted last, whether the run finished)."""
        hosted: list[int] = []
        finished_epoch = -1
        while True:
            plan = self.client.plan
            if self.client.run_complete and (finished_epoch == plan.epoch or not plan.stages):
                return hosted, True
            if self.leaving.is_set():
                return hosted, False
            if finished_epoch == plan.epoch or not self._plan_complete(plan):
                self.client.set_phase(cpb.NODE_PHASE_WAITING)
                await self.client.wait_change()
                continue
            if unreachable := unreachable_boundaries(plan):
                # The peer learns this plan only from its next heartbeat: leaving at once would let
                # it wait out its whole connect timeout instead of failing with this same message.
                await asyncio.sleep(self.settings.timeouts.unreachable_grace_s)
                link = unreachable[0]
                raise LinkError(
                    f"boundary {link.boundary}: neither this node nor {link.peer_node_id[:8]} accepts "
                    "inbound connections and the coordinator has no relay for them; give one a reachable "
                    "--listen/--announce address, or the coordinator --relay-port"
                )
            hosted = list(plan.stages)
            set_context(stages=",".join(map(str, hosted)))
            say(
                f"node {self.node_id[:8]} hosts stages {hosted} of run {self.identity.run_id} "
                f"(epoch {plan.epoch}, from step {plan.resume_step}) on {self.device}"
            )
            self.metrics.plan_epoch.set(plan.epoch)
            outcome = await self._run_epoch(plan, fixed)
            if outcome == "finished":
                finished_epoch = plan.epoch
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._flush(), self.settings.timeouts.leave_s)
                with contextlib.suppress(grpc.aio.AioRpcError):  # the heartbeat loop retries anyway
                    await self.client.heartbeat()
            elif outcome == "left":
                return hosted, False
            elif outcome == "failed":
                await self._epoch_after(plan.epoch)

    def _plan_complete(self, plan: cpb.Plan) -> bool:
        """Stages to host, and a peer on every boundary shared with another node."""
        return bool(plan.stages) and all(link.peer_node_id for link in plan.links)

    async def _epoch_after(self, epoch: int) -> None:
        """Until the plan moves past ``epoch`` (or this node is leaving)."""
        self.client.set_phase(cpb.NODE_PHASE_WAITING)
        while self.client.plan.epoch == epoch and not self.leaving.is_set():
            await self.client.wait_change()

    async def _run_epoch(self, plan: cpb.Plan, fixed: torch.Tensor) -> str:
        """One epoch: ``finished`` (all steps), ``left`` (stopped at a cut), ``replanned`` or ``failed``."""
        self.metrics.epoch_restarts.inc()
        epoch_task = asyncio.create_task(self._train_epoch(plan, fixed))
        try:
            while not epoch_task.done():
                change = asyncio.create_task(self.client.wait_change())
                await asyncio.wait({epoch_task, change}, return_when=asyncio.FIRST_COMPLETED)
                if change.done():
                    change.exception()  # retrieved here; a fatal one is raised just below
                change.cancel()
                if self.client.fatal is not None:
                    raise self.client.fatal
                if self.client.plan.epoch != plan.epoch:
                    say(f"plan epoch {self.client.plan.epoch} replaces epoch {plan.epoch}")
                    return "replanned"
            try:
                return "finished" if epoch_task.result() else "left"
            except (Fenced, CoordinatorUnreachable, asyncio.CancelledError):
                raise
            except Exception as e:
                say(f"epoch {plan.epoch} failed: {e}")
                # The coordinator may know already (a neighbour left or was declared dead).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        self._epoch_after(plan.epoch), self.settings.timeouts.failure_grace_s
                    )
                if self.client.plan.epoch == plan.epoch:
                    request = cpb.FailureReport(
                        peer_node_id=_peer_across(plan, e),
                        node_id=self.node_id,
                        plan_epoch=plan.epoch,
                        reason=str(e)[:500],
                        bad_input=isinstance(e, BadFrameError),
                    )
                    await self.client.call("ReportFailure", request)
                return "failed"
        finally:
            if not epoch_task.done():
                epoch_task.cancel()
            await asyncio.gather(epoch_task, return_exceptions=True)

    async def _averaging(self, plan: cpb.Plan):
        """The factory of this epoch's replica groups, after starting an averager for every hosted
        stage the plan replicates (once per stage: its handlers stay on the P2P)."""
        replicated = [e for e in plan.replicas if e.stage in plan.stages and len(e.replicas) > 1]
        if replicated and self.dht is None:
            raise LinkError("the plan makes this node a stage replica, but it has no P2P to average over")
        timeout = min(60.0, self.settings.timeouts.step_s)
        for entry in replicated:
            if entry.stage not in self._averagers:
                averager = ReplicaAverager(
                    self.dht.protocol.p2p,
                    f"swarm-stage-{entry.stage}",
                    sender_timeout=timeout / 2,  # hivemind: shorter than the reducers' timeout
                    reducer_timeout=timeout,
                    join_wait=self.settings.timeouts.step_s,
                )
                await averager.start()
                self._averagers[entry.stage] = averager

        def group(entry: cpb.StageReplicas, statistic_due) -> ReplicaGroup:
            siblings = [Sibling(r.node_id, r.averaging_address, len(r.microbatches)) for r in entry.replicas]
            key = f"{self.identity.run_id}/{plan.epoch}/{entry.stage}"
            averager = self._averagers[entry.stage]
            return ReplicaGroup(averager, key, siblings, self.node_id, statistic_due, self.metrics)

        return group

    async def _train_epoch(self, plan: cpb.Plan, fixed: torch.Tensor) -> bool:
        averaging_for = await self._averaging(plan)
        auditor = self._auditor(plan)
        host = StageHost(
            self.config,
            plan,
            fixed,
            self.device,
            self.client,
            self.checkpointer,
            self.fetcher,
            self.metrics,
            self._dataset,
            self.settings.timeouts,
            averaging_for,
            self.own_states,
            self.settings.fault,
            self.tally,
            auditor,
        )
        await host.build()
        links = LinkManager(
            self.identity,
            plan,
            host.runners,
            self.settings,
            self.metrics,
            self.service,
            self.dht,
            self._boundaries_opened,
        )
        finished = None
        try:
            self.client.set_phase(cpb.NODE_PHASE_READY)
            await links.connect(self.identity.run_id)
            await host.connect_replicas()
            self.client.set_phase(cpb.NODE_PHASE_TRAINING)
            finished = await host.train(self._take_cut_request, self.leaving)
            self._final_cut = host.last_cut
            return finished
        finally:
            # After its last step (of the run, or the cut it leaves at) a node's queued frames are
            # what its neighbours need to finish that step: they get as long as a neighbour waits
            # for a frame (on a slow link that is far beyond a teardown's flush).
            await links.close(self.settings.timeouts.step_s if finished is not None else CLOSE_FLUSH_S)
            if auditor is not None:
                await auditor.close()

    def _auditor(self, plan: cpb.Plan) -> Auditor | None:
        """This epoch's audits of sibling replicas (None when the run has none); the frames this node
        keeps for auditors start afresh, under the epoch's evidence secret."""
        self.tally.new_epoch()
        self.tally.window = self.config.audit.window if self.config.audits else 0
        if self.service is not None:
            self.service.evidence_secret = plan.evidence_secret
        if not self.config.audits or not plan.evidence_secret:
            return None
        return Auditor(
            self.config,
            plan,
            self.node_id,
            microbatch_owners(plan),
            {r.node_id: r.address for e in plan.replicas for r in e.replicas if r.address},
            self.tally,
            lambda report: self.client.report("ReportAudit", report),
            self.metrics,
            self.settings.security,
            self.settings.timeouts.keepalive,
            lambda: self.client.audit_suspects,
            accuse=self.settings.fault is not None and self.settings.fault.mode == ACCUSE,
        )

    def _take_cut_request(self) -> bool:
        """Stage 0: whether a new cut request arrived since the last step it marked (``!=``: a
        restarted coordinator counts from 0 again; a spurious cut then costs one snapshot)."""
        if self.client.cut_requests != self._cuts_taken:
            self._cuts_taken = self.client.cut_requests
            return True
        return False

    def _dataset(self) -> TokenDataset | PreparedDataset:
        """The run's dataset, loaded on first use (stage 0 only), once even if epochs overlap."""
        with self._dataset_lock:
            if self._loaded_dataset is None:
                self._loaded_dataset = load_dataset(self.config, self.settings.data_dir / "data-cache")
            return self._loaded_dataset

    # -- joining ----------------------------------------------------------------------------

    async def _start_server(self) -> str:
        """Serve the Stage service from the start (so its address is known at Join); "" if dial-only.

        A dial-only node serves it on loopback only, for the streams a relay brings it (none when
        under TLS it has no certificate to serve with: it can then only be a relayed link's DIAL end).
        """
        security = self.settings.security
        if not self.settings.listen and security.tls and security.cert is None:
            return ""
        self.server = grpc.aio.server(options=server_options(self.settings.timeouts.keepalive))
        self.service = StageService(self.metrics, self.settings.link, self.tally)
        stage_pb2_grpc.add_StageServicer_to_server(self.service, self.server)
        self.health = Health(self.server, [self.stage_service_name])
        host, port = split_host_port(self.settings.listen) if self.settings.listen else ("127.0.0.1", 0)
        bound = security.add_port(self.server, join_host_port(host, port))
        if bound == 0:
            raise RuntimeError(f"cannot listen on {join_host_port(host, port)}")
        await self.server.start()
        await self.health.serving()
        local_host = "127.0.0.1" if is_wildcard(host) else host
        self.service.local_address = join_host_port(local_host, bound)
        if not self.settings.listen:
            return ""
        if self.settings.announce:
            return self.settings.announce
        return join_host_port(visible_host(host, self.coordinator_host), bound)

    async def _start_relay(self) -> str:
        """Run a relay for other nodes' links if the volunteer offers one (``--relay-port``); the
        address to offer at Join ("" for none): the announced host, at the relay's port."""
        if self.settings.relay_port is None:
            return ""
        host = split_host_port(self.settings.listen)[0]
        self.relay = RelayServer(metrics=RelayMetrics(self.metrics.registry))
        port = await self.relay.start(host, self.settings.relay_port)
        address = join_host_port(split_host_port(self.address)[0], port)
        say(f"relaying for other nodes at {address}")
        return address

    async def _join(self, relay_address: str = "") -> cpb.JoinReply:
        s = self.settings
        request = cpb.JoinRequest(
            protocol_version=PROTOCOL_VERSION,
            token=s.token,
            node_name=s.name or socket.gethostname(),
            announce_address=self.address,
            max_stages=s.max_stages,
            device=str(self.device),
            relay_address=relay_address,
        )
        try:
            reply = await self.client.join(request)
        except grpc.aio.AioRpcError as e:
            final = e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION)
            error = JoinRefused if final else RuntimeError
            raise error(f"join refused by {s.coordinator}: {e.code().name}: {e.details()}") from None
        if self.service is not None:
            self.service.node_id = reply.node_id
        return reply

    async def _embedding(self, key: str, size: int) -> tuple[torch.Tensor, bool]:
        """The fixed token embedding: from the verified cache, else fetched in chunks and cached."""
        cache_ = ArtifactCache(self.settings.data_dir / "artifacts")
        data = await asyncio.to_thread(cache_.get, key)
        fetched = data is None
        if data is not None:
            say(f"embedding {key[:12]}: cache hit ({len(data)} bytes)")
        else:
            if cache_.corrupt_discarded:
                say(f"embedding {key[:12]}: cached copy failed its hash check, fetching again")
            data = await self.client.fetch(key, size)
            await asyncio.to_thread(cache_.put, key, data)
            say(f"embedding {key[:12]}: fetched {len(data)} bytes")
        return await asyncio.to_thread(matrix_from_bytes, data), fetched

    async def _publish(self, reply: cpb.JoinReply) -> None:
        s = self.settings
        if not s.use_dht or not reply.dht_initial_peers:
            return
        try:
            self.dht = await start_dht(
                list(reply.dht_initial_peers),
                [s.dht_listen or listen_maddr(self.own_host)],
                public=s.public_dht,
                bootstrap_timeout=s.timeouts.dht_bootstrap_s,
            )
        except Exception as e:  # discovery is an optimisation: the plan's addresses are enough
            log.warning("DHT unavailable, discovery falls back to the coordinator's addresses: %s", e)
            return
        maddrs = await visible_maddrs(self.dht)
        say(f"DHT joined at {', '.join(maddrs)}")
        self.client.averaging_address = maddrs[0]  # where replicas of a stage reach this node's P2P
        self._tasks.append(asyncio.create_task(self._refresh_endpoints(reply.run_id)))

    async def _refresh_endpoints(self, run_id: str) -> None:
        """Keep this node's stage records alive in the DHT (they expire after ``RECORD_TTL_S``)."""
        endpoint = StageEndpoint(self.node_id, self.address)
        while True:
            plan = self.client.plan
            for s in plan.stages if plan is not None else []:
                with contextlib.suppress(Exception):
                    await publish_stage(self.dht, run_id, s, endpoint)
            await asyncio.sleep(min(RECORD_TTL_S / 3, 5.0))

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if hasattr(self, "checkpointer"):
            await self.checkpointer.close()
            await self.keeper.close()
            await self.fetcher.close()
        await self.client.close()
        if self.server is not None:  # no more streams; the server itself stays up until close()
            await self.health.set(self.stage_service_name, False)
        if self.relay is not None:  # the coordinator stopped planning with it when this node left
            await self.relay.close()
        if self.dht is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.dht.shutdown(), timeout=3)
