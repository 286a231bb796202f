"""Property-based: mutated requests thrown at every coordinator RPC handler of a live server.

Valid requests of every unary RPC are mutated (bytes flipped, cut, inserted; whatever still
parses as the request type is sent) and sent with no credential, a forged one, or a real
node's. Every answer must be a deliberate status (OK or a refusal): never UNKNOWN or INTERNAL,
the statuses of a handler that raised; and the server must still answer afterwards. The
default suite tries a few hundred requests; ``-m slow`` thousands.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from swarm.coordinator.service import CoordinatorServer, CoordinatorService

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm._proto.swarm.v1 import coordinator_pb2_grpc
from swarm.net.credentials import session_metadata
from swarm.net.frames import PROTOCOL_VERSION
from swarm.ops.metrics import Metrics
from tests.helpers import tiny_config

TOKEN = "fuzz-test-join-token"
DELIBERATE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
QUICK = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
THOROUGH = settings(max_examples=4000, deadline=None, suppress_health_check=list(HealthCheck))


class LiveCoordinator:
    """A coordinator serving on its own event loop thread, two nodes joined, a blocking stub."""

    def __init__(self, folder: Path):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        service = CoordinatorService(
            tiny_config(n_stages=2), TOKEN, folder / "s.sqlite", None, Metrics("coordinator"), []
        )
        self.server = CoordinatorServer(service)
        port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        join = cpb.JoinRequest(protocol_version=PROTOCOL_VERSION, token=TOKEN, max_stages=1)
        self.nodes = [self.stub.Join(join, timeout=10) for _ in range(2)]

    def close(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.server.stop(0.5), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[LiveCoordinator]:
    coordinator = LiveCoordinator(tmp_path_factory.mktemp("fuzz-handlers"))
    yield coordinator
    coordinator.close()


def seeds(live: LiveCoordinator) -> dict[str, object]:
    """One valid request per unary RPC, from the first node."""
    a = live.nodes[0]
    node, epoch = a.node_id, a.plan.epoch
    checkpoint = cpb.StageCheckpoint(
        stage=0, step=0, digest="ab" * 32, size=64, chunk_bytes=64, chunk_sha256=b"\1" * 32
    )
    return {
        "Join": cpb.JoinRequest(protocol_version=PROTOCOL_VERSION, token=TOKEN, node_name="x", max_stages=1),
        "Heartbeat": cpb.HeartbeatRequest(node_id=node, plan_epoch=epoch, step=3),
        "Leave": cpb.LeaveRequest(node_id=node, reason="fuzz"),
        "GetRunConfig": cpb.RunConfigRequest(),
        "ReportStatistics": cpb.StatisticsReport(
            node_id=node, stage=1, boundary=0, step=1, plan_epoch=epoch, gram_times_basis_f64_le=b"\0" * 64
        ),
        "ReportStep": cpb.StepReport(node_id=node, stage=0, step=0, plan_epoch=epoch, loss=1.0, tokens=8),
        "Status": cpb.StatusRequest(since_step=0),
        "ArtifactStatus": cpb.ArtifactRequest(digest=a.embedding_digest, node_id=node),
        "ReportCheckpoint": cpb.CheckpointReport(node_id=node, plan_epoch=epoch, checkpoint=checkpoint),
        "ReportFailure": cpb.FailureReport(
            node_id=node, plan_epoch=epoch, reason="fuzz", peer_node_id=live.nodes[1].node_id
        ),
        "RequestCut": cpb.CutRequest(node_id=node, plan_epoch=epoch),
    }


EDITS = st.lists(
    st.tuples(st.sampled_from(["flip", "cut", "insert"]), st.integers(0, 1 << 16), st.binary(max_size=8)),
    max_size=4,
)


def mutate(data: bytes, edits: list[tuple[str, int, bytes]]) -> bytes:
    out = bytearray(data)
    for kind, at, extra in edits:
        i = at % (len(out) + 1)
        if kind == "flip" and out:
            out[i % len(out)] ^= 1 + at % 255
        elif kind == "cut":
            del out[i : i + 1 + at % 8]
        else:
            out[i:i] = extra
    return bytes(out)


def check(live: LiveCoordinator, rpc: str, edits, credential: str) -> None:
    seed = seeds(live)[rpc]
    try:
        request = type(seed).FromString(mutate(seed.SerializeToString(), edits))
    except DecodeError:
        return  # the server would never see it as this request type
    node = live.nodes[0]
    metadata = {
        "none": (),
        "forged": session_metadata(node.node_id, "tok.99999999999.beef"),
        "real": session_metadata(node.node_id, node.session),
    }[credential]
    try:
        getattr(live.stub, rpc)(request, timeout=10, metadata=metadata)
    except grpc.RpcError as e:
        assert e.code() in DELIBERATE, (rpc, e.code(), e.details(), request)
    live.stub.Status(cpb.StatusRequest(), timeout=10)  # still serving


RPCS = st.sampled_from(
    [
        "Join",
        "Heartbeat",
        "Leave",
        "GetRunConfig",
        "ReportStatistics",
        "ReportStep",
        "Status",
        "ArtifactStatus",
        "ReportCheckpoint",
        "ReportFailure",
        "RequestCut",
    ]
)
CREDENTIALS = st.sampled_from(["none", "forged", "real"])


@QUICK
@given(rpc=RPCS, edits=EDITS, credential=CREDENTIALS)
def test_handlers_answer_mutated_requests_deliberately(live, rpc, edits, credential):
    check(live, rpc, edits, credential)


@pytest.mark.slow
@THOROUGH
@given(rpc=RPCS, edits=EDITS, credential=CREDENTIALS)
def test_handlers_answer_mutated_requests_deliberately_thoroughly(live, rpc, edits, credential):
    check(live, rpc, edits, credential)
