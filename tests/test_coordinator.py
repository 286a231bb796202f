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
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from coordinator.assignment import assign, links_for, take_stages
from coordinator.service import CoordinatorServer, CoordinatorService
from swarm._proto.swarm.v1 import coordinator_pb2, coordinator_pb2_grpc
from swarm.artifacts import CHUNK_BYTES, digest, matrix_to_bytes
from swarm.cli import DEFAULT_RUN
from swarm.config import RotationConfig, RunConfig, config_hash
from swarm.metrics import Metrics
from swarm.pipeline import initial_artifacts
from swarm.subspace import next_rotation
from swarm.transport.frames import PROTOCOL_VERSION, rotation_from_proto
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "join-secret"
PEERS = ["/ip4/127.0.0.1/tcp/4001/p2p/QmTestPeer"]
RPC_TIMEOUT = 5.0
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

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.service.metrics.registry.get_sample_value(name, labels or {})

    def rejected(self, reason: str) -> float:
        return self.sample("swarm_rejected_messages_total", {"reason": reason}) or 0.0

    async def join(
        self, name: str, max_stages: int = 1, address: str = "", token: str = TOKEN
    ) -> coordinator_pb2.JoinReply:
        request = coordinator_pb2.JoinRequest(
            protocol_version=PROTOCOL_VERSION,
            token=token,
            node_name=name,
            announce_address=address,
            max_stages=max_stages,
            device="cpu",
        )
        return await self.stub.Join(request, timeout=RPC_TIMEOUT)

    async def heartbeat(self, node_id: str) -> coordinator_pb2.HeartbeatReply:
        return await self.stub.Heartbeat(
            coordinator_pb2.HeartbeatRequest(node_id=node_id), timeout=RPC_TIMEOUT
        )

    async def report(self, request: coordinator_pb2.StatisticsReport) -> coordinator_pb2.StatisticsAck:
        return await self.stub.ReportStatistics(request, timeout=RPC_TIMEOUT)

    async def status(self) -> coordinator_pb2.StatusReply:
        return await self.stub.Status(coordinator_pb2.StatusRequest(), timeout=RPC_TIMEOUT)


@contextlib.asynccontextmanager
async def coordinator(
    state: Path, config: RunConfig | None = None, dead_after_s: float = 15.0
) -> AsyncIterator[Harness]:
    service = CoordinatorService(
        config or tiny_config(), TOKEN, state, None, Metrics("coordinator"), PEERS, dead_after_s=dead_after_s
    )
    async with CoordinatorServer(service) as server:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            yield Harness(service, server, coordinator_pb2_grpc.CoordinatorStub(channel))
        finally:
            await channel.close()


def statistic(
    node_id: str, stage: int, step: int, stat: torch.Tensor, version: int = 0
) -> coordinator_pb2.StatisticsReport:
    return coordinator_pb2.StatisticsReport(
        node_id=node_id,
        stage=stage,
        step=step,
        boundary=stage - 1,
        subspace_version=version,
        gram_times_basis_f64_le=stat.double().contiguous().numpy().astype("<f8").tobytes(),
    )


# -- pure functions ---------------------------------------------------------------------------


def test_take_stages_is_lowest_contiguous_free_run():
    assert take_stages([None] * 4, 2) == [0, 1]
    assert take_stages(["a", None, None, "b"], 3) == [1, 2]
    assert take_stages(["a", None, "b", None], 3) == [1]
    assert take_stages(["a", "b"], 1) == []
    assert take_stages([None, None], 0) == [0]  # max_stages 0 counts as 1
    assert assign([None, "a", None, None], [("s1", 1), ("s2", 5)]) == ["s1", "a", "s2", "s2"]


def test_dial_plan_rules():
    owners = ["a", "a", "b", "c"]
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
    assert links_for("a", ["a", "b"], {"a": "", "b": ""}) == [
        coordinator_pb2.BoundaryLink(boundary=0, local_stage=0, peer_node_id="b", role=UNSPECIFIED)
    ]
    # The other stage unassigned: the link is listed without a peer.
    assert links_for("a", ["a", None], addresses) == [
        coordinator_pb2.BoundaryLink(boundary=0, local_stage=0, role=UNSPECIFIED)
    ]
    assert links_for("d", owners, addresses) == []


# -- the service ------------------------------------------------------------------------------


def test_join_assigns_stages_in_order_then_standby(tmp_path):
    config = tiny_config(n_stages=4)

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", config) as h:
            a = await h.join("a", max_stages=2, address="127.0.0.1:7001")
            b = await h.join("b", max_stages=1, address="127.0.0.1:7002")
            c = await h.join("c", max_stages=3)
            d = await h.join("d", max_stages=1)
            assert [list(r.stages) for r in (a, b, c, d)] == [[0, 1], [2], [3], []]
            assert [r.plan_epoch for r in (a, b, c, d)] == [1, 2, 3, 3]
            assert len({a.node_id, b.node_id, c.node_id, d.node_id}) == 4
            # At a's join stage 2 had no host yet; a heartbeat brings the filled-in link.
            assert list(a.links) == [coordinator_pb2.BoundaryLink(boundary=1, local_stage=1)]
            assert list((await h.heartbeat(a.node_id)).links) == [
                coordinator_pb2.BoundaryLink(
                    boundary=1,
                    local_stage=1,
                    peer_node_id=b.node_id,
                    peer_address="127.0.0.1:7002",
                    role=DIAL,
                )
            ]
            assert RunConfig.from_dict(json.loads(a.config_json)) == config
            assert a.config_hash == config_hash(config) and a.run_id == h.service.run_id
            embedding = matrix_to_bytes(initial_artifacts(config)[0])
            assert (a.embedding_digest, a.embedding_size) == (digest(embedding), len(embedding))
            assert a.auth_token and a.auth_token == d.auth_token
            assert list(a.dht_initial_peers) == PEERS and a.heartbeat_interval_ms == 1000
            beat = await h.heartbeat(c.node_id)
            assert beat.known and beat.plan_epoch == 3 and list(beat.stages) == [3]
            assert [(link.boundary, link.role) for link in beat.links] == [(2, DIAL)]  # b is reachable, c not
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
            b = await h.join("b")
            standby = await h.join("standby")  # no inbound port: it will dial a
            assert list(standby.stages) == [] and not standby.links
            deadline = time.monotonic() + 5
            while True:  # a and the standby keep beating; b has gone silent
                await h.heartbeat(a.node_id)
                beat = await h.heartbeat(standby.node_id)
                if list(beat.stages) == [1]:
                    break
                assert time.monotonic() < deadline, "stage 1 was never reassigned"
                await asyncio.sleep(0.1)
            assert beat.plan_epoch > standby.plan_epoch
            assert list(beat.links) == [
                coordinator_pb2.BoundaryLink(
                    boundary=0,
                    local_stage=1,
                    peer_node_id=a.node_id,
                    peer_address="127.0.0.1:7001",
                    role=DIAL,
                )
            ]
            assert (await h.heartbeat(b.node_id)).known is False
            assert h.sample("swarm_nodes_alive") == 2
            alive = {n.node_name: n.alive for n in (await h.status()).nodes}
            assert alive == {"a": True, "b": False, "standby": True}
            # Leave releases at once; the next node to join takes the freed stage.
            await h.stub.Leave(coordinator_pb2.LeaveRequest(node_id=a.node_id), timeout=RPC_TIMEOUT)
            assert list((await h.join("late")).stages) == [0]

    run(scenario())


def test_step_reports_set_progress_and_loss(tmp_path):
    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", tiny_config(n_stages=2)) as h:
            a, b = await h.join("a"), await h.join("b")
            for step in range(3):
                for node, stage in ((a, 0), (b, 1)):
                    loss = 4.0 - step if stage == 1 else None
                    request = coordinator_pb2.StepReport(
                        node_id=node.node_id, stage=stage, step=step, loss=loss
                    )
                    await h.stub.ReportStep(request, timeout=RPC_TIMEOUT)
            await h.stub.ReportStep(
                coordinator_pb2.StepReport(node_id=a.node_id, stage=0, step=3), timeout=RPC_TIMEOUT
            )
            status = await h.status()
            assert status.step == 2 and status.run_id == a.run_id and status.config_hash == a.config_hash
            assert h.sample("swarm_loss") == 2.0
            with pytest.raises(grpc.aio.AioRpcError) as err:  # a does not host stage 1
                await h.stub.ReportStep(
                    coordinator_pb2.StepReport(node_id=a.node_id, stage=1, step=3), timeout=RPC_TIMEOUT
                )
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert h.rejected("not_hosting") == 1

    run(scenario())


def test_rotation_from_reports_matches_reference_and_streams(tmp_path):
    config = rotating_config(n_stages=4, interval=2)
    d, k = config.model.d_model, config.model.subspace_rank
    gen = torch.Generator().manual_seed(3)
    stats = [torch.randn(d, k, generator=gen, dtype=torch.float64) for _ in range(3)]

    async def scenario() -> None:
        async with coordinator(tmp_path / "state.sqlite", config) as h:
            nodes = [await h.join(f"n{i}") for i in range(4)]
            watch = h.stub.WatchRotations(coordinator_pb2.WatchRotationsRequest(after_version=0))
            first = asyncio.ensure_future(watch.read())
            ack = await h.report(statistic(nodes[1].node_id, 1, 0, stats[0]))
            assert not ack.accepted and "rotation step" in ack.reason  # step 0 is not (0 + 1) % 2 == 0
            bad = statistic(nodes[1].node_id, 1, 1, stats[0][:, :-1])
            assert not (await h.report(bad)).accepted
            wrong_host = await h.report(statistic(nodes[0].node_id, 1, 1, stats[0]))
            assert not wrong_host.accepted
            for stage in (3, 1, 2):  # out of order: the sum must still run in boundary order
                ack = await h.report(statistic(nodes[stage].node_id, stage, 1, stats[stage - 1]))
                assert ack.accepted, ack.reason
            rotation = rotation_from_proto(await asyncio.wait_for(first, 5))
            expected = next_rotation(initial_artifacts(config)[1], stats, 0, 2, config.rotation.max_angle)
            assert (rotation.version, rotation.effective_step) == (1, 2)
            assert torch.equal(rotation.basis, expected.basis) and rotation.digest == expected.digest
            stale = await h.report(statistic(nodes[1].node_id, 1, 3, stats[0], version=0))
            assert not stale.accepted and "version" in stale.reason
            assert h.rejected("stale_version") == 1 and h.rejected("malformed") == 1
            assert h.rejected("not_hosting") == 1 and h.rejected("bad_step") == 1
            assert (await h.status()).subspace_version == 1
            assert (await h.heartbeat(nodes[0].node_id)).subspace_version == 1
            assert h.sample("swarm_subspace_version") == 1
            watch.cancel()

    run(scenario())


def test_restart_resumes_run_secret_nodes_and_rotations(tmp_path):
    config = rotating_config(n_stages=2, interval=1)
    state = tmp_path / "state.sqlite"
    stat = torch.randn(config.model.d_model, config.model.subspace_rank, dtype=torch.float64)

    async def first_life() -> tuple[coordinator_pb2.JoinReply, coordinator_pb2.JoinReply]:
        async with coordinator(state, config) as h:
            a, b = await h.join("a"), await h.join("b")
            assert (await h.report(statistic(b.node_id, 1, 0, stat))).accepted
            # A watcher still open when the server stops: its stream ends cleanly.
            watch = h.stub.WatchRotations(coordinator_pb2.WatchRotationsRequest(after_version=0))
            assert (await watch.read()).version == 1
            await h.server.stop()
            assert await asyncio.wait_for(watch.read(), 5) is grpc.aio.EOF
        return a, b

    async def second_life(a: coordinator_pb2.JoinReply, b: coordinator_pb2.JoinReply) -> None:
        async with coordinator(state, config) as h:
            assert h.service.run_id == a.run_id
            assert (await h.heartbeat(a.node_id)).known and (await h.heartbeat(b.node_id)).known
            late = await h.join("late")
            assert (late.run_id, late.auth_token, late.subspace_version) == (a.run_id, a.auth_token, 1)
            assert list(late.stages) == [] and late.plan_epoch == b.plan_epoch
            replay = h.stub.WatchRotations(coordinator_pb2.WatchRotationsRequest(after_version=0))
            rotation = rotation_from_proto(await asyncio.wait_for(replay.read(), 5))
            expected = next_rotation(initial_artifacts(config)[1], [stat], 0, 1, config.rotation.max_angle)
            assert rotation.digest == expected.digest
            replay.cancel()
            # The next rotation starts from the resumed basis.
            assert (await h.report(statistic(b.node_id, 1, 1, stat, version=1))).accepted
            assert h.service.rotation.version == 2

    a, b = run(first_life())
    run(second_life(a, b))


def test_other_config_on_same_state_file_is_an_error(tmp_path):
    state = tmp_path / "state.sqlite"
    CoordinatorService(tiny_config(), TOKEN, state, None, Metrics("c"), []).state.close()
    with pytest.raises(ValueError, match="another --state file"):
        CoordinatorService(tiny_config(n_stages=2), TOKEN, state, None, Metrics("c"), [])


# -- the CLI ----------------------------------------------------------------------------------


def read_line(proc: subprocess.Popen[str], timeout: float, log: Path) -> str:
    """The first stdout line of ``proc``, waiting at most ``timeout`` seconds (``log``: its stderr)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no output within {timeout}s; stderr:\n{log.read_text()[-2000:]}"
    return proc.stdout.readline()


def test_cli_serves_and_stops_on_sigterm(tmp_path):
    """No --config: the embedded default run."""
    command = ["-m", "coordinator.cli", "serve", "--no-dht", "--port", "0", "--metrics-port", "-1", "--state"]
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
        assert status.config_hash == config_hash(RunConfig.from_dict(DEFAULT_RUN))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()
