"""The coordinator: a real grpc.aio server on loopback, real client stubs, and the CLI in a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from swarm.coordinator.assignment import add_replicas, assign, links_for, stages_of, take_stages
from swarm.coordinator.export import artifact_store
from swarm.coordinator.judge import SAME_PAIR_ACCUSATIONS, Judge
from swarm.coordinator.keepers import Keepers
from swarm.coordinator.ledger import Ledger
from swarm.coordinator.roster import Roster
from swarm.coordinator.screen_reports import SUSPECT_STEPS
from swarm.coordinator.service import CoordinatorServer, CoordinatorService
from swarm.coordinator.settings import CoordinatorSettings
from swarm.coordinator.state import CheckpointRecord, CoordinatorState, NodeRecord

from swarm._proto.swarm.v1 import coordinator_pb2, coordinator_pb2_grpc
from swarm.core.config import RotationConfig, RunConfig, config_hash
from swarm.core.subspace import initial_artifacts, next_rotation
from swarm.io.artifacts import CHUNK_BYTES, digest, matrix_to_bytes
from swarm.io.manifest import Manifest
from swarm.net.credentials import session_metadata
from swarm.net.frames import PROTOCOL_VERSION, rotation_from_proto
from swarm.ops.metrics import Metrics
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "coordinator-test-join-secret"
PEERS = ["/ip4/127.0.0.1/tcp/4001/p2p/QmTestPeer"]
RPC_TIMEOUT = 5.0
ACCEPTS = "127.0.0.1:1"  # an announce address the harness's coordinator takes on trust
DIAL, ACCEPT, UNSPECIFIED = (
    coordinator_pb2.LINK_ROLE_DIAL,
    coordinator_pb2.LINK_ROLE_ACCEPT,
    coordinator_pb2.LINK_ROLE_UNSPECIFIED,
)


def run(coro: Coroutine[Any, Any, Any], timeout: float = 20.0) -> Any:
    """Run a test coroutine on a fresh event loop, bounded by ``timeout``."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def rotating_config(n_stages: int = 4, interval: int = 2) -> RunConfig:
    return dataclasses.replace(tiny_config(n_stages=n_stages), rotation=RotationConfig(interval=interval))


@dataclasses.dataclass
class Harness:
    service: CoordinatorService
    server: CoordinatorServer
    stub: coordinator_pb2_grpc.CoordinatorStub
    credentials: NodeCredentials

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.service.metrics.registry.get_sample_value(name, labels or {})

    def rejected(self, reason: str) -> float:
        return self.sample("swarm_rejected_messages_total", {"reason": reason}) or 0.0

    async def join(
        self, name: str, max_stages: int = 1, address: str = ACCEPTS, token: str = TOKEN
    ) -> coordinator_pb2.JoinReply:
        """Join as node ``name``, accepting streams at ``address`` ("": dial-only)."""
        request = coordinator_pb2.JoinRequest(
            protocol_version=PROTOCOL_VERSION,
            token=token,
            node_name=name,
            announce_address=address,
            max_stages=max_stages,
            device="cpu",
        )
        reply = await self.stub.Join(request, timeout=RPC_TIMEOUT)
        self.credentials.sessions[reply.node_id] = reply.session
        return reply

    async def heartbeat(
        self,
        node_id: str,
        plan_epoch: int = 0,
        phase: int = coordinator_pb2.NODE_PHASE_UNSPECIFIED,
        **fields,
    ) -> coordinator_pb2.HeartbeatReply:
        """A heartbeat from a node following ``plan_epoch`` (0: none yet, so the reply carries the plan)."""
        request = coordinator_pb2.HeartbeatRequest(
            node_id=node_id, plan_epoch=plan_epoch, phase=phase, **fields
        )
        return await self.stub.Heartbeat(request, timeout=RPC_TIMEOUT)

    async def step(
        self, node_id: str, stage: int, step: int, epoch: int, loss: float | None = None
    ) -> coordinator_pb2.StepAck:
        request = coordinator_pb2.StepReport(
            node_id=node_id, stage=stage, step=step, loss=loss, plan_epoch=epoch
        )
        return await self.stub.ReportStep(request, timeout=RPC_TIMEOUT)

    async def upload(self, chunks: list[coordinator_pb2.ArtifactChunk]) -> coordinator_pb2.UploadReply:
        return await self.stub.UploadArtifact(iter(chunks), timeout=RPC_TIMEOUT)

    async def held(self, node_id: str, key: str) -> coordinator_pb2.ArtifactStatusReply:
        request = coordinator_pb2.ArtifactRequest(digest=key, node_id=node_id)
        return await self.stub.ArtifactStatus(request, timeout=RPC_TIMEOUT)

    async def fetch(self, key: str, offset: int = 0) -> bytes:
        request = coordinator_pb2.ArtifactRequest(digest=key, offset=offset)
        return b"".join([c.data async for c in self.stub.FetchArtifact(request, timeout=RPC_TIMEOUT)])

    async def checkpoint(
        self, node_id: str, epoch: int, stage: int, step: int
    ) -> tuple[coordinator_pb2.CheckpointAck, coordinator_pb2.StageCheckpoint]:
        """Upload a stand-in snapshot of ``stage`` after ``step`` in one chunk and report it."""
        data = f"snapshot of stage {stage} after step {step};".encode() * 64
        key = digest(data)
        reply = await self.upload([upload_chunk(node_id, data, 0, len(data))])
        assert reply.complete and reply.held == len(data)
        chunks = Manifest.of(stage, step, data, chunk_bytes=1024)
        record = coordinator_pb2.StageCheckpoint(
            stage=stage,
            step=step,
            digest=key,
            size=len(data),
            chunk_bytes=1024,
            chunk_sha256=chunks.packed,
            at_coordinator=True,  # as a plan names it: uploaded
        )
        request = coordinator_pb2.CheckpointReport(node_id=node_id, plan_epoch=epoch, checkpoint=record)
        return await self.stub.ReportCheckpoint(request, timeout=RPC_TIMEOUT), record

    async def failure(self, node_id: str, epoch: int) -> coordinator_pb2.FailureAck:
        request = coordinator_pb2.FailureReport(node_id=node_id, plan_epoch=epoch, reason="boundary broke")
        return await self.stub.ReportFailure(request, timeout=RPC_TIMEOUT)

    async def accuse(self, accuser: coordinator_pb2.JoinReply, accused: coordinator_pb2.JoinReply) -> None:
        """``accuser`` reports that ``accused`` sent it an invalid frame (at the current epoch)."""
        request = coordinator_pb2.FailureReport(
            node_id=accuser.node_id,
            plan_epoch=(await self.status()).plan_epoch,
            reason="bad frame from the peer",
            peer_node_id=accused.node_id,
            bad_input=True,
        )
        await self.stub.ReportFailure(request, timeout=RPC_TIMEOUT)

    async def report(self, request: coordinator_pb2.StatisticsReport) -> coordinator_pb2.StatisticsAck:
        return await self.stub.ReportStatistics(request, timeout=RPC_TIMEOUT)

    async def status(self) -> coordinator_pb2.StatusReply:
        return await self.stub.Status(coordinator_pb2.StatusRequest(), timeout=RPC_TIMEOUT)


class NodeCredentials:
    """Does on the test channel what a node's client does: sends the session a node's Join returned
    (``Harness.join`` records it) with every call naming that node (calls naming none: the first
    node's)."""

    def __init__(self):
        self.sessions: dict[str, str] = {}

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """One interceptor per call shape (a channel files each under one shape only)."""
        outer = self

        class Unary(grpc.aio.UnaryUnaryClientInterceptor):
            async def intercept_unary_unary(self, continuation, details, request):
                return await continuation(outer.attach(details, request), request)

        class Streaming(grpc.aio.UnaryStreamClientInterceptor):
            async def intercept_unary_stream(self, continuation, details, request):
                return await continuation(outer.attach(details, request), request)

        class Upload(grpc.aio.StreamUnaryClientInterceptor):
            async def intercept_stream_unary(self, continuation, details, request_iterator):
                chunks = list(request_iterator)  # the tests upload lists: the first names the node
                first = chunks[0] if chunks else None
                return await continuation(outer.attach(details, first), iter(chunks))

        return [Unary(), Streaming(), Upload()]

    def attach(self, details, request):
        if details.metadata:  # the test set its own (an impostor's) credentials
            return details
        node_id = getattr(request, "node_id", "") or next(iter(self.sessions), "")
        if node_id not in self.sessions:
            return details
        return details._replace(metadata=session_metadata(node_id, self.sessions[node_id]))


@contextlib.asynccontextmanager
async def coordinator(
    state: Path,
    config: RunConfig | None = None,
    dead_after_s: float = CoordinatorSettings.dead_after_s,
    credentials: NodeCredentials | None = None,
    keepers: int = 0,
) -> AsyncIterator[Harness]:
    """A coordinator on ``state`` and a channel to it; ``credentials``: sessions nodes already hold
    (from a previous coordinator on the same state); ``keepers``: snapshot keepers (0: these tests'
    nodes upload their snapshots, and nothing is fetched from their made-up addresses)."""
    credentials = credentials or NodeCredentials()
    # The announce addresses these tests join with are made up: taken on trust, not dialled back
    # (tests/test_reachability.py dials real ones).
    settings = CoordinatorSettings(dead_after_s=dead_after_s, reach_timeout_s=0.0, snapshot_keepers=keepers)
    service = CoordinatorService(
        config or tiny_config(), TOKEN, state, None, Metrics("coordinator"), PEERS, settings
    )
    async with CoordinatorServer(service) as server:
        channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{server.port}", interceptors=credentials.interceptors()
        )
        try:
            yield Harness(service, server, coordinator_pb2_grpc.CoordinatorStub(channel), credentials)
        finally:
            await channel.close()


async def refused(call: Awaitable[Any]) -> grpc.StatusCode:
    """The status code of a call that must fail."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code()


def statistic(
    node_id: str, stage: int, step: int, stat: torch.Tensor, *, epoch: int, version: int = 0
) -> coordinator_pb2.StatisticsReport:
    return coordinator_pb2.StatisticsReport(
        node_id=node_id,
        stage=stage,
        step=step,
        boundary=stage - 1,
        subspace_version=version,
        gram_times_basis_f64_le=stat.double().contiguous().numpy().astype("<f8").tobytes(),
        plan_epoch=epoch,
    )


def upload_chunk(
    node_id: str, data: bytes, offset: int, length: int, key: str | None = None
) -> coordinator_pb2.ArtifactChunk:
    """``data[offset : offset + length]`` as one upload chunk of the artifact ``data`` (digest ``key``)."""
    return coordinator_pb2.ArtifactChunk(
        node_id=node_id,
        offset=offset,
        data=data[offset : offset + length],
        total_size=len(data),
        digest=key or digest(data),
    )


# -- pure functions ---------------------------------------------------------------------------


def test_take_stages_is_lowest_contiguous_free_run():
    assert take_stages([()] * 4, 2) == [0, 1]
    assert take_stages([("a",), (), (), ("b",)], 3) == [1, 2]
    assert take_stages([("a",), (), ("b",), ()], 3) == [1]
    assert take_stages([("a",), ("b",)], 1) == []
    assert take_stages([(), ()], 0) == [0]  # max_stages 0 counts as 1
    assert assign([(), ("a",), (), ()], [("s1", 1), ("s2", 5)]) == [("s1",), ("a",), ("s2",), ("s2",)]


def test_replicas_join_the_stage_of_least_capacity():
    owners = [("a",), ("b",), ("c",)]
    capacity = {"a": 900.0, "b": 300.0, "c": 600.0}
    # b's stage is the bottleneck; with a second replica it holds 600 (the mean, 600, for the
    # unmeasured newcomer), tied with c's stage, which has fewer replicas.
    assert add_replicas(owners, ["x", "y"], capacity, most=2) == [("a",), ("b", "x"), ("c", "y")]
    # At most `most` per stage; candidates left over stay standbys.
    assert add_replicas(owners, ["x", "y", "z", "w"], capacity, most=2) == [
        ("a", "z"),
        ("b", "x"),
        ("c", "y"),
    ]
    assert add_replicas(owners, ["x"], capacity, most=1) == owners
    # Nothing measured yet: fewest replicas, then the lowest stage.
    assert add_replicas([("a",), ("b",)], ["x", "y", "z"], {}, most=3) == [("a", "x", "z"), ("b", "y")]
    # A free stage is never filled by a replica (assign() hands it out first).
    assert add_replicas([(), ("b",)], ["x"], {}, most=2) == [(), ("b", "x")]
    assert stages_of([("a",), ("b", "a")], "a") == [0, 1]


def test_dial_plan_rules():
    owners = [("a",), ("a",), ("b",), ("c",)]
    addresses = {"a": "10.0.0.1:1", "b": "", "c": "10.0.0.3:3"}
    # a-b: downstream b is unreachable, so b dials upstream a.
    assert links_for("a", owners, addresses) == [
        coordinator_pb2.BoundaryLink(boundary=1, local_stage=1, peer_node_id="b", role=ACCEPT)
    ]
    # b-c: downstream c is reachable, so b dials it; b hosts a stage with no inbound port.
    assert links_for("b", owners, addresses) == [
        coordinator_pb2.BoundaryLink(
            boundary=1, local_stage=2, peer_node_id="a", peer_address="10.0.0.1:1", role=DIAL
        ),
        coordinator_pb2.BoundaryLink(
            boundary=2, local_stage=2, peer_node_id="c", peer_address="10.0.0.3:3", role=DIAL
        ),
    ]
    assert links_for("c", owners, addresses) == [
        coordinator_pb2.BoundaryLink(boundary=2, local_stage=3, peer_node_id="b", role=ACCEPT)
    ]
    # Nobody reachable: no role (would need a relay).
    assert links_for("a", [("a",), ("b",)], {"a": "", "b": ""}) == [
        coordinator_pb2.BoundaryLink(boundary=0, local_stage=0, peer_node_id="b", role=UNSPECIFIED)
    ]
    # The other stage unassigned: the link is listed without a peer.
    assert links_for("a", [("a",), ()], addresses) == [
        coordinator_pb2.BoundaryLink(boundary=0, local_stage=0, role=UNSPECIFIED)
    ]
    assert links_for("d", owners, addresses) == []


def test_dial_plan_with_replicas_links_every_pair_of_neighbouring_replicas():
    owners = [("a",), ("b", "x"), ("c",)]
    addresses = {"a": "h:1", "b": "h:2", "x": "h:3", "c": "h:4"}
    # a sends to both replicas of stage 1 (one stream each); a local replica needs no stream.
    assert [(lk.boundary, lk.peer_node_id, lk.role) for lk in links_for("a", owners, addresses)] == [
        (0, "b", DIAL),
        (0, "x", DIAL),
    ]
    assert [(lk.boundary, lk.peer_node_id, lk.role) for lk in links_for("x", owners, addresses)] == [
        (0, "a", ACCEPT),
        (1, "c", DIAL),
    ]
    assert [lk.peer_node_id for lk in links_for("a", [("a",), ("a", "x")], addresses)] == ["x"]


# -- collaborators without gRPC ----------------------------------------------------------------


def test_the_ledger_shows_each_cut_once_and_resumes_from_the_newest_that_verifies(tmp_path):
    config = tiny_config(n_stages=2)
    state = CoordinatorState(tmp_path / "state.sqlite")
    try:
        store = artifact_store(tmp_path / "state.sqlite", 1 << 20)
        run = state.open_run(None, config)
        metrics = Metrics("coordinator")
        roster = Roster(config.n_stages, state, metrics, CoordinatorSettings())
        ledger = Ledger(config, run, state, store, Keepers(0, b"key", state, roster, metrics), metrics)

        def snapshot(step: int, stage: int) -> int | None:
            data = f"stage {stage} after step {step}".encode()
            store.append(digest(data), 0, data, len(data))
            return ledger.add_checkpoint(CheckpointRecord(step, stage, digest(data), len(data)))

        assert [snapshot(1, 0), snapshot(1, 1), snapshot(3, 0), snapshot(3, 1)] == [None, 1, None, 3]
        assert ledger.latest_cut() == 3
        store.cache.path(ledger.checkpoints[(3, 1)].digest).write_bytes(b"bit rot")
        ledger.start_epoch("a boundary broke", progressed=True)
        assert (ledger.plan_epoch, ledger.resume_step, ledger.restarts) == (run.plan_epoch + 1, 2, 1)
        assert sorted(ledger.checkpoints) == [(1, 0), (1, 1)] and ledger.latest_cut() == 1
        assert [(r.stage, r.step) for r in ledger.restore([0, 1])] == [(0, 1), (1, 1)]
    finally:
        state.close()


def test_the_judge_evicts_the_accused_then_a_repeat_accuser_and_both_of_a_recurring_pair():
    evicted: list[NodeRecord] = []
    judge = Judge(lambda node_id: node_id, evicted.append, Metrics("coordinator"))
    a, b, c = (NodeRecord(n, n, "", "cpu", 1, [], True) for n in "abc")
    judge.accusation(a, b, "bad frame")
    judge.accusation(a, c, "bad frame")  # a second party: the accuser is the common factor
    assert [n.id for n in evicted] == ["b", "a"]
    evicted.clear()
    for _ in range(SAME_PAIR_ACCUSATIONS):
        judge.accusation(c, b, "bad frame")
    assert [n.id for n in evicted] == ["b"] * SAME_PAIR_ACCUSATIONS + ["c"]


# -- the service ------------------------------------------------------------------------------


def test_a_standby_becomes_a_replica_of_the_weakest_stage_once_capacities_are_measured(tmp_path):
    config = tiny_config(n_stages=2, microbatches=4, replicas=2)
    p2p = "/ip4/127.0.0.1/tcp/{}/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", config) as h:
            a, b, x = [await h.join(name, address=f"127.0.0.1:700{i}") for i, name in enumerate("abx")]
            for i, node in enumerate((a, b, x)):
                await h.heartbeat(node.node_id, averaging_address=p2p.format(i + 1))

            async def x_plan() -> coordinator_pb2.Plan:
                return (await h.heartbeat(x.node_id, averaging_address=p2p.format(3))).plan

            # a and b have not measured themselves yet: x stays a standby
            assert list((await x_plan()).stages) == []
            await h.heartbeat(a.node_id, averaging_address=p2p.format(1), capacity_tokens_per_second=900.0)
            assert list((await x_plan()).stages) == []
            await h.heartbeat(b.node_id, averaging_address=p2p.format(2), capacity_tokens_per_second=300.0)
            plan = await x_plan()
            assert list(plan.stages) == [1]  # b's stage is the bottleneck
            stage1 = plan.replicas[1].replicas
            # dealt by capacity (x, unmeasured, at the swarm's mean 600): x twice as many as b
            assert [(r.node_id, list(r.microbatches)) for r in stage1] == [
                (b.node_id, [0]),
                (x.node_id, [1, 2, 3]),
            ]
            assert [r.averaging_address for r in stage1] == [p2p.format(2), p2p.format(3)]
            (stage0,) = plan.replicas[0].replicas
            assert stage0.node_id == a.node_id and list(stage0.microbatches) == [0, 1, 2, 3]
            assert not stage0.averaging_address  # a stage with one replica averages with nobody
            # a dials both replicas of stage 1, each pair with its own secret
            a_links = (await h.heartbeat(a.node_id, averaging_address=p2p.format(1))).plan.links
            assert sorted(lk.peer_node_id for lk in a_links) == sorted([b.node_id, x.node_id])
            assert len({lk.link_secret for lk in a_links}) == 2

    asyncio.run(scenario())


def test_join_assigns_stages_in_order_then_standby(tmp_path):
    config = tiny_config(n_stages=4)

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", config) as h:
            a = await h.join("a", max_stages=2, address="127.0.0.1:7001")
            b = await h.join("b", max_stages=1, address="127.0.0.1:7002")
            c = await h.join("c", max_stages=3, address="")
            d = await h.join("d", max_stages=1, address="")
            replies = (a, b, c, d)
            assert [list(r.plan.stages) for r in replies] == [[0, 1], [2], [3], []]
            assert [r.plan.epoch for r in replies] == [1, 2, 3, 3]  # the standby changed no owner
            assert all(r.plan.resume_step == 0 and not r.plan.restore for r in replies)
            assert not any(r.run_complete for r in replies)
            assert len({a.node_id, b.node_id, c.node_id, d.node_id}) == 4
            # At a's join stage 2 had no host yet; a heartbeat brings the filled-in link.
            assert list(a.plan.links) == [coordinator_pb2.BoundaryLink(boundary=1, local_stage=1)]
            beat = await h.heartbeat(a.node_id, a.plan.epoch)
            assert beat.known and beat.plan_epoch == beat.plan.epoch == 3
            assert list(beat.plan.stages) == [0, 1]
            # Both ends of a boundary, and only they, get its secret for this epoch.
            b_links = {link.boundary: link.link_secret for link in (await h.heartbeat(b.node_id)).plan.links}
            assert beat.plan.links[0].link_secret == b_links[1] != b_links[2] and all(b_links.values())
            beat.plan.links[0].ClearField("link_secret")
            assert list(beat.plan.links) == [
                coordinator_pb2.BoundaryLink(
                    boundary=1,
                    local_stage=1,
                    peer_node_id=b.node_id,
                    peer_address="127.0.0.1:7002",
                    role=DIAL,
                )
            ]
            # A node that follows the current epoch gets no plan.
            current = await h.heartbeat(a.node_id, 3, coordinator_pb2.NODE_PHASE_TRAINING)
            assert current.known and current.plan_epoch == 3 and not current.HasField("plan")
            assert RunConfig.from_dict(json.loads(a.config_json)) == config
            assert a.config_hash == config_hash(config) and a.run_id == h.service.run_id
            embedding = matrix_to_bytes(initial_artifacts(config)[0])
            assert (a.embedding_digest, a.embedding_size) == (digest(embedding), len(embedding))
            assert list(a.dht_initial_peers) == PEERS and a.heartbeat_interval_ms == 1000
            beat = await h.heartbeat(c.node_id)
            assert beat.known and beat.plan_epoch == 3 and list(beat.plan.stages) == [3]
            links = [(link.boundary, link.role) for link in beat.plan.links]
            assert links == [(2, DIAL)]  # b is reachable, c not
            # Heartbeats report each node's phase and epoch.
            status = await h.status()
            reported = {n.node_name: (n.phase, n.plan_epoch) for n in status.nodes}
            assert reported["a"] == (coordinator_pb2.NODE_PHASE_TRAINING, 3)
            assert reported["b"] == (coordinator_pb2.NODE_PHASE_UNSPECIFIED, 0)  # never beat
            assert (status.plan_epoch, status.resume_step, status.latest_cut) == (3, 0, 0)
            assert not status.run_complete and status.epochs_restarted == 0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                bad = coordinator_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION + 1, token=TOKEN)
                await h.stub.Join(bad, timeout=RPC_TIMEOUT)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (await h.heartbeat("nobody")).known is False

    run(scenario())


def test_wrong_token_is_unauthenticated(tmp_path):
    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite") as h:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.join("intruder", token="guess")
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert h.rejected("auth") == 1
            assert not (await h.status()).nodes

    run(scenario())


def test_artifact_fetch_in_chunks(tmp_path):
    config = tiny_config()
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=10_000))

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", config) as h:
            a = await h.join("a")

            async def fetch(key: str, offset: int = 0) -> list[coordinator_pb2.ArtifactChunk]:
                request = coordinator_pb2.ArtifactRequest(digest=key, offset=offset)
                return [c async for c in h.stub.FetchArtifact(request, timeout=RPC_TIMEOUT)]

            chunks = await fetch(a.embedding_digest)
            assert len(chunks) == 2 and all(len(c.data) <= CHUNK_BYTES for c in chunks)
            assert [c.offset for c in chunks] == [0, CHUNK_BYTES]
            data = b"".join(c.data for c in chunks)
            assert len(data) == a.embedding_size == chunks[0].total_size
            assert digest(data) == a.embedding_digest
            resumed = await fetch(a.embedding_digest, offset=1000)
            assert b"".join(c.data for c in resumed) == data[1000:]
            for key, offset, code in [
                ("0" * 64, 0, grpc.StatusCode.NOT_FOUND),
                (a.embedding_digest, a.embedding_size + 1, grpc.StatusCode.OUT_OF_RANGE),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await fetch(key, offset)
                assert err.value.code() == code

    run(scenario())


def test_dead_node_stages_go_to_standby(tmp_path):
    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", tiny_config(n_stages=2), dead_after_s=0.5) as h:
            a = await h.join("a", address="127.0.0.1:7001")
            b = await h.join("b", address="")
            standby = await h.join("standby", address="")  # no inbound port: it will dial a
            assert list(standby.plan.stages) == [] and not standby.plan.links
            deadline = time.monotonic() + 5
            while True:  # a and the standby keep beating; b has gone silent
                await h.heartbeat(a.node_id, a.plan.epoch)
                beat = await h.heartbeat(standby.node_id, standby.plan.epoch)
                if beat.plan_epoch != standby.plan.epoch:
                    break
                assert not beat.HasField("plan")
                assert time.monotonic() < deadline, "stage 1 was never reassigned"
                await asyncio.sleep(0.1)
            assert beat.plan.epoch == beat.plan_epoch > standby.plan.epoch
            assert list(beat.plan.stages) == [1]
            assert beat.plan.resume_step == 0 and not beat.plan.restore  # no checkpoint yet: from the start
            assert beat.plan.links[0].link_secret  # a new epoch, a new boundary secret
            beat.plan.links[0].ClearField("link_secret")
            assert list(beat.plan.links) == [
                coordinator_pb2.BoundaryLink(
                    boundary=0,
                    local_stage=1,
                    peer_node_id=a.node_id,
                    peer_address="127.0.0.1:7001",
                    role=DIAL,
                )
            ]
            # b is fenced: told it is unknown, and its reports are refused even at the current epoch.
            assert (await h.heartbeat(b.node_id, beat.plan_epoch)).known is False
            code = await refused(h.step(b.node_id, 1, 0, beat.plan_epoch))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert h.rejected("unknown_node") == 2
            assert h.sample("swarm_nodes_alive") == 2
            alive = {n.node_name: n.alive for n in (await h.status()).nodes}
            assert alive == {"a": True, "b": False, "standby": True}
            # Leave releases at once; the next node to join that can link to stage 1's (dial-only)
            # host takes the freed stage: one with an open port, not another dial-only one.
            await h.stub.Leave(coordinator_pb2.LeaveRequest(node_id=a.node_id), timeout=RPC_TIMEOUT)
            assert (await h.heartbeat(a.node_id, beat.plan_epoch)).known is False
            dial_only = await h.join("dial-only", address="")
            assert list(dial_only.plan.stages) == [] and len((await h.status()).plan_problems) == 1
            late = await h.join("late", address="127.0.0.1:7003")
            assert list(late.plan.stages) == [0] and late.plan.epoch == (await h.status()).plan_epoch
            assert not (await h.status()).plan_problems

    run(scenario())


def test_a_held_heartbeat_answers_at_news_and_otherwise_at_the_end_of_its_hold(tmp_path):
    """Long poll: with nothing new for it, a heartbeat's reply waits out its hold; a new plan epoch
    or a cut request answers every held heartbeat at once (a hold of a minute each, here, is cut
    short within the test's few seconds); a node that knows of neither is answered at once."""

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", tiny_config(n_stages=2), dead_after_s=30) as h:
            a = await h.join("a", address="127.0.0.1:7001")
            b = await h.join("b", address="127.0.0.1:7002")
            epoch = (await h.status()).plan_epoch
            t0 = time.monotonic()
            quiet = await h.heartbeat(a.node_id, epoch, hold_ms=300)
            assert time.monotonic() - t0 >= 0.29 and not quiet.HasField("plan")
            stale = await asyncio.wait_for(h.heartbeat(a.node_id, 0, hold_ms=60_000), 5)  # at once
            assert stale.plan.epoch == epoch

            held = asyncio.gather(*(h.heartbeat(n.node_id, epoch, hold_ms=60_000) for n in (a, b)))
            await asyncio.sleep(0.3)
            h.service.planner.new_epoch("a test's new epoch")
            replies = await asyncio.wait_for(held, 5)
            assert all(r.plan_epoch == epoch + 1 and r.plan.epoch == epoch + 1 for r in replies)

            held = h.heartbeat(a.node_id, epoch + 1, hold_ms=60_000)
            cut = asyncio.get_running_loop().call_later(0.3, h.service.ledger.request_cut)
            reply = await asyncio.wait_for(held, 5)
            assert reply.cut_requests == 1 and not reply.HasField("plan")
            cut.cancel()

    run(scenario())


def test_step_reports_set_progress_and_loss(tmp_path):
    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", tiny_config(n_stages=2)) as h:
            a, b = await h.join("a"), await h.join("b")
            epoch = (await h.status()).plan_epoch
            assert epoch == b.plan.epoch
            for step in range(3):
                for node, stage in ((a, 0), (b, 1)):
                    loss = 4.0 - step if stage == 1 else None
                    await h.step(node.node_id, stage, step, epoch, loss)
            await h.step(a.node_id, 0, 3, epoch)
            status = await h.status()
            assert status.step == 2 and status.run_id == a.run_id and status.config_hash == a.config_hash
            assert status.steps_completed == 3 and [s.step for s in status.steps] == [0, 1, 2]
            assert [s.loss for s in status.steps] == [4.0, 3.0, 2.0]
            assert h.sample("swarm_loss") == 2.0
            code = await refused(h.step(a.node_id, 1, 3, epoch))  # a does not host stage 1
            assert code == grpc.StatusCode.ABORTED
            assert h.rejected("not_hosting") == 1
            assert (await h.status()).step == 2

    run(scenario())


def test_stale_epoch_reports_are_refused(tmp_path):
    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", tiny_config(n_stages=2)) as h:
            a, b = await h.join("a"), await h.join("b")
            old, epoch = a.plan.epoch, b.plan.epoch  # b's join started a new epoch
            assert old < epoch == (await h.status()).plan_epoch
            assert await refused(h.step(a.node_id, 0, 0, old)) == grpc.StatusCode.ABORTED
            assert h.rejected("stale_epoch") == 1
            await h.step(a.node_id, 0, 0, epoch)
            await h.step(b.node_id, 1, 0, epoch)
            assert (await h.status()).steps_completed == 1
            stat = torch.zeros(h.service.config.model.d_model, h.service.config.model.subspace_rank)
            ack = await h.report(statistic(b.node_id, 1, 0, stat, epoch=old))
            assert not ack.accepted and "stale" in ack.reason
            assert h.rejected("stale_epoch") == 2
            # A stale cut request is refused; a current one shows in every heartbeat.
            stale_cut = h.stub.RequestCut(coordinator_pb2.CutRequest(node_id=a.node_id, plan_epoch=old))
            assert await refused(stale_cut) == grpc.StatusCode.ABORTED
            assert (await h.heartbeat(b.node_id, epoch)).cut_requests == 0
            await h.stub.RequestCut(coordinator_pb2.CutRequest(node_id=a.node_id, plan_epoch=epoch))
            assert (await h.heartbeat(b.node_id, epoch)).cut_requests == 1
            # A failure of an old epoch is already handled: no new epoch.
            assert (await h.failure(b.node_id, old)).plan_epoch == epoch
            assert (await h.status()).plan_epoch == epoch
            # A failure of the current epoch starts the next; reports of the one before are then stale.
            assert (await h.failure(b.node_id, epoch)).plan_epoch == epoch + 1
            assert await refused(h.step(a.node_id, 0, 1, epoch)) == grpc.StatusCode.ABORTED
            assert h.rejected("stale_epoch") == 4
            beat = await h.heartbeat(a.node_id, epoch)
            assert beat.plan.epoch == epoch + 1 and list(beat.plan.stages) == [0]
            assert beat.plan.resume_step == 0  # no checkpoint cut: the run restarts from step 0
            status = await h.status()
            assert status.plan_epoch == epoch + 1 and status.epochs_restarted == 1
            await h.step(a.node_id, 0, 0, epoch + 1)

    run(scenario())


def test_dead_left_and_unknown_nodes_are_denied(tmp_path):
    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", tiny_config(n_stages=2), dead_after_s=0.3) as h:
            a, b, c = await h.join("a"), await h.join("b"), await h.join("c")
            await h.stub.Leave(coordinator_pb2.LeaveRequest(node_id=b.node_id), timeout=RPC_TIMEOUT)
            deadline = time.monotonic() + 5
            while {n.node_name for n in (await h.status()).nodes if n.alive} != {"a"}:
                assert time.monotonic() < deadline, "c was never declared dead"
                await h.heartbeat(a.node_id)  # a stays; c is silent
                await asyncio.sleep(0.05)
            epoch = (await h.status()).plan_epoch
            stat = torch.zeros(h.service.config.model.d_model, h.service.config.model.subspace_rank)
            blob = b"snapshot" * 100
            for node_id in (b.node_id, c.node_id, "nobody"):
                # b and c hold credentials but are out of the run; "nobody" has none
                label = "auth" if node_id == "nobody" else "unknown_node"
                code = (
                    grpc.StatusCode.UNAUTHENTICATED
                    if node_id == "nobody"
                    else grpc.StatusCode.PERMISSION_DENIED
                )
                before = h.rejected(label)
                assert (await h.heartbeat(node_id, epoch)).known is False
                record = coordinator_pb2.StageCheckpoint(stage=1, step=0, digest=digest(blob), size=len(blob))
                calls = [
                    h.step(node_id, 1, 0, epoch),
                    h.upload([upload_chunk(node_id, blob, 0, len(blob))]),
                    h.held(node_id, digest(blob)),
                    h.stub.ReportCheckpoint(
                        coordinator_pb2.CheckpointReport(
                            node_id=node_id, plan_epoch=epoch, checkpoint=record
                        ),
                        timeout=RPC_TIMEOUT,
                    ),
                    h.failure(node_id, epoch),
                    h.stub.RequestCut(coordinator_pb2.CutRequest(node_id=node_id, plan_epoch=epoch)),
                ]
                for call in calls:
                    assert await refused(call) == code
                ack = await h.report(statistic(node_id, 1, 1, stat, epoch=epoch))
                reason = "no valid session credential" if node_id == "nobody" else "not in the run"
                assert not ack.accepted and reason in ack.reason
                assert h.rejected(label) == before + (7 if node_id == "nobody" else 8)
                await h.heartbeat(a.node_id, epoch)  # a stays alive (0.3 s) however slow this machine is
            # Nothing of theirs was stored, and the plan did not move.
            assert not (await h.held(a.node_id, digest(blob))).held
            assert (await h.status()).plan_epoch == epoch and h.service.ledger.cut_requests == 0

    run(scenario())


def test_upload_resumes_from_held_and_rejects_bad_chunks(tmp_path):
    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", tiny_config(n_stages=2)) as h:
            node = (await h.join("a")).node_id
            blob = bytes(range(256)) * 20
            key = digest(blob)

            def chunk(offset: int, length: int) -> coordinator_pb2.ArtifactChunk:
                return upload_chunk(node, blob, offset, length)

            async def held() -> tuple[int, bool]:
                reply = await h.held(node, key)
                return reply.held, reply.complete

            assert await held() == (0, False)
            reply = await h.upload([chunk(0, 1000), chunk(1000, 1000)])
            assert (reply.held, reply.complete) == (2000, False)
            assert await held() == (2000, False)
            # A chunk that does not start where the stored part ends is refused; the part is kept.
            for offset in (0, 1000, 2001):
                code = await refused(h.upload([chunk(offset, 100)]))
                assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert h.rejected("bad_upload") == 3 and await held() == (2000, False)
            # Chunks before a bad one in the same upload are kept.
            code = await refused(h.upload([chunk(2000, 500), chunk(3000, 100)]))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and await held() == (2500, False)
            # One upload carries one artifact, and nothing past its declared size.
            other = upload_chunk(node, b"x" * 10, 0, 10)
            assert await refused(h.upload([chunk(2500, 100), other])) == grpc.StatusCode.FAILED_PRECONDITION
            past = coordinator_pb2.ArtifactChunk(
                node_id=node, offset=2600, data=blob[2600:], total_size=3000, digest=key
            )
            assert await refused(h.upload([past])) == grpc.StatusCode.FAILED_PRECONDITION
            assert await held() == (2600, False)
            # Resume where the coordinator's copy ends.
            start = (await h.held(node, key)).held
            rest = [chunk(offset, 1000) for offset in range(start, len(blob), 1000)]
            reply = await h.upload(rest)
            assert (reply.held, reply.complete) == (len(blob), True)
            assert await held() == (len(blob), True)
            assert await h.fetch(key) == blob
            assert (await h.upload([chunk(0, len(blob))])).complete  # already stored: nothing to do
            # Bytes that do not hash to the digest are discarded once complete.
            wrong = digest(b"something else")
            chunks = [
                upload_chunk(node, blob, offset, 2000, key=wrong) for offset in range(0, len(blob), 2000)
            ]
            code = await refused(h.upload(chunks))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            reply = await h.held(node, wrong)
            assert (reply.held, reply.complete) == (0, False)
            assert await refused(h.fetch(wrong)) == grpc.StatusCode.NOT_FOUND
            # A malformed digest.
            assert await refused(h.held(node, "not-a-digest")) == grpc.StatusCode.INVALID_ARGUMENT
            bad_key = upload_chunk(node, blob, 0, 10, key="not-a-digest")
            assert await refused(h.upload([bad_key])) == grpc.StatusCode.INVALID_ARGUMENT

    run(scenario())


def test_checkpoints_form_cuts_and_a_new_epoch_restores_from_the_latest(tmp_path):
    state = tmp_path / "state.sqlite"
    config = tiny_config(n_stages=2)

    async def first_life() -> tuple[str, str, int, list[coordinator_pb2.StageCheckpoint]]:
        async with coordinator(state, config) as h:
            a, b = await h.join("a"), await h.join("b")
            epoch = b.plan.epoch
            hosts = {0: a.node_id, 1: b.node_id}
            for step in range(7):
                for stage, node_id in hosts.items():
                    await h.step(node_id, stage, step, epoch)
            ack, first = await h.checkpoint(a.node_id, epoch, 0, 4)
            assert ack.latest_cut == 0  # stage 1 has no snapshot after step 4 yet
            ack, second = await h.checkpoint(b.node_id, epoch, 1, 4)
            assert ack.latest_cut == 5 and (await h.status()).latest_cut == 5
            assert h.sample("swarm_checkpoint_step") == 4
            # Refused: a snapshot that was never uploaded, a wrong size, a stage the node does not host.
            for record, code in [
                (
                    coordinator_pb2.StageCheckpoint(stage=0, step=9, digest=digest(b"never"), size=5),
                    grpc.StatusCode.INVALID_ARGUMENT,
                ),
                (
                    coordinator_pb2.StageCheckpoint(
                        stage=0, step=9, digest=first.digest, size=first.size + 1
                    ),
                    grpc.StatusCode.INVALID_ARGUMENT,
                ),
                (
                    coordinator_pb2.StageCheckpoint(stage=1, step=9, digest=first.digest, size=first.size),
                    grpc.StatusCode.ABORTED,
                ),
            ]:
                report = coordinator_pb2.CheckpointReport(
                    node_id=a.node_id, plan_epoch=epoch, checkpoint=record
                )
                assert await refused(h.stub.ReportCheckpoint(report, timeout=RPC_TIMEOUT)) == code
            assert (h.rejected("malformed"), h.rejected("not_hosting")) == (2, 1)
            # Stage 0 snapshots after step 6, then the boundary breaks before stage 1 does.
            ack, partial = await h.checkpoint(a.node_id, epoch, 0, 6)
            assert ack.latest_cut == 5
            assert (await h.failure(b.node_id, epoch)).plan_epoch == epoch + 1
            status = await h.status()
            assert (status.plan_epoch, status.resume_step, status.latest_cut) == (epoch + 1, 5, 5)
            assert status.epochs_restarted == 1
            restores = []
            for stage, node_id in hosts.items():
                beat = await h.heartbeat(node_id, epoch)
                assert beat.plan.epoch == epoch + 1 and beat.plan.resume_step == 5
                assert list(beat.plan.restore) == [(first, second)[stage]]
                restores.append(beat.plan.restore[0])
            for record in restores:
                assert digest(await h.fetch(record.digest)) == record.digest
            # The snapshot past the cut belongs to steps that will be redone: dropped with its artifact.
            assert await refused(h.fetch(partial.digest)) == grpc.StatusCode.NOT_FOUND
            assert (await h.held(a.node_id, partial.digest)).held == 0
            # A standby learns the resume step but restores nothing.
            standby = await h.join("standby")
            assert standby.plan.resume_step == 5 and not standby.plan.restore and not standby.plan.stages
            return a.node_id, b.node_id, epoch + 1, restores, h.credentials

    async def second_life(a: str, b: str, epoch: int, restores: list, credentials) -> None:
        # the nodes keep the sessions the first coordinator issued; the restarted one accepts them
        async with coordinator(state, config, credentials=credentials) as h:
            status = await h.status()
            assert (status.plan_epoch, status.resume_step, status.latest_cut) == (epoch, 5, 5)
            assert status.epochs_restarted == 1
            for stage, node_id in enumerate((a, b)):
                beat = await h.heartbeat(node_id)
                assert (
                    beat.known and beat.plan.epoch == epoch and list(beat.plan.restore) == [restores[stage]]
                )

    run(second_life(*run(first_life())))


def test_corrupt_snapshot_falls_back_to_the_previous_cut(tmp_path):
    state = tmp_path / "state.sqlite"

    async def scenario() -> None:
        async with coordinator(state, tiny_config(n_stages=2)) as h:
            a, b = await h.join("a"), await h.join("b")
            epoch = b.plan.epoch
            hosts = {0: a.node_id, 1: b.node_id}
            cuts = {
                step: [
                    (await h.checkpoint(node_id, epoch, stage, step))[1] for stage, node_id in hosts.items()
                ]
                for step in (1, 3)
            }
            assert (await h.status()).latest_cut == 4
            stored = state.with_name(state.name + ".artifacts") / f"{cuts[3][1].digest}.bin"
            assert stored.read_bytes() and digest(stored.read_bytes()) == cuts[3][1].digest
            stored.write_bytes(b"\0" + stored.read_bytes()[1:])  # bit rot in stage 1's newest snapshot
            assert (await h.failure(a.node_id, epoch)).plan_epoch == epoch + 1
            status = await h.status()
            assert (status.resume_step, status.latest_cut) == (2, 2)
            assert h.rejected("corrupt_snapshot") == 1
            for stage, node_id in hosts.items():
                beat = await h.heartbeat(node_id, epoch)
                assert beat.plan.resume_step == 2 and list(beat.plan.restore) == [cuts[1][stage]]
            assert not stored.exists()
            for record in cuts[3]:  # the whole broken cut is gone
                assert await refused(h.fetch(record.digest)) == grpc.StatusCode.NOT_FOUND
            # With every cut broken, the next epoch starts over from the initial weights.
            for record in cuts[1]:
                path = stored.with_name(f"{record.digest}.bin")
                path.write_bytes(path.read_bytes()[::-1])
            assert (await h.failure(a.node_id, epoch + 1)).plan_epoch == epoch + 2
            status = await h.status()
            assert (status.resume_step, status.latest_cut) == (0, 0)
            beat = await h.heartbeat(b.node_id, epoch + 1)
            assert beat.plan.resume_step == 0 and not beat.plan.restore and list(beat.plan.stages) == [1]
            assert h.rejected("corrupt_snapshot") == 3

    run(scenario())


def test_run_complete_stops_replanning(tmp_path):
    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", tiny_config(n_stages=2, steps=3)) as h:
            a, b = await h.join("a"), await h.join("b")
            epoch = b.plan.epoch
            for step in range(3):
                await h.step(a.node_id, 0, step, epoch)
                assert not (await h.status()).run_complete
                await h.step(b.node_id, 1, step, epoch)
            assert (await h.status()).run_complete
            beat = await h.heartbeat(a.node_id, epoch)
            assert beat.run_complete and not beat.HasField("plan")
            # Membership changes and failures no longer start epochs.
            assert (await h.failure(a.node_id, epoch)).plan_epoch == epoch
            await h.stub.Leave(coordinator_pb2.LeaveRequest(node_id=b.node_id), timeout=RPC_TIMEOUT)
            late = await h.join("late")
            assert late.run_complete and not late.plan.stages and late.plan.epoch == epoch
            assert (await h.status()).plan_epoch == epoch

    run(scenario())


def test_rotation_from_reports_matches_reference_and_streams(tmp_path):
    config = rotating_config(n_stages=4, interval=2)
    d, k = config.model.d_model, config.model.subspace_rank
    gen = torch.Generator().manual_seed(3)
    stats = [torch.randn(d, k, generator=gen, dtype=torch.float64) for _ in range(3)]

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", config) as h:
            nodes = [await h.join(f"n{i}") for i in range(4)]
            epoch = nodes[-1].plan.epoch
            watch = h.stub.WatchRotations(coordinator_pb2.WatchRotationsRequest(after_version=0))
            first = asyncio.ensure_future(watch.read())
            ack = await h.report(statistic(nodes[1].node_id, 1, 0, stats[0], epoch=epoch))
            assert not ack.accepted and "rotation step" in ack.reason  # step 0 is not (0 + 1) % 2 == 0
            bad = statistic(nodes[1].node_id, 1, 1, stats[0][:, :-1], epoch=epoch)
            assert not (await h.report(bad)).accepted
            wrong_host = await h.report(statistic(nodes[0].node_id, 1, 1, stats[0], epoch=epoch))
            assert not wrong_host.accepted
            # A statistic from an older epoch is not summed in (it would change the rotation).
            stale = await h.report(statistic(nodes[1].node_id, 1, 1, 100 * stats[0], epoch=epoch - 1))
            assert not stale.accepted
            for stage in (3, 1, 2):  # out of order: the sum must still run in boundary order
                ack = await h.report(statistic(nodes[stage].node_id, stage, 1, stats[stage - 1], epoch=epoch))
                assert ack.accepted, ack.reason
            rotation = rotation_from_proto(await asyncio.wait_for(first, 5))
            expected = next_rotation(initial_artifacts(config)[1], stats, 0, 2, config.rotation)
            assert (rotation.version, rotation.effective_step) == (1, 2)
            assert torch.equal(rotation.basis, expected.basis) and rotation.digest == expected.digest
            stale = await h.report(statistic(nodes[1].node_id, 1, 3, stats[0], epoch=epoch, version=0))
            assert not stale.accepted and "version" in stale.reason
            assert h.rejected("stale_version") == 1 and h.rejected("malformed") == 1
            assert h.rejected("not_hosting") == 1 and h.rejected("bad_step") == 1
            assert h.rejected("stale_epoch") == 1
            assert (await h.status()).subspace_version == 1
            assert (await h.heartbeat(nodes[0].node_id)).subspace_version == 1
            assert h.sample("swarm_subspace_version") == 1
            watch.cancel()

    run(scenario())


def test_an_epoch_resuming_before_a_rotation_withdraws_it_and_starts_a_new_lineage(tmp_path):
    """A rotation computed from steps an epoch discards is withdrawn: the watch streams end, the new
    plan names a new lineage, a node holding the old one is streamed everything anew, and the rerun's
    statistics make the rotation again (from what they are now); the lineage survives a restart."""
    config = rotating_config(n_stages=2, interval=1)
    state = tmp_path / "state.sqlite"
    d, k = config.model.d_model, config.model.subspace_rank
    first, rerun = (
        torch.randn(d, k, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    )

    async def first_life() -> tuple[int, dict[str, str]]:
        async with coordinator(state, config) as h:
            a, b = await h.join("a"), await h.join("b")
            epoch = b.plan.epoch
            assert b.plan.rotation_lineage == 0
            assert (await h.report(statistic(b.node_id, 1, 0, first, epoch=epoch))).accepted
            watch = h.stub.WatchRotations(coordinator_pb2.WatchRotationsRequest(after_version=0))
            held = await asyncio.wait_for(watch.read(), 5)
            assert (held.version, held.lineage) == (1, 0)
            # A boundary breaks before any cut: the next epoch resumes at step 0, before the rotation.
            await h.failure(a.node_id, epoch)
            plan = (await h.heartbeat(b.node_id, epoch)).plan
            assert plan.epoch > epoch and plan.resume_step == 0 and plan.rotation_lineage == plan.epoch
            assert await asyncio.wait_for(watch.read(), 5) is grpc.aio.EOF  # the stream ended
            assert h.service.rotation.version == 0 and h.sample("swarm_subspace_version") == 0
            # The node re-opens from what it holds (version 1, lineage 0): it gets the rerun's rotation.
            again = h.stub.WatchRotations(coordinator_pb2.WatchRotationsRequest(after_version=1, lineage=0))
            assert (await h.report(statistic(b.node_id, 1, 0, rerun, epoch=plan.epoch))).accepted
            remade = await asyncio.wait_for(again.read(), 5)
            expected = next_rotation(initial_artifacts(config)[1], [rerun], 0, 1, config.rotation)
            assert (remade.version, remade.lineage) == (1, plan.epoch)
            assert rotation_from_proto(remade).digest == expected.digest != rotation_from_proto(held).digest
            again.cancel()
            return plan.epoch, {a.node_id: a.session, b.node_id: b.session}

    async def second_life(lineage: int, sessions: dict[str, str]) -> None:
        credentials = NodeCredentials()
        credentials.sessions = sessions
        async with coordinator(state, config, credentials=credentials) as h:
            assert h.service.rotation.lineage == lineage and h.service.rotation.version == 1
            current = h.stub.WatchRotations(
                coordinator_pb2.WatchRotationsRequest(after_version=0, lineage=lineage)
            )
            assert (await asyncio.wait_for(current.read(), 5)).lineage == lineage
            current.cancel()

    run(second_life(*run(first_life())))


def test_restart_resumes_run_secret_nodes_and_rotations(tmp_path):
    config = rotating_config(n_stages=2, interval=1)
    state = tmp_path / "state.sqlite"
    stat = torch.randn(config.model.d_model, config.model.subspace_rank, dtype=torch.float64)

    async def first_life() -> tuple[coordinator_pb2.JoinReply, coordinator_pb2.JoinReply]:
        async with coordinator(state, config) as h:
            a, b = await h.join("a"), await h.join("b")
            assert (await h.report(statistic(b.node_id, 1, 0, stat, epoch=b.plan.epoch))).accepted
            # A watcher still open when the server stops: its stream ends cleanly.
            watch = h.stub.WatchRotations(coordinator_pb2.WatchRotationsRequest(after_version=0))
            assert (await watch.read()).version == 1
            await h.server.stop()
            assert await asyncio.wait_for(watch.read(), 5) is grpc.aio.EOF
        return a, b

    async def second_life(a: coordinator_pb2.JoinReply, b: coordinator_pb2.JoinReply) -> None:
        credentials = NodeCredentials()  # the nodes keep the sessions the first coordinator issued
        credentials.sessions = {a.node_id: a.session, b.node_id: b.session}
        async with coordinator(state, config, credentials=credentials) as h:
            assert h.service.run_id == a.run_id
            assert (await h.heartbeat(a.node_id)).known and (await h.heartbeat(b.node_id)).known
            late = await h.join("late")
            assert (late.run_id, late.subspace_version) == (a.run_id, 1)
            # The run's secret survives the restart: the epoch's boundary secret is unchanged.
            (link,) = (await h.heartbeat(b.node_id)).plan.links
            assert link.link_secret == b.plan.links[0].link_secret != ""
            assert list(late.plan.stages) == [] and late.plan.epoch == b.plan.epoch
            assert (await h.status()).plan_epoch == b.plan.epoch
            replay = h.stub.WatchRotations(coordinator_pb2.WatchRotationsRequest(after_version=0))
            rotation = rotation_from_proto(await asyncio.wait_for(replay.read(), 5))
            expected = next_rotation(initial_artifacts(config)[1], [stat], 0, 1, config.rotation)
            assert rotation.digest == expected.digest
            replay.cancel()
            # The next rotation starts from the resumed basis.
            report = statistic(b.node_id, 1, 1, stat, epoch=b.plan.epoch, version=1)
            assert (await h.report(report)).accepted
            assert h.service.rotation.version == 2

    a, b = run(first_life())
    run(second_life(a, b))


def test_other_config_on_same_state_file_is_an_error(tmp_path):
    state = tmp_path / "state.sqlite"
    CoordinatorService(tiny_config(), TOKEN, state, None, Metrics("coordinator"), []).state.close()
    with pytest.raises(ValueError, match="another --state file"):
        CoordinatorService(tiny_config(n_stages=2), TOKEN, state, None, Metrics("coordinator"), [])


# -- the CLI ----------------------------------------------------------------------------------


def read_line(proc: subprocess.Popen[str], timeout: float, log: Path) -> str:
    """The first stdout line of ``proc``, waiting at most ``timeout`` seconds (``log``: its stderr)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no output within {timeout}s; stderr:\n{log.read_text()[-2000:]}"
    return proc.stdout.readline()


def test_cli_serves_and_stops_on_sigterm(tmp_path):
    """No --config: the embedded default run."""
    command = [
        "-m",
        "swarm.coordinator.cli",
        "serve",
        "--no-dht",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--state",
    ]
    log = tmp_path / "stderr.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, *command, str(tmp_path / "state.sqlite")],
            cwd=ROOT,
            env={**os.environ, "SWARM_TOKEN": TOKEN},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        words = read_line(proc, 30, log).split()
        assert words[:3] == ["coordinator", "listening", "on"] and words[4] == "metrics=-1", words
        address, run_id = words[3], words[5].removeprefix("run=")
        with grpc.insecure_channel(address) as channel:
            status = coordinator_pb2_grpc.CoordinatorStub(channel).Status(
                coordinator_pb2.StatusRequest(), timeout=RPC_TIMEOUT
            )
        assert status.run_id == run_id
        assert status.config_hash == config_hash(RunConfig())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_node_ids_alone_grant_nothing(tmp_path):
    """An outsider reads every node id from the open Status RPC and calls as those nodes (the
    attack that once steered a run's rotation), and a member calls with its own credential but
    another node's id: every call is refused UNAUTHENTICATED, counted, and changes nothing."""
    config = rotating_config(n_stages=2, interval=2)

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", config) as h:
            a, b = await h.join("a"), await h.join("b")
            ids = [n.node_id for n in (await h.status()).nodes]
            assert sorted(ids) == sorted([a.node_id, b.node_id])  # Status shows them: not secrets
            epoch = (await h.status()).plan_epoch
            m = h.service.config.model
            stat = statistic(b.node_id, 1, 1, torch.ones(m.d_model, m.subspace_rank), epoch=epoch)
            impostor = session_metadata(a.node_id, a.session)  # a's own credential, naming b
            outsider = (("x-test", "outsider"),)  # metadata of its own: the harness adds no session
            for metadata in (outsider, impostor):
                kw = {"timeout": RPC_TIMEOUT, "metadata": metadata}
                calls = [
                    h.stub.Heartbeat(coordinator_pb2.HeartbeatRequest(node_id=b.node_id), **kw),
                    h.stub.Leave(coordinator_pb2.LeaveRequest(node_id=b.node_id), **kw),
                    h.stub.ReportStep(
                        coordinator_pb2.StepReport(node_id=b.node_id, stage=1, plan_epoch=epoch), **kw
                    ),
                    h.stub.RequestCut(coordinator_pb2.CutRequest(node_id=b.node_id, plan_epoch=epoch), **kw),
                    h.stub.ReportFailure(
                        coordinator_pb2.FailureReport(node_id=b.node_id, plan_epoch=epoch), **kw
                    ),
                ]
                for call in calls:
                    assert await refused(call) == grpc.StatusCode.UNAUTHENTICATED
                ack = await h.stub.ReportStatistics(stat, **kw)
                assert not ack.accepted and "session credential" in ack.reason
            kw = {"timeout": RPC_TIMEOUT, "metadata": outsider}
            watch = h.stub.WatchRotations(coordinator_pb2.WatchRotationsRequest(after_version=0), **kw)
            assert await refused(watch.read()) == grpc.StatusCode.UNAUTHENTICATED
            fetch = h.stub.FetchArtifact(coordinator_pb2.ArtifactRequest(digest=a.embedding_digest), **kw)
            assert await refused(fetch.read()) == grpc.StatusCode.UNAUTHENTICATED
            assert h.rejected("auth") == 2 * 6 + 2
            # Nothing moved: both nodes alive on the same epoch, no step, statistic or cut recorded.
            status = await h.status()
            assert status.plan_epoch == epoch and all(n.alive for n in status.nodes)
            assert not status.steps and h.service.ledger.cut_requests == 0
            assert h.service.state.statistics() == []
            # b itself, with its own credential, is heard.
            assert (await h.heartbeat(b.node_id, epoch)).known

    run(scenario())


def test_an_accused_neighbour_is_evicted_and_a_repeat_accuser_is_the_suspect(tmp_path):
    """A bad-input report evicts the planned neighbour it names (not a node elsewhere in the plan);
    a node that accuses a second neighbour after one was evicted is evicted itself."""

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", tiny_config(n_stages=3)) as h:
            # a and c only dial (the coordinator cannot probe them: not answering is no death)
            a, b, c = await h.join("a", address=""), await h.join("b"), await h.join("c", address="")
            d = await h.join("d")  # a standby

            def stages() -> dict[str, list[int]]:
                return {n.name: n.stages for n in h.service.roster.nodes.values() if n.alive}

            await h.accuse(c, a)  # c and a are not neighbours (stages 2 and 0): nobody is evicted
            assert stages() == {"a": [0], "b": [1], "c": [2], "d": []}
            await h.accuse(b, a)
            assert stages() == {"b": [1], "c": [2], "d": [0]}  # the standby took a's stage
            await h.accuse(b, d)  # b again, against its new neighbour: b is the suspect
            assert stages() == {"c": [2], "d": [0]}  # stage 1 waits for the next volunteer
            assert h.sample("swarm_evictions_total", {"reason": "bad_input"}) == 1
            assert h.sample("swarm_evictions_total", {"reason": "accuser"}) == 1

    run(scenario())


def test_a_rejoining_offender_with_its_own_token_is_the_same_party(tmp_path):
    """With personal join tokens, an evicted node that rejoins and is accused again by the same
    honest neighbour is the same party: the neighbour is believed, until the same pair comes up a
    third time (then nobody can tell who lies, and both go)."""

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", tiny_config(n_stages=2)) as h:
            honest_token, _ = h.service.gate.tokens.create("honest")
            offender_token, _ = h.service.gate.tokens.create("offender")
            honest = await h.join("honest", token=honest_token)

            async def offender_accused(name: str) -> None:
                offender = await h.join(name, token=offender_token)  # takes the free stage 1
                await h.accuse(honest, offender)

            def alive() -> set[str]:
                return {n.name for n in h.service.roster.nodes.values() if n.alive}

            await offender_accused("x1")
            await offender_accused("x2")
            assert alive() == {"honest"}  # believed twice: the same offender, not a second party
            await offender_accused("x3")
            assert alive() == set()
            assert h.sample("swarm_evictions_total", {"reason": "bad_input"}) == 3
            assert h.sample("swarm_evictions_total", {"reason": "accuser"}) == 1

    run(scenario())


def test_screen_flags_of_a_step_count_against_the_hosts_above_the_first_flagged_boundary(tmp_path):
    """Stages 1 and 2 both flag step 0 (a lie at stage 0 reaches both screens): once the step
    completes, the frames count against stage 0's host only, a suspect for SUSPECT_STEPS steps;
    flags never evict anyone."""
    config = tiny_config(n_stages=3)

    async def flagged(h: Harness, node_id: str, stage: int, step: int, epoch: int, frames: int) -> None:
        request = coordinator_pb2.StepReport(
            node_id=node_id, stage=stage, step=step, plan_epoch=epoch, drifted_frames=frames, drift="why"
        )
        await h.stub.ReportStep(request, timeout=RPC_TIMEOUT)

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", config) as h:
            a, b, c = [await h.join(name, address=f"127.0.0.1:{7001 + i}") for i, name in enumerate("abc")]
            epoch = c.plan.epoch
            await flagged(h, c.node_id, 2, 0, epoch, 3)
            await flagged(h, b.node_id, 1, 0, epoch, 2)
            assert h.service.screen.pending  # stage 0 has not reported step 0: not attributed yet
            await h.step(a.node_id, 0, 0, epoch)
            drifted = {n.node_name: n.drifted_frames for n in (await h.status()).nodes}
            assert drifted == {"a": 2, "b": 0, "c": 0} and not h.service.screen.pending
            assert h.sample("swarm_screen_drifted_frames_total", {"stage": "0"}) == 2
            assert all(n.alive for n in (await h.status()).nodes)
            # a suspect for a while: in runs with audits its siblings audit it at the raised rate
            assert h.service.screen.suspects(SUSPECT_STEPS) == [a.node_id]
            assert h.service.screen.suspects(SUSPECT_STEPS + 1) == []

    run(scenario())


def test_frame_commitments_of_senders_and_receivers_are_compared_and_a_disagreement_shown(tmp_path):
    """Microbatches 2: stage 0's host sends two activations, stage 1's receives them; a crossing
    is compared once both sides counted both frames, a receiver that got other bytes shows, and a
    crossing a failure touched (frame counts off) is dropped once overdue, not called a mismatch."""
    config = tiny_config(n_stages=2)

    def tally(sent: int, received: int, sent_frames: int, received_frames: int) -> coordinator_pb2.FrameTally:
        return coordinator_pb2.FrameTally(
            boundary=0,
            direction="forward",
            sent=sent.to_bytes(32, "big"),
            received=received.to_bytes(32, "big"),
            sent_frames=sent_frames,
            received_frames=received_frames,
        )

    async def report(h: Harness, node_id: str, stage: int, step: int, epoch: int, t) -> None:
        request = coordinator_pb2.StepReport(node_id=node_id, stage=stage, step=step, plan_epoch=epoch)
        request.tallies.append(t)
        await h.stub.ReportStep(request, timeout=RPC_TIMEOUT)

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", config) as h:
            a, b = [await h.join(name, address=f"127.0.0.1:{7001 + i}") for i, name in enumerate("ab")]
            epoch = b.plan.epoch
            assert config.train.microbatches == 2
            await report(h, a.node_id, 0, 0, epoch, tally(2**256 - 1, 0, 2, 0))  # sums wrap mod 2^256
            await report(h, b.node_id, 1, 0, epoch, tally(0, 2**256 - 1, 0, 2))
            status = await h.status()
            assert status.commitment_checks == 1 and not status.commitment_mismatches
            await report(h, a.node_id, 0, 1, epoch, tally(7, 0, 2, 0))
            await report(h, b.node_id, 1, 1, epoch, tally(0, 8, 0, 2))
            status = await h.status()
            assert status.commitment_checks == 2
            assert list(status.commitment_mismatches) == [
                "step 1, boundary 0 forward: the commitments of its 2 frames differ between their "
                "senders and their receivers"
            ]
            assert h.sample("swarm_commitment_mismatches_total", {"direction": "forward"}) == 1
            # a failure mid-step: a frame sent to a host that died unreported; the sender re-sent it
            await report(h, a.node_id, 0, 2, epoch, tally(9, 0, 3, 0))
            await report(h, b.node_id, 1, 2, epoch, tally(0, 5, 0, 2))
            for step in (3, 4):  # two more steps complete: step 2 is overdue, dropped unchecked
                await h.step(a.node_id, 0, step, epoch)
                await h.step(b.node_id, 1, step, epoch)
            status = await h.status()
            assert status.commitment_checks == 2 and len(status.commitment_mismatches) == 1
            assert h.service.commitments.unchecked == 1 and not h.service.commitments.pending

    run(scenario())
