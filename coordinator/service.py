"""The ``swarm.v1.Coordinator`` gRPC service (grpc.aio) and the server that hosts it.

The service wires the coordinator's collaborators and keeps its RPC handlers thin:

* :mod:`~swarm.coordinator.roster`: the nodes, their liveness, identities, capacity;
* :mod:`~swarm.coordinator.ledger`: plan epochs, checkpoint cuts, the microbatches dealt;
* :mod:`~swarm.coordinator.planner`: stage assignment (:meth:`~swarm.coordinator.planner.Planner.replan`
  is the one place that reassigns stages) and the plan each node is told;
* :mod:`~swarm.coordinator.gate`: join tokens, session credentials, the refusal of calls;
* :mod:`~swarm.coordinator.judge`: who to evict on an accusation of invalid frames;
* :mod:`~swarm.coordinator.audits`: sibling replicas' recomputations, and who they evict;
* :mod:`~swarm.coordinator.rotation_hub`: statistics in, rotations out and streamed;
* :mod:`~swarm.coordinator.progress`: step reports and the ``Status`` document;
* :mod:`~swarm.coordinator.artifacts`: the embedding, uploaded stage snapshots, the trained model;
* :mod:`~swarm.coordinator.keepers`: which nodes hold each snapshot, and keep orders.

All handlers run on one event loop and never await while they change the membership,
so the in-memory plan needs no lock; every change is written through to SQLite
(:mod:`swarm.coordinator.state`) and a restarted coordinator resumes from there.
``Status`` and ``GetRunConfig`` are open; every other call after ``Join`` needs the node's
session credential (node ids alone grant nothing). ``Join`` dials the node's announced address
back (:meth:`~swarm.coordinator.roster.Roster.dial_back`): a node it cannot reach is placed as
dial-only, and told so in the reply.

Epochs. Whenever a stage changes owner (a node joins into a free stage, leaves, or is
declared dead) or a node reports a broken boundary, a new plan epoch starts: it resumes
from the latest complete checkpoint cut whose snapshots all verify, and every node
rebuilds its stages from there. Reports that carry an older epoch are refused, and a node
declared dead stays dead (fenced): its calls are refused and its heartbeats answered
``known=False``. Once every stage has reported the last step the run is complete and
membership changes no longer replan it. A node its sibling replicas' audits found computing wrong
is evicted further back: the run resumes from the newest cut before it first hosted a stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from swarm.coordinator.artifacts import Artifacts
from swarm.coordinator.audits import Audits
from swarm.coordinator.bulletin import MAX_HOLD_MS
from swarm.coordinator.commitments import CommitmentChecks
from swarm.coordinator.errors import Rejected
from swarm.coordinator.export import artifact_store, default_model_dir
from swarm.coordinator.gate import Gate, admit_operator_token
from swarm.coordinator.judge import Judge
from swarm.coordinator.keepers import Keepers
from swarm.coordinator.ledger import Ledger
from swarm.coordinator.planner import Planner
from swarm.coordinator.progress import Progress
from swarm.coordinator.relays import Relay, RelayPool
from swarm.coordinator.roster import Roster
from swarm.coordinator.rotation_hub import RotationHub
from swarm.coordinator.screen_reports import ScreenReports
from swarm.coordinator.sessions import Sessions
from swarm.coordinator.settings import CoordinatorSettings
from swarm.coordinator.state import CheckpointRecord, CoordinatorState, NodeRecord, SavedStatistic
from swarm.coordinator.store import UploadError
from swarm.coordinator.tokens import JoinTokens

from swarm._proto.swarm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from swarm.codecs.base import PayloadError
from swarm.core.config import RunConfig, config_hash
from swarm.core.subspace import initial_artifacts
from swarm.io.artifacts import CHUNK_BYTES, matrix_to_bytes
from swarm.io.manifest import Manifest
from swarm.net.channel import server_options
from swarm.net.health import Health
from swarm.net.netaddr import split_host_port
from swarm.net.tls import INSECURE, Security
from swarm.ops.metrics import Metrics

log = logging.getLogger("swarm.coordinator")

MAX_SNAPSHOT_BYTES = CoordinatorSettings.max_snapshot_bytes  # what `swarm-coordinator export` reads back


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    """Membership, stage assignment, artifacts, rotations and progress of one run.

    ``token``: a join token the operator gave (recorded unless known; more are made with
    ``swarm-coordinator token create``); ``state_path`` the SQLite file (created, or resumed if it
    holds this run); ``run_id`` names a new run (None: a fresh id); ``dht_peers`` are the
    multiaddrs handed to joining nodes; ``settings`` its tunables; ``security`` the TLS of its
    server and of the Pings it sends nodes. Call :meth:`start` on the serving loop and
    :meth:`close` after the server stopped (:class:`CoordinatorServer` does both).
    """

    def __init__(
        self,
        config: RunConfig,
        token: str | None,
        state_path: str | Path,
        run_id: str | None,
        metrics: Metrics,
        dht_peers: list[str],
        settings: CoordinatorSettings | None = None,
        security: Security = INSECURE,
    ):
        self.config, self.metrics, self.security = config, metrics, security
        self.settings = settings = settings or CoordinatorSettings()
        self.config_json, self.config_hash = config.to_json(), config_hash(config)
        self.dht_peers = list(dht_peers)
        self.state = CoordinatorState(state_path)
        try:
            run = self.state.open_run(run_id, config)
        except BaseException:
            self.state.close()
            raise
        state_file = Path(state_path)
        fixed, basis = initial_artifacts(config)
        store = artifact_store(state_file, settings.max_snapshot_bytes)
        self.artifacts = Artifacts(
            matrix_to_bytes(fixed), store, default_model_dir(state_file), settings.export_wait_s
        )
        self.roster = Roster(config.n_stages, self.state, metrics, settings)
        key = run.auth_token.encode()
        self.keepers = Keepers(settings.snapshot_keepers, key, self.state, self.roster, metrics)
        self.ledger = Ledger(config, run, self.state, store, self.keepers, metrics)
        self.screen = ScreenReports(self.roster, metrics)
        self.commitments = CommitmentChecks(config.train.microbatches, metrics)
        self.rotation = RotationHub(config, basis, self.state, metrics)
        self.progress = Progress(config, self.state, metrics, self.roster, self.ledger, self.rotation)
        self.relays = RelayPool([Relay(a, a) for a in settings.relays])
        self.planner = Planner(
            config, self.roster, self.ledger, self.progress, self.rotation.end_stream_of, self.relays
        )
        tokens = JoinTokens(self.state.db)
        admit_operator_token(tokens, token, state_file)
        key_path = state_file.with_name(state_file.name + ".session-key")
        sessions = Sessions(key_path, tokens.revoked, settings.session_ttl_s)
        self.gate = Gate(tokens, sessions, self.roster, self.ledger, metrics, security, self.planner.evict)
        self.judge = Judge(self.roster.party_of, self.planner.evict, metrics)
        self.audits = Audits(config, self.ledger, self.roster, self._evict_wrong, metrics)
        self.reaper: asyncio.Task[None] | None = None
        self.relay_prober: asyncio.Task[None] | None = None
        self.roster.show_alive()

    @property
    def run_id(self) -> str:
        return self.ledger.run_id

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start declaring silent nodes dead and pinging the relays (needs a running event loop)."""
        loop = asyncio.get_running_loop()
        self.reaper = loop.create_task(self._reap_forever())
        self.relay_prober = loop.create_task(self.relays.probe_forever(self.planner.relays_changed))

    async def add_relay(self, relay: Relay) -> None:
        """Plan links through ``relay`` too (pinged now, then with the others)."""
        self.relays.add(relay)
        if await self.relays.probe():
            self.planner.relays_changed()

    def end_streams(self) -> None:
        """Finish every WatchRotations stream (before the server's grace period starts)."""
        self.rotation.end_streams()

    async def close(self) -> None:
        """Stop the reaper, let a model export in progress finish, close the state file."""
        self.end_streams()
        await self.artifacts.close()
        for task in (self.reaper, self.relay_prober):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.state.close()

    async def _reap_forever(self) -> None:
        period = min(1.0, self.settings.dead_after_s / 4)
        while True:
            await asyncio.sleep(period)
            self.reap()
            self.order_keepers()

    def order_keepers(self) -> None:
        """Order keepers for snapshots that lack them (new ones, or a keeper died; not those on this
        coordinator's disk); wake the held heartbeats."""
        if self.progress.run_complete:
            return
        kept_here = self.artifacts.store.complete
        records = [r for r in self.ledger.records() if not kept_here(r.digest)]
        if self.keepers.reconcile(records, self.roster.owners()):
            self.ledger.news.post()

    def reap(self) -> None:
        """Declare dead every alive node silent for longer than ``dead_after_s``; reassign its stages."""
        for node in self.roster.silent():
            self.planner.evict(node)

    def status(self, since_step: int = 0) -> coordinator_pb2.StatusReply:
        """The run, its nodes, the completed steps >= ``since_step`` and the plan's problems."""
        reply = self.progress.status(self.config_hash, since_step)
        reply.plan_problems.extend(self.planner.problems)
        reply.relayed_links.extend(self.planner.relayed_links())
        reply.snapshot_holding = self.keepers.holding()
        reply.bad_holders.extend(self.keepers.bad)
        reply.rebuilt_stages.extend(self.ledger.rebuilt_lines())
        reply.commitment_checks = self.commitments.checks
        reply.commitment_mismatches.extend(self.commitments.mismatches)
        reply.audits_matched = self.audits.counts["match"]
        reply.audits_mismatched = self.audits.counts["mismatch"]
        reply.audits_unavailable = self.audits.counts["unavailable"]
        reply.audit_lines.extend(self.audits.lines)
        return reply

    def _evict_wrong(self, node: NodeRecord, reason: str, rollback: bool) -> None:
        """Evict ``node``, found computing (or, ``rollback`` False, reporting) wrong: its own join
        token may not join again, and with ``rollback`` the run resumes from a cut before the first
        step it hosted a stage at."""
        self.gate.ban(node.id, reason)
        self.planner.evict(node, rollback=rollback)

    # -- membership ---------------------------------------------------------------------------

    async def Join(self, request, context):
        admitted = await self.gate.admit(request, context)
        address = request.announce_address
        reachable, reachability = await self.roster.dial_back(request.node_name, address, self.security)
        node = NodeRecord(
            id=uuid.uuid4().hex,
            name=request.node_name,
            address=address,
            device=request.device,
            max_stages=max(1, request.max_stages),
            stages=[],
            alive=True,
            reachable=reachable,
        )
        before = self.roster.owners()
        self.roster.add(node, *self.gate.identity(node.id, admitted, context))
        self.planner.replan(before)
        if request.relay_address and reachable:
            reachability += "; " + await self._offered_relay(node, request.relay_address[:256])
        return coordinator_pb2.JoinReply(
            node_id=node.id,
            run_id=self.run_id,
            config_json=self.config_json,
            config_hash=self.config_hash,
            embedding_digest=self.artifacts.embedding_digest,
            embedding_size=len(self.artifacts.embedding),
            subspace_version=self.rotation.version,
            heartbeat_interval_ms=self.settings.heartbeat_interval_ms,
            session=self.gate.sessions.issue(node.id, admitted.id),
            dht_initial_peers=self.dht_peers,
            plan=self.planner.plan_for(node),
            run_complete=self.progress.run_complete,
            reachable=reachable,
            reachability=reachability,
            snapshot_access=self.keepers.access(node.id),
        )

    async def _offered_relay(self, node: NodeRecord, address: str) -> str:
        """Plan with the relay ``node`` offers while it is in the run, if it may offer one and it
        answers a ping now; what was found, for the node's log.

        Only under mutual TLS (or clear text, where nothing is protected anyway): there the plan pins
        each end's certificate, so a relay holding a node certificate of its own cannot pose as
        either end; under plain TLS any node certificate would do, and a volunteer relay could
        read and alter the link.
        """
        if self.security.tls and not self.security.mutual:
            return f"the relay offered at {address} is not used: volunteer relays need --mutual-tls"
        host = split_host_port(address)[0] if ":" in address else ""
        if not node.address or host != split_host_port(node.address)[0]:
            return f"the relay offered at {address} is not used: it must be on the announced host"
        await self.add_relay(Relay(address, address, owner=node.id))
        if address not in self.relays.alive:
            self.relays.drop(node.id)
            log.warning("node %s offers a relay at %s that does not answer: not used", node.id[:8], address)
            return f"the relay offered at {address} does not answer: not used"
        log.info("node %s relays at %s", node.id[:8], address)
        return f"the relay offered at {address} answers: links may run through it"

    async def Heartbeat(self, request, context):
        node = self.roster.alive_node(request.node_id)
        if node is None:
            self.metrics.rejected.labels(reason="unknown_node").inc()
            return coordinator_pb2.HeartbeatReply(known=False, plan_epoch=self.ledger.plan_epoch)
        session = await self.gate.require_session(request.node_id, context)
        self.planner.heard(node, request)
        await self._hold(request)
        if self.roster.alive_node(request.node_id) is None:  # dropped while the reply was held
            return coordinator_pb2.HeartbeatReply(known=False, plan_epoch=self.ledger.plan_epoch)
        reply = coordinator_pb2.HeartbeatReply(
            known=True,
            plan_epoch=self.ledger.plan_epoch,
            subspace_version=self.rotation.version,
            run_complete=self.progress.run_complete,
            cut_requests=self.ledger.cut_requests,
            session=self.gate.sessions.renewal(session) or "",
            keep_orders=self.keepers.issued,
        )
        if self.config.audits:
            suspects = {*self.screen.suspects(self.progress.timeline), *self.audits.suspects()}
            reply.audit_suspects.extend(sorted(suspects))
        if request.plan_epoch != self.ledger.plan_epoch:
            reply.plan.CopyFrom(self.planner.plan_for(node))
        if request.keep_orders != self.keepers.issued:
            orders = self.keepers.orders_for(node.id, self.ledger.records())
            reply.keep.extend(
                self.keepers.describe(r, self.artifacts.store.complete(r.digest)) for r in orders
            )
        return reply

    async def _hold(self, request: coordinator_pb2.HeartbeatRequest) -> None:
        """Hold a heartbeat's reply (long poll, up to ``request.hold_ms``) until there is news for it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(request.hold_ms, MAX_HOLD_MS) / 1000

        def news() -> bool:
            return (
                request.plan_epoch != self.ledger.plan_epoch
                or request.cut_requests != self.ledger.cut_requests
                or request.run_complete != self.progress.run_complete
                or request.keep_orders != self.keepers.issued
            )

        while not news() and (left := deadline - loop.time()) > 0:
            await self.ledger.news.wait(left)

    async def Leave(self, request, context):
        await self.gate.require_session(request.node_id, context)
        node = self.roster.alive_node(request.node_id)
        self.roster.leaving.discard(request.node_id)
        if node is not None:
            log.info("node %s leaves: %s", node.id[:8], request.reason or "no reason given")
            self.roster.left.add(node.id)
            self.planner.evict(node)
        return coordinator_pb2.LeaveReply()

    async def RequestCut(self, request, context):
        try:
            self.gate.require_member(request.node_id, request.plan_epoch, context)
        except Rejected as e:
            await self.gate.refuse(context, e)
        self.ledger.request_cut()
        self.roster.leaving.add(request.node_id)
        return coordinator_pb2.CutAck()

    async def ReportFailure(self, request, context):
        try:
            self.gate.require_member(request.node_id, request.plan_epoch, context)
        except Rejected as e:
            if e.label != "stale_epoch":  # a failure of an old epoch is already handled
                await self.gate.refuse(context, e)
        else:
            await self._settle_failure(request)
        return coordinator_pb2.FailureAck(plan_epoch=self.ledger.plan_epoch)

    async def _settle_failure(self, request: coordinator_pb2.FailureReport) -> None:
        """A member of the current epoch reports a broken link: evict the peer it accuses of invalid
        frames (as judged), or the peer that does not answer, else start a new epoch."""
        peer = self.roster.alive_node(request.peer_node_id)
        if peer is not None and peer.id in self.roster.leaving:
            # A leaving node closed its streams after its final cut; its Leave starts the next epoch
            # from that cut (a new epoch now would drop the cut's snapshots still on their way).
            return
        if request.bad_input and peer is not None and self.planner.neighbours(request.node_id, peer.id):
            self.judge.accusation(self.roster.nodes[request.node_id], peer, request.reason)
            return
        answered = peer is None or not peer.reachable or await self.roster.answers(peer, self.security)
        if self.relays.relays and await self.relays.probe():  # a relayed link breaks when its relay dies
            self.planner.relays_changed()
        # Re-check after the probe: the epoch may have moved on meanwhile.
        if self.progress.run_complete or request.plan_epoch != self.ledger.plan_epoch:
            return
        if not answered and peer.alive:
            log.info("node %s does not answer after a failure report: declared dead", peer.id[:8])
            self.planner.evict(peer)
            return
        if peer is None or not self.planner.neighbours(request.node_id, peer.id):
            # No neighbour to blame. With replicas that is often an averaging round that lost a
            # member nobody could name: look for a host that died (its siblings then go on).
            cleared = {request.node_id} | ({peer.id} if peer is not None else set())
            if self.config.train.replicas > 1 and await self._evict_silent_hosts(cleared, request.plan_epoch):
                return
            self.planner.new_epoch(f"node {request.node_id[:8]}: {request.reason}", own_states=True)
            return
        # The accused answers: its own failure may come from a host that died elsewhere in the
        # pipeline (a step fails at every stage), whose own report would arrive too late, as a report
        # of an epoch already replaced. Find that host now rather than restart twice, and before
        # blaming the link: two deaths in a row elsewhere fail this pair's link in two epochs too.
        if await self._evict_silent_hosts({request.node_id, peer.id}, request.plan_epoch):
            return
        if self.planner.link_failed(request.node_id, peer.id, request.plan_epoch):
            return  # the pair failed in two consecutive epochs: placed around it (a new epoch)
        self.planner.new_epoch(f"node {request.node_id[:8]}: {request.reason}", own_states=True)

    async def _evict_silent_hosts(self, cleared: set[str], epoch: int) -> bool:
        """Ping every other reachable stage host of ``epoch`` (concurrently) and evict those that are
        dead (:meth:`Roster.answers`); whether one was (its eviction started the next epoch)."""
        hosts = [
            node
            for node in self.roster.nodes.values()
            if node.alive and node.stages and node.reachable and node.id not in cleared
        ]
        answers = await asyncio.gather(*(self.roster.answers(n, self.security) for n in hosts))
        dead = [n for n, ok in zip(hosts, answers, strict=True) if not ok and n.alive]
        if self.progress.run_complete or epoch != self.ledger.plan_epoch:
            return True  # the epoch moved on meanwhile: nothing left to start
        for node in dead:
            log.info("node %s does not answer after a neighbour's failure: declared dead", node.id[:8])
            self.planner.evict(node)
        return bool(dead)

    # -- run configuration and artifacts ------------------------------------------------------

    async def GetRunConfig(self, request, context):
        return coordinator_pb2.RunConfigReply(
            run_id=self.run_id, config_json=self.config_json, config_hash=self.config_hash
        )

    async def FetchArtifact(self, request, context) -> AsyncIterator[coordinator_pb2.ArtifactChunk]:
        await self.gate.require_any_session(context)
        data = self.artifacts.read(request.digest)
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

    async def UploadArtifact(self, request_iterator, context) -> coordinator_pb2.UploadReply:
        store = self.artifacts.store
        key, complete = "", False
        async for chunk in request_iterator:
            try:
                if not key:
                    self.gate.require_member(chunk.node_id, self.ledger.plan_epoch, context)
                    key = chunk.digest
                elif chunk.digest != key:
                    raise UploadError("one upload carries one artifact")
                complete = store.append(key, chunk.offset, chunk.data, chunk.total_size)
            except Rejected as e:
                await self.gate.refuse(context, e)
            except UploadError as e:
                await self.gate.reject(context, grpc.StatusCode.FAILED_PRECONDITION, "bad_upload", str(e))
            except PayloadError as e:
                await self.gate.reject(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_upload", str(e))
        return coordinator_pb2.UploadReply(held=store.held(key) if key else 0, complete=complete)

    async def ArtifactStatus(self, request, context) -> coordinator_pb2.ArtifactStatusReply:
        store = self.artifacts.store
        try:
            self.gate.require_member(request.node_id, self.ledger.plan_epoch, context)
            held, complete = store.held(request.digest), store.complete(request.digest)
        except Rejected as e:
            await self.gate.refuse(context, e)
        except PayloadError as e:
            await self.gate.reject(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed", str(e))
        return coordinator_pb2.ArtifactStatusReply(held=held, complete=complete)

    # -- reports ------------------------------------------------------------------------------

    async def ReportCheckpoint(self, request, context) -> coordinator_pb2.CheckpointAck:
        c = request.checkpoint
        if request.kept or request.bad_holder:
            return await self._holder_report(request, context)
        try:
            self.gate.require_host(request.node_id, c.stage, request.plan_epoch, context)
            node = self.roster.nodes[request.node_id]
            manifest = Manifest.parse(c.stage, c.step, c.digest, c.size, c.chunk_bytes, c.chunk_sha256)
            if not self.artifacts.uploaded(c.digest, c.size) and not self.keepers.can_hold(node):
                raise Rejected("malformed", f"snapshot {c.digest[:12]} of {c.size} bytes is not uploaded")
        except Rejected as e:
            await self.gate.refuse(context, e)
        except PayloadError as e:
            await self.gate.reject(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed", str(e))
        self.keepers.took(c.digest, node)
        record = CheckpointRecord(c.step, c.stage, c.digest, c.size, manifest.chunk_bytes, manifest.packed)
        self._cut_stored(self.ledger.add_checkpoint(record))
        self.order_keepers()
        return coordinator_pb2.CheckpointAck(latest_cut=self.ledger.latest_cut() + 1)

    def _cut_stored(self, new_cut: int | None) -> None:
        """A newly complete cut: the final one writes the trained model, others may let replicas join."""
        if new_cut == self.config.train.steps - 1:
            self.artifacts.export(self.config, self.ledger.records())
        elif new_cut is not None:
            self.planner.cut_completed(new_cut)

    async def _holder_report(self, request, context) -> coordinator_pb2.CheckpointAck:
        """A keeper holds a snapshot now, or a fetcher names a holder that served a bad chunk."""
        try:
            self.gate.authenticated(request.node_id, context)
            if self.roster.alive_node(request.node_id) is None:
                raise Rejected("unknown_node", f"node {request.node_id[:8]} is not in the run")
        except Rejected as e:
            await self.gate.refuse(context, e)
        record = self.ledger.record(request.checkpoint)
        if record is not None and request.bad_holder:
            self.keepers.refuse(
                record.digest, request.bad_holder[:64], request.node_id, "hash or size mismatch"
            )
        elif record is not None:
            self.keepers.hold(record.digest, request.node_id)
            self._cut_stored(self.ledger.cut_news())
        return coordinator_pb2.CheckpointAck(latest_cut=self.ledger.latest_cut() + 1)

    async def ReportStatistics(self, request, context):
        stat = SavedStatistic(
            request.step, request.boundary, request.subspace_version, request.gram_times_basis_f64_le
        )
        try:
            self.gate.require_host(request.node_id, request.stage, request.plan_epoch, context)
            if request.boundary != request.stage - 1:
                raise Rejected("malformed", f"stage {request.stage} reports boundary {request.boundary}")
            if self.rotation.already_rotated(request.step, request.subspace_version):
                return coordinator_pb2.StatisticsAck(accepted=True, reason="rotation already published")
            self.rotation.offer(stat)
        except Rejected as e:
            self.metrics.rejected.labels(reason=e.label).inc()
            return coordinator_pb2.StatisticsAck(accepted=False, reason=str(e))
        return coordinator_pb2.StatisticsAck(accepted=True)

    async def ReportStep(self, request, context):
        try:
            self.gate.require_host(request.node_id, request.stage, request.plan_epoch, context)
        except Rejected as e:
            await self.gate.refuse(context, e)
        self.progress.record(request)
        if request.drifted_frames:
            self.screen.add(request)
        if self.screen.pending:
            self.screen.settle(self.ledger.plan_epoch, self.progress.timeline)
        if request.tallies:
            self.commitments.add(request)
        if self.commitments.pending:
            self.commitments.settle(self.ledger.plan_epoch, self.progress.timeline)
        return coordinator_pb2.StepAck()

    async def ReportAudit(self, request, context) -> coordinator_pb2.AuditAck:
        try:
            self.gate.authenticated(request.node_id, context)
            self.audits.add(request)  # the epoch may have ended: the audits check it was a host then
        except Rejected as e:
            await self.gate.refuse(context, e)
        return coordinator_pb2.AuditAck()

    # -- rotations and status -----------------------------------------------------------------

    async def WatchRotations(self, request, context) -> AsyncIterator[common_pb2.Rotation]:
        node_id = await self.gate.require_any_session(context)
        async with contextlib.aclosing(
            self.rotation.watch(node_id, request.after_version, request.lineage)
        ) as rotations:
            async for rotation in rotations:
                yield rotation

    async def Status(self, request, context):
        return self.status(request.since_step)


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
        # so_reuseport 0: a second coordinator on a taken port must fail, not share it
        self.server = grpc.aio.server(options=[*server_options(), ("grpc.so_reuseport", 0)])
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self.service, self.server)
        coordinator_service = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
        self.health = Health(self.server, [coordinator_service])
        address = host_port(self.host, self.requested_port)
        try:
            self.port = self.service.security.add_port(self.server, address)
        except RuntimeError as e:
            raise OSError(f"cannot bind {address}: {e}") from None
        await self.server.start()
        await self.health.serving()
        self.service.start()
        return self.port

    async def stop(self, grace: float = 2.0) -> None:
        """End the rotation streams, stop the server (in-flight calls get ``grace`` s), close the service.

        Stopping a stopped server does nothing.
        """
        if self.server is None:
            return
        server, self.server = self.server, None
        await self.health.stop()
        self.service.end_streams()
        await server.stop(grace)
        await self.service.close()

    async def __aenter__(self) -> CoordinatorServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
