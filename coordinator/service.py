"""The ``swarm.v1.Coordinator`` gRPC service (grpc.aio) and the server that hosts it.

All handlers run on one event loop and never await while they change the membership,
so the in-memory plan needs no lock; every change is written through to SQLite
(:mod:`swarm.coordinator.state`) and a restarted coordinator resumes from there.

Calls after ``Join`` carry the node's session credential (:mod:`swarm.coordinator.sessions`): a call
naming a node id without its credential is refused, and only credentialed nodes may follow
rotations or fetch artifacts (snapshots are model weights). ``Status`` and ``GetRunConfig``
are open; node ids alone grant nothing.

Epochs. Whenever a stage changes owner (a node joins into a free stage, leaves, or is
declared dead) or a node reports a broken boundary, a new plan epoch starts: it resumes
from the latest complete checkpoint cut whose snapshots all verify, and every node
rebuilds its stages from there. Snapshot records past that cut are dropped (those steps
will be redone), so every cut the coordinator holds comes from one history. Reports that
carry an older epoch are refused, and a node declared dead stays dead (fenced): its calls
are refused and its heartbeats answered ``known=False``. Once every stage has reported
the last step the run is complete and membership changes no longer replan it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NoReturn

import grpc
from swarm.coordinator.assignment import add_replicas, assign, links_for, stages_of
from swarm.coordinator.export import artifact_store, default_model_dir, trained_model
from swarm.coordinator.rotation import Rejected, RotationCollector
from swarm.coordinator.sessions import SESSION_TTL_S, Session, SessionRefused, Sessions, kept_secret
from swarm.coordinator.state import CheckpointRecord, CoordinatorState, NodeRecord, SavedStatistic
from swarm.coordinator.store import UploadError
from swarm.coordinator.tokens import JoinTokens

from swarm._proto.swarm.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from swarm.codecs.base import PayloadError
from swarm.core.config import RunConfig, config_hash
from swarm.core.subspace import SubspaceRotation, initial_artifacts
from swarm.io import model_io
from swarm.io.artifacts import CHUNK_BYTES, digest, matrix_to_bytes
from swarm.net.channel import open_channel, server_options
from swarm.net.frames import PROTOCOL_VERSION, rotation_to_proto
from swarm.net.health import Health
from swarm.net.tls import INSECURE, NODE_SERVER_NAME, Security
from swarm.ops.metrics import Metrics
from swarm.ops.status import RATE_WINDOW, run_rates
from swarm.runtime.replicas import deal, unmeasured_rate

log = logging.getLogger("swarm.coordinator")

MAX_SNAPSHOT_BYTES = 16 << 30
EXPORT_WAIT_S = 120.0  # a stopping coordinator waits this long for the final model to be written
RESUME_GRACE_S = 10.0
SHARED_TOKEN_LABEL = "operator"  # the label of the token given to `serve` (shared by many nodes)
# The same accuser and accused this often: both evicted (one of them lies or keeps offending).
SAME_PAIR_ACCUSATIONS = 3
PROBE_TIMEOUT_S = 2.0  # a node that does not answer a Ping this fast after a failure report is dead
# Rejection label -> gRPC status: a fenced node must stop, a stale epoch only drops the call.
_REJECTION_STATUS = {
    "auth": grpc.StatusCode.UNAUTHENTICATED,
    "unknown_node": grpc.StatusCode.PERMISSION_DENIED,
    "stale_epoch": grpc.StatusCode.ABORTED,
    "not_hosting": grpc.StatusCode.ABORTED,
}


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    """Membership, stage assignment, artifacts, rotations and progress of one run.

    ``token``: a join token the operator gave (recorded unless known; more are made with
    ``swarm-coordinator token create``); ``state_path`` the SQLite file (created, or resumed if it
    holds this run); ``run_id`` names a new run (None: a fresh id); ``dht_peers`` are the
    multiaddrs handed to joining nodes; ``security`` the TLS of its server and of the Pings it
    sends nodes. Call :meth:`start` on the serving loop and
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
        dead_after_s: float = 15.0,
        heartbeat_interval_ms: int = 1000,
        security: Security = INSECURE,
        session_ttl_s: float = SESSION_TTL_S,
    ):
        self.config = config
        self.security = security
        self.config_json = config.to_json()
        self.config_hash = config_hash(config)
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
        self.run_id, self.plan_epoch = run.id, run.plan_epoch
        self.link_key = run.auth_token.encode()  # the run's secret: boundary link secrets derive from it
        self.resume_step, self.restarts = run.resume_step, run.restarts
        state_file = Path(state_path)
        self.tokens = JoinTokens(self.state.db)
        self._admit_with(token, state_file)
        key_path = state_file.with_name(state_file.name + ".session-key")
        self.sessions = Sessions(key_path, self.tokens.revoked, session_ttl_s)
        self.store = artifact_store(state_file, MAX_SNAPSHOT_BYTES)
        self.checkpoints = {(r.step, r.stage): r for r in self.state.checkpoints()}
        self.completed = self.state.completed_step(config.n_stages)
        self.cut_requests = 0
        self._cut_shown = -1  # the complete cut the checkpoint metrics describe
        self.model_dir: Path | None = default_model_dir(state_path)  # where the final model goes
        self._export_task: asyncio.Task | None = None
        self.leaving: set[str] = set()  # nodes that asked for a final cut and will Leave after it
        # accuser -> the parties its bad-input reports got evicted, and how often (by join token id)
        self.accusations: dict[str, collections.Counter[str]] = {}
        # node id -> the party it is in accusations: its join token when that token is its own
        # (`token create`), else itself (nodes sharing the operator's token cannot be linked)
        self.party: dict[str, str] = {}
        self.certificate_of: dict[str, str] = {}  # node id -> its client certificate's name (mutual TLS)
        for node_id, (party, certificate) in self.state.identities().items():
            self.party[node_id] = party
            if certificate:
                self.certificate_of[node_id] = certificate
        fixed, basis = initial_artifacts(config)
        embedding = matrix_to_bytes(fixed)
        self.embedding_digest = digest(embedding)
        self.artifacts = {self.embedding_digest: embedding}
        # each WatchRotations stream's queue, and the node it serves (its stream ends with the node)
        self.watchers: dict[asyncio.Queue[SubspaceRotation | None], str] = {}
        self.closing = False
        self.rotation = RotationCollector(config, basis, self.state.last_rotation())
        for stat in self.state.statistics():
            with contextlib.suppress(Rejected):
                self._offer(stat)
        # Resumed nodes that were alive get at least RESUME_GRACE_S to heartbeat again
        # (their channels are reconnecting).
        self.nodes = {node.id: node for node in self.state.nodes()}
        now = time.monotonic() + max(0.0, RESUME_GRACE_S - dead_after_s)
        self.last_seen = dict.fromkeys(self.nodes, now)
        self.heartbeats: dict[str, coordinator_pb2.HeartbeatRequest] = {}  # the last one of each node
        self.left: set[str] = set()  # nodes that said Leave (since this process started)
        self.last_stages: dict[str, list[int]] = {}  # what each node hosted last
        self.averaging: dict[str, str] = {}  # node id -> its P2P multiaddr for replica averaging
        self.capacity: dict[str, float] = {}  # node id -> tokens/s of busy time, as it last reported
        self.dealt = self._deal()  # per stage: microbatch -> the replica processing it, this epoch
        self.reaper: asyncio.Task[None] | None = None
        metrics.subspace_version.set(self.rotation.version)
        self._update_alive()

    def _admit_with(self, token: str | None, state_file: Path) -> None:
        """Record the operator's ``token``; with none and no valid token in the state, one kept in
        ``STATE.token`` (mode 0600, created once)."""
        if token is None and any(t.revoked is None for t in self.tokens.list()):
            return
        if token is None:
            path = state_file.with_name(state_file.name + ".token")
            token = kept_secret(path, lambda: secrets.token_urlsafe(32))
            log.warning("no join token given: nodes join with the one in %s (mode 0600)", path)
        if self.tokens.add(token, SHARED_TOKEN_LABEL).revoked is not None:
            log.warning(
                "the join token given is revoked: no node can join until `swarm-coordinator token create`"
            )

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
        """Stop the reaper, let a model export in progress finish, close the state file."""
        self.end_streams()
        if self._export_task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._export_task), EXPORT_WAIT_S)
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

    @property
    def run_complete(self) -> bool:
        return self.completed >= self.config.train.steps - 1

    def reap(self) -> None:
        """Declare dead every alive node silent for longer than ``dead_after_s``; reassign its stages."""
        now = time.monotonic()
        silent = [
            n for n in self.nodes.values() if n.alive and now - self.last_seen[n.id] > self.dead_after_s
        ]
        for node in silent:
            self._remove(node)

    # -- membership ---------------------------------------------------------------------------

    def _owners(self) -> list[tuple[str, ...]]:
        """Each stage's hosts (its replicas) in join order; the first is the stage's lead."""
        owners: list[tuple[str, ...]] = [()] * self.config.n_stages
        for node in self.nodes.values():
            for s in node.stages:
                owners[s] = (*owners[s], node.id)
        return owners

    def _replan(self, before: list[tuple[str, ...]]) -> None:
        """Hand free stages to standbys (join order), then (when the run allows replicas) make the
        remaining standbys replicas of the weakest stages; persist changed nodes, start an epoch
        on change."""
        if self.run_complete:
            self._update_alive()
            return
        standbys = [(n.id, n.max_stages) for n in self.nodes.values() if n.alive and not n.stages]
        owners = assign(self._owners(), standbys)
        if self.config.train.replicas > 1:
            owners = self._add_replicas(owners)
        for node in self.nodes.values():
            stages = stages_of(owners, node.id)
            if stages != node.stages:
                node.stages = stages
                self.state.upsert_node(node)
        if owners != before:
            self._start_epoch("stage owners changed")
        self._update_alive()

    def _add_replicas(self, owners: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
        """Standbys that can average (a P2P address) join the stages of least measured capacity,
        once every host has measured its own (placing blindly could feed a stage that is not the
        bottleneck); a stage whose hosts cannot all average takes none."""
        hosting = {n for hosts in owners for n in hosts}
        if any(self.capacity.get(n, 0.0) <= 0 for n in hosting):
            return owners
        waiting = [
            n.id for n in self.nodes.values() if n.alive and n.id not in hosting and self.averaging.get(n.id)
        ]
        closed = [s for s, hosts in enumerate(owners) if not all(self.averaging.get(n) for n in hosts)]
        capacity = {n: self.capacity.get(n, 0.0) for hosts in owners for n in hosts}
        return add_replicas(owners, waiting, capacity, self.config.train.replicas, closed)

    def _deal(self) -> list[dict[int, str]]:
        """Each stage's microbatches dealt among its replicas by capacity: microbatch -> node."""
        # a newcomer counts at the mean of the live nodes measured
        unknown = unmeasured_rate(c for n, c in self.capacity.items() if self._alive_node(n) is not None)
        dealt = []
        for hosts in self._owners():
            rates = [self.capacity.get(n) or unknown for n in hosts]
            shares = deal(self.config.train.microbatches, rates) if hosts else []
            dealt.append({mb: node for node, mbs in zip(hosts, shares, strict=True) for mb in mbs})
        return dealt

    def _start_epoch(self, reason: str) -> None:
        """A new plan epoch, resuming from the latest verified cut; later snapshot records are dropped."""
        self.dealt = self._deal()
        cut = self._latest_verified_cut()
        past = [r for r in self.checkpoints.values() if r.step > cut]
        self._forget(past)
        restarted = self.completed >= 0 or self.resume_step > 0
        self.plan_epoch, self.resume_step = self.plan_epoch + 1, cut + 1
        self.restarts += int(restarted)
        self.state.set_epoch(self.plan_epoch, self.resume_step, self.restarts)
        self.metrics.plan_epoch.set(self.plan_epoch)
        log.info("plan epoch %d (%s): resume at step %d", self.plan_epoch, reason, self.resume_step)

    def _complete_cuts(self) -> list[int]:
        """Steps every stage has a snapshot record of, newest first."""
        counts: dict[int, int] = {}
        for step, _ in self.checkpoints:
            counts[step] = counts.get(step, 0) + 1
        return sorted((s for s, n in counts.items() if n == self.config.n_stages), reverse=True)

    def _latest_verified_cut(self) -> int:
        """The newest complete cut whose snapshots all pass their hash check (-1: none).

        A snapshot that fails is deleted with its record, so its cut is never offered again.
        """
        for step in self._complete_cuts():
            records = [self.checkpoints[(step, s)] for s in range(self.config.n_stages)]
            bad = [r for r in records if self.store.read(r.digest) is None]
            if not bad:
                return step
            for r in bad:
                self.metrics.rejected.labels(reason="corrupt_snapshot").inc()
                log.warning("snapshot of stage %d at step %d failed its hash check", r.stage, r.step)
            self._forget(bad)
        return -1

    def _forget(self, records: list[CheckpointRecord]) -> None:
        """Drop snapshot records, and their artifacts when no other record names them."""
        for r in records:
            self.checkpoints.pop((r.step, r.stage), None)
        self.state.remove_checkpoints(records)
        kept = {r.digest for r in self.checkpoints.values()}
        for key in {r.digest for r in records} - kept:
            self.store.remove(key)

    def _prune_cuts(self) -> None:
        """Keep the newest ``checkpoint.keep`` complete cuts (and anything newer)."""
        cuts = self._complete_cuts()
        if len(cuts) > self.config.checkpoint.keep:
            oldest_kept = cuts[self.config.checkpoint.keep - 1]
            restore = self.resume_step - 1  # the current epoch's cut: a late joiner still needs it
            self._forget([r for r in self.checkpoints.values() if r.step < oldest_kept and r.step != restore])

    def _remove(self, node: NodeRecord) -> None:
        for queue, watcher in self.watchers.items():
            if watcher == node.id:
                queue.put_nowait(None)
        self.last_stages[node.id] = list(node.stages)
        before = self._owners()
        node.alive, node.stages = False, []
        self.state.upsert_node(node)
        self._replan(before)

    def _update_alive(self) -> None:
        alive = [n for n in self.nodes.values() if n.alive]
        self.metrics.nodes_alive.set(len(alive))
        for stage in range(self.config.n_stages):
            self.metrics.stage_nodes.labels(str(stage)).set(sum(stage in n.stages for n in alive))

    def _links(self, node_id: str) -> list[coordinator_pb2.BoundaryLink]:
        """``node_id``'s dial plan, each boundary with its secret for this epoch (``link_secret``)."""
        owners = self._owners()
        addresses = {n.id: n.address for n in self.nodes.values() if n.alive}
        links = links_for(node_id, owners, addresses)
        for link in links:
            if link.peer_node_id:
                b = link.boundary
                up, down = (
                    (node_id, link.peer_node_id) if link.local_stage == b else (link.peer_node_id, node_id)
                )
                ends = f"{self.run_id}/{self.plan_epoch}/{b}/{up}/{down}".encode()
                link.link_secret = hmac.new(self.link_key, ends, hashlib.sha256).hexdigest()
                link.peer_certificate = self.certificate_of.get(link.peer_node_id, "")
        return links

    def _neighbours(self, node_id: str, other_id: str) -> bool:
        """Whether the current plan joins the two nodes across a boundary, or as replicas of a
        stage (which average with each other)."""
        shared = any(other_id in hosts and node_id in hosts for hosts in self._owners())
        return shared or any(link.peer_node_id == other_id for link in self._links(node_id))

    def _alive_node(self, node_id: str) -> NodeRecord | None:
        node = self.nodes.get(node_id)
        return node if node is not None and node.alive else None

    def _session(self, context: grpc.aio.ServicerContext) -> Session:
        """The session the call's credential proves, else :class:`Rejected`. A genuine credential
        under a revoked join token evicts its node (fenced and replaced like a dead one)."""
        try:
            return self.sessions.verify(context.invocation_metadata())
        except SessionRefused as e:
            node = self._alive_node(e.node_id or "")
            if e.reason == "revoked" and node is not None:
                log.warning("node %s evicted: its join token was revoked", node.id[:8])
                self.metrics.evictions.labels(reason="revoked").inc()
                self._remove(node)
            raise Rejected("auth", f"no valid session credential ({e.reason})") from None

    def _authenticated(self, node_id: str, context: grpc.aio.ServicerContext) -> Session:
        """``node_id``'s session, else :class:`Rejected` (also for another node's credential)."""
        session = self._session(context)
        if session.node_id != node_id:
            raise Rejected("auth", f"no valid session credential for node {node_id[:8]!r}")
        return session

    async def _require_session(self, node_id: str, context: grpc.aio.ServicerContext) -> Session:
        """``node_id``'s session; otherwise the call is aborted (UNAUTHENTICATED, counted)."""
        try:
            return self._authenticated(node_id, context)
        except Rejected as e:
            await self._refuse(context, e)

    async def _require_any_session(self, context: grpc.aio.ServicerContext) -> str:
        """The calling node's id; the call is aborted unless it carries the credential of a node
        alive in the run (an evicted or dead node's credential opens nothing)."""
        try:
            node_id = self._session(context).node_id
            if self._alive_node(node_id) is not None:
                return node_id
        except Rejected:
            pass
        await self._refuse(context, Rejected("auth", "this call needs a live node's session credential"))

    def _require_member(self, node_id: str, epoch: int, context: grpc.aio.ServicerContext) -> NodeRecord:
        """The alive, authenticated node ``node_id`` following the current epoch, else :class:`Rejected`."""
        self._authenticated(node_id, context)
        node = self._alive_node(node_id)
        if node is None:
            raise Rejected("unknown_node", f"node {node_id!r} is not in the run (declared dead or replaced)")
        if epoch != self.plan_epoch:
            raise Rejected(
                "stale_epoch", f"plan epoch {epoch} is stale; the current epoch is {self.plan_epoch}"
            )
        return node

    def _require_host(self, node_id: str, stage: int, epoch: int, context: grpc.aio.ServicerContext) -> None:
        if stage not in self._require_member(node_id, epoch, context).stages:
            raise Rejected("not_hosting", f"node {node_id} does not host stage {stage}")

    async def _refuse(self, context: grpc.aio.ServicerContext, e: Rejected) -> NoReturn:
        code = _REJECTION_STATUS.get(e.label, grpc.StatusCode.INVALID_ARGUMENT)
        await self._reject(context, code, e.label, str(e))

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
        admitted = self.tokens.check(request.token)
        if admitted is None:
            refusal = "unknown or revoked join token"
            await self._reject(context, grpc.StatusCode.UNAUTHENTICATED, "auth", refusal)
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
        self.party[node.id] = admitted.id if admitted.label != SHARED_TOKEN_LABEL else node.id
        if self.security.mutual:  # the name its certificate gives it: the plan pins its streams to it
            names = context.auth_context().get("x509_common_name", [])
            self.certificate_of[node.id] = names[0].decode(errors="replace") if len(names) == 1 else ""
        self.state.set_identity(node.id, self.party[node.id], self.certificate_of.get(node.id, ""))
        self.last_seen[node.id] = time.monotonic()
        self.state.upsert_node(node)
        self._replan(before)
        return coordinator_pb2.JoinReply(
            node_id=node.id,
            run_id=self.run_id,
            config_json=self.config_json,
            config_hash=self.config_hash,
            embedding_digest=self.embedding_digest,
            embedding_size=len(self.artifacts[self.embedding_digest]),
            subspace_version=self.rotation.version,
            heartbeat_interval_ms=self.heartbeat_interval_ms,
            session=self.sessions.issue(node.id, admitted.id),
            dht_initial_peers=self.dht_peers,
            plan=self._plan(node),
            run_complete=self.run_complete,
        )

    def _plan(self, node: NodeRecord) -> coordinator_pb2.Plan:
        restore = []
        if self.resume_step > 0:
            for s in node.stages:
                r = self.checkpoints[(self.resume_step - 1, s)]
                restore.append(
                    coordinator_pb2.StageCheckpoint(stage=s, step=r.step, digest=r.digest, size=r.size)
                )
        return coordinator_pb2.Plan(
            epoch=self.plan_epoch,
            stages=node.stages,
            links=self._links(node.id),
            resume_step=self.resume_step,
            restore=restore,
            replicas=self._replicas(),
        )

    def _replicas(self) -> list[coordinator_pb2.StageReplicas]:
        """Every stage's replicas with their microbatches (as dealt at the epoch's start)."""
        stages = []
        for s, hosts in enumerate(self._owners()):
            replicas = [
                coordinator_pb2.StageReplica(
                    node_id=n,
                    microbatches=sorted(mb for mb, owner in self.dealt[s].items() if owner == n),
                    averaging_address=self.averaging.get(n, "") if len(hosts) > 1 else "",
                )
                for n in hosts
            ]
            stages.append(coordinator_pb2.StageReplicas(stage=s, replicas=replicas))
        return stages

    async def Heartbeat(self, request, context):
        node = self._alive_node(request.node_id)
        if node is None:
            self.metrics.rejected.labels(reason="unknown_node").inc()
            return coordinator_pb2.HeartbeatReply(known=False, plan_epoch=self.plan_epoch)
        session = await self._require_session(request.node_id, context)
        self.last_seen[node.id] = time.monotonic()
        self.heartbeats[node.id] = request
        self._heard_averaging(node, request)
        reply = coordinator_pb2.HeartbeatReply(
            known=True,
            plan_epoch=self.plan_epoch,
            subspace_version=self.rotation.version,
            run_complete=self.run_complete,
            cut_requests=self.cut_requests,
            session=self.sessions.renewal(session) or "",
        )
        if request.plan_epoch != self.plan_epoch:
            reply.plan.CopyFrom(self._plan(node))
        return reply

    def _heard_averaging(self, node: NodeRecord, request: coordinator_pb2.HeartbeatRequest) -> None:
        """Note a heartbeat's capacity and averaging address: standbys that can average may now
        become replicas; a replica whose address changed (it restarted its P2P, or this
        coordinator restarted) needs a plan that carries the new one."""
        if request.capacity_tokens_per_second > 0:
            self.capacity[node.id] = request.capacity_tokens_per_second
        if self.config.train.replicas <= 1:
            return
        address = request.averaging_address[:1024]
        moved = address != self.averaging.get(node.id, "")
        self.averaging[node.id] = address
        owners = self._owners()
        if moved and any(len(owners[s]) > 1 for s in node.stages):
            self._start_epoch(f"node {node.id[:8]} averages at a new address")
        elif any(n.alive and not n.stages and self.averaging.get(n.id) for n in self.nodes.values()):
            self._replan(owners)

    async def Leave(self, request, context):
        await self._require_session(request.node_id, context)
        node = self._alive_node(request.node_id)
        self.leaving.discard(request.node_id)
        if node is not None:
            log.info("node %s leaves: %s", node.id[:8], request.reason or "no reason given")
            self.left.add(node.id)
            self._remove(node)
        return coordinator_pb2.LeaveReply()

    async def ReportFailure(self, request, context):
        try:
            self._require_member(request.node_id, request.plan_epoch, context)
        except Rejected as e:
            if e.label != "stale_epoch":  # a failure of an old epoch is already handled
                await self._refuse(context, e)
            return coordinator_pb2.FailureAck(plan_epoch=self.plan_epoch)
        peer = self._alive_node(request.peer_node_id)
        if peer is not None and peer.id in self.leaving:
            # A leaving node closed its streams after its final cut; its Leave starts the next epoch
            # from that cut (a new epoch now would drop the cut's snapshots still on their way).
            return coordinator_pb2.FailureAck(plan_epoch=self.plan_epoch)
        if request.bad_input and peer is not None and self._neighbours(request.node_id, peer.id):
            self._judge_accusation(self.nodes[request.node_id], peer, request.reason)
            return coordinator_pb2.FailureAck(plan_epoch=self.plan_epoch)
        answered = peer is None or not peer.address or await self._answers(peer)
        # Re-check after the probe: the epoch may have moved on meanwhile.
        if self.run_complete or request.plan_epoch != self.plan_epoch:
            return coordinator_pb2.FailureAck(plan_epoch=self.plan_epoch)
        if not answered and peer.alive:
            log.info("node %s does not answer after a failure report: declared dead", peer.id[:8])
            self._remove(peer)
        else:
            self._start_epoch(f"node {request.node_id[:8]}: {request.reason}")
        return coordinator_pb2.FailureAck(plan_epoch=self.plan_epoch)

    def _judge_accusation(self, accuser: NodeRecord, accused: NodeRecord, reason: str) -> None:
        """Evict the neighbour ``accuser`` received an invalid frame from, unless the record says
        otherwise. Parties are personal join tokens (an evicted node that rejoins with its token is
        the same party; see :attr:`party`).
        An accuser that already had *another* party evicted is the suspect (the common factor)
        and is evicted instead. The same pair a third time cannot be told apart (a liar, or a
        repeat offender next to the same honest node): both are evicted."""
        accuser_key = self.party.get(accuser.id, accuser.id)
        accused_key = self.party.get(accused.id, accused.id)
        record = self.accusations.setdefault(accuser_key, collections.Counter())
        others = sorted(k[:8] for k in record if k != accused_key)
        if others:
            log.warning(
                "node %s evicted: it accused a second party (%s, after %s) of invalid frames",
                accuser.id[:8],
                accused.id[:8],
                ", ".join(others),
            )
            self.metrics.evictions.labels(reason="accuser").inc()
            self._remove(accuser)
            return
        record[accused_key] += 1
        log.warning(
            "node %s evicted: its neighbour %s received an invalid frame from it: %s",
            accused.id[:8],
            accuser.id[:8],
            reason[:200],
        )
        self.metrics.evictions.labels(reason="bad_input").inc()
        self._remove(accused)
        if record[accused_key] >= SAME_PAIR_ACCUSATIONS:
            log.warning(
                "node %s evicted too: the %d-th accusation of the same party",
                accuser.id[:8],
                record[accused_key],
            )
            self.metrics.evictions.labels(reason="accuser").inc()
            self._remove(accuser)

    async def _answers(self, node: NodeRecord) -> bool:
        """Whether a node is alive after all: it answers a Ping within ``PROBE_TIMEOUT_S``, or, failing
        that, still heartbeats for two more intervals (its port may just be out of our reach)."""
        async with open_channel(node.address, self.security, server_name=NODE_SERVER_NAME) as channel:
            try:
                await stage_pb2_grpc.StageStub(channel).Ping(stage_pb2.PingRequest(), timeout=PROBE_TIMEOUT_S)
                return True
            except grpc.aio.AioRpcError:
                pass
        silent_for = 2 * self.heartbeat_interval_ms / 1000
        seen = self.last_seen[node.id]
        await asyncio.sleep(max(0.0, seen + silent_for - time.monotonic()))
        return self.last_seen[node.id] > seen

    async def RequestCut(self, request, context):
        try:
            self._require_member(request.node_id, request.plan_epoch, context)
        except Rejected as e:
            await self._refuse(context, e)
        self.cut_requests += 1
        self.leaving.add(request.node_id)
        return coordinator_pb2.CutAck()

    async def GetRunConfig(self, request, context):
        return coordinator_pb2.RunConfigReply(
            run_id=self.run_id, config_json=self.config_json, config_hash=self.config_hash
        )

    async def FetchArtifact(self, request, context) -> AsyncIterator[coordinator_pb2.ArtifactChunk]:
        await self._require_any_session(context)
        data = self.artifacts.get(request.digest)
        with contextlib.suppress(PayloadError):  # a malformed digest is simply not found
            if data is None and self.store.complete(request.digest):
                data = self.store.read(request.digest)
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
        key, complete = "", False
        async for chunk in request_iterator:
            try:
                if not key:
                    self._require_member(chunk.node_id, self.plan_epoch, context)
                    key = chunk.digest
                elif chunk.digest != key:
                    raise UploadError("one upload carries one artifact")
                complete = self.store.append(key, chunk.offset, chunk.data, chunk.total_size)
            except Rejected as e:
                await self._refuse(context, e)
            except UploadError as e:
                await self._reject(context, grpc.StatusCode.FAILED_PRECONDITION, "bad_upload", str(e))
            except PayloadError as e:
                await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_upload", str(e))
        return coordinator_pb2.UploadReply(held=self.store.held(key) if key else 0, complete=complete)

    async def ArtifactStatus(self, request, context) -> coordinator_pb2.ArtifactStatusReply:
        try:
            self._require_member(request.node_id, self.plan_epoch, context)
            held, complete = self.store.held(request.digest), self.store.complete(request.digest)
        except Rejected as e:
            await self._refuse(context, e)
        except PayloadError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed", str(e))
        return coordinator_pb2.ArtifactStatusReply(held=held, complete=complete)

    async def ReportCheckpoint(self, request, context) -> coordinator_pb2.CheckpointAck:
        c = request.checkpoint
        try:
            self._require_host(request.node_id, c.stage, request.plan_epoch, context)
            if not self.store.complete(c.digest) or self.store.held(c.digest) != c.size:
                raise Rejected("malformed", f"snapshot {c.digest[:12]} of {c.size} bytes is not uploaded")
        except Rejected as e:
            await self._refuse(context, e)
        except PayloadError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed", str(e))
        record = CheckpointRecord(c.step, c.stage, c.digest, c.size)
        self.checkpoints[(c.step, c.stage)] = record
        self.state.add_checkpoint(record)
        self._prune_cuts()
        cuts = self._complete_cuts()
        if cuts and cuts[0] != self._cut_shown:
            self._cut_shown = cuts[0]
            self.metrics.checkpointed(cuts[0])
            if cuts[0] == self.config.train.steps - 1 and self.model_dir is not None:
                self._export_task = asyncio.create_task(self._export_final_model())
        return coordinator_pb2.CheckpointAck(latest_cut=cuts[0] + 1 if cuts else 0)

    async def _export_final_model(self) -> None:
        """The run's final cut is stored: write the trained model folder (off the event loop)."""
        records = list(self.checkpoints.values())
        try:
            model = await asyncio.to_thread(trained_model, self.config, records, self.store)
            manifest = await asyncio.to_thread(model_io.save, model, self.model_dir)
        except Exception as e:  # the snapshots stay in the store: `swarm-coordinator export` can retry
            log.error("could not export the trained model to %s: %s", self.model_dir, e)
            return
        log.info("trained model (step %d) written to %s", manifest["step"], self.model_dir)

    async def WatchRotations(self, request, context) -> AsyncIterator[common_pb2.Rotation]:
        node_id = await self._require_any_session(context)
        queue: asyncio.Queue[SubspaceRotation | None] = asyncio.Queue()
        self.watchers[queue] = node_id
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
            self.watchers.pop(queue, None)

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
            self._require_host(request.node_id, request.stage, request.plan_epoch, context)
            if request.boundary != request.stage - 1:
                raise Rejected("malformed", f"stage {request.stage} reports boundary {request.boundary}")
            if self._already_rotated(request.step, request.subspace_version):
                return coordinator_pb2.StatisticsAck(accepted=True, reason="rotation already published")
            self._offer(stat)
        except Rejected as e:
            self.metrics.rejected.labels(reason=e.label).inc()
            return coordinator_pb2.StatisticsAck(accepted=False, reason=str(e))
        return coordinator_pb2.StatisticsAck(accepted=True)

    def _already_rotated(self, step: int, version: int) -> bool:
        """A statistic replayed after a rollback, for a rotation that is already published."""
        return any(
            r.effective_step == step + 1 and r.version == version + 1
            for r in self.state.rotations(after_version=version)
        )

    async def ReportStep(self, request, context):
        try:
            self._require_host(request.node_id, request.stage, request.plan_epoch, context)
        except Rejected as e:
            await self._refuse(context, e)
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
        if request.step > self.completed:
            self.completed = self.state.completed_step(self.config.n_stages)
            rates = self._rates()
            self.metrics.run_tokens_per_second.set(rates.tokens_per_second)
            self.metrics.run_bytes_per_token.set(rates.bytes_per_token)
            self.metrics.run_compression_ratio.set(rates.compression_ratio)
            if self.run_complete:
                log.info("run complete: every stage finished step %d", self.completed)
        return coordinator_pb2.StepAck()

    async def Status(self, request, context):
        return self.status(request.since_step)

    def status(self, since_step: int = 0) -> coordinator_pb2.StatusReply:
        """The run, its nodes and the completed steps >= ``since_step``."""
        now = time.monotonic()
        nodes = []
        for n in self.nodes.values():
            beat = self.heartbeats.get(n.id, coordinator_pb2.HeartbeatRequest())
            nodes.append(
                coordinator_pb2.NodeStatus(
                    node_id=n.id,
                    node_name=n.name,
                    address=n.address,
                    stages=n.stages,
                    last_heartbeat_age_s=now - self.last_seen[n.id],
                    alive=n.alive,
                    device=n.device,
                    phase=beat.phase,
                    plan_epoch=beat.plan_epoch,
                    step=beat.step,
                    tokens_per_second=beat.tokens_per_second,
                    subspace_version=beat.subspace_version,
                    left=n.id in self.left,
                    last_stages=n.stages or self.last_stages.get(n.id, []),
                )
            )
        completed = self.completed
        cuts = self._complete_cuts()
        return coordinator_pb2.StatusReply(
            run_id=self.run_id,
            step=max(0, completed),
            subspace_version=self.rotation.version,
            nodes=nodes,
            config_hash=self.config_hash,
            steps_completed=completed + 1,
            steps=self._step_summaries(since_step),
            plan_epoch=self.plan_epoch,
            resume_step=self.resume_step,
            latest_cut=cuts[0] + 1 if cuts else 0,
            run_complete=self.run_complete,
            epochs_restarted=self.restarts,
            rates=self._rates(),
        )

    def _step_summaries(self, since_step: int) -> list[coordinator_pb2.StepSummary]:
        return [
            coordinator_pb2.StepSummary(
                step=step,
                loss=loss,
                tokens=tokens or 0,
                bytes_sent_forward=fwd or 0,
                bytes_sent_backward=bwd or 0,
                wall_seconds=wall or 0.0,
                completed_at=at,
            )
            for step, loss, tokens, fwd, bwd, wall, at in self.state.step_summaries(
                self.config.n_stages, since_step
            )
        ]

    def _rates(self) -> coordinator_pb2.RunRates:
        recent = self._step_summaries(max(0, self.completed - RATE_WINDOW + 1))[-RATE_WINDOW:]
        return run_rates(recent, self.config.model.d_model, self.config.n_stages - 1)


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
