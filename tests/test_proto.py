"""The wire schema: generated stubs up to date, exact frame and rotation round trips, small framing."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf import descriptor_pb2

from swarm._proto.swarm.v1 import common_pb2, coordinator_pb2, stage_pb2, stage_pb2_grpc
from swarm.codecs.base import EncodedTensor, PayloadError
from swarm.codecs.floats import BFloat16Format
from swarm.core.subspace import SubspaceRotation, random_basis
from swarm.net.frames import (
    PROTOCOL_VERSION,
    frame_from_message,
    parse_message,
    rotation_from_proto,
    rotation_to_proto,
    serialized_overhead,
    to_message,
)
from swarm.runtime.wire import ActivationFrame, GradientFrame, compress, pack_tokens

ROOT = Path(__file__).resolve().parents[1]


def gen_proto(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarm.tools.gen_proto", *args], cwd=ROOT, capture_output=True, text=True
    )


def typical_activation(zstd: bool = False) -> ActivationFrame:
    """1024 tokens (8 x 128) of 40 bf16 coordinates, token ids as uint16."""
    batch, seq_len, width = 8, 128, 40
    payload = BFloat16Format().encode(
        torch.randn(batch * seq_len, width, generator=torch.Generator().manual_seed(0))
    )
    ids = pack_tokens(torch.randint(0, 32000, (batch, seq_len + 1)), 32000)
    if zstd:
        payload = EncodedTensor(payload.format, payload.rows, payload.cols, compress(payload.data, 3))
        ids = compress(ids, 3)
    return ActivationFrame(2**40 + 7, 3, 17, batch, seq_len, payload, ids, zstd)


def round_trip(frame: ActivationFrame | GradientFrame) -> ActivationFrame | GradientFrame:
    return frame_from_message(parse_message(to_message(frame).SerializeToString()))


# -- (a) generated stubs -------------------------------------------------------------------------


def test_committed_stubs_are_up_to_date() -> None:
    result = gen_proto("--check")
    assert result.returncode == 0, result.stderr


def test_generation_is_reproducible_from_a_copy(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    assert (
        gen_proto("--proto-dir", str(tmp_path / "proto"), "--out-dir", str(tmp_path / "out")).returncode == 0
    )
    for path in (ROOT / "swarm" / "_proto").rglob("*.py*"):
        if "__pycache__" not in path.parts:
            rel = path.relative_to(ROOT / "swarm" / "_proto")
            assert (tmp_path / "out" / rel).read_bytes() == path.read_bytes(), rel


def test_check_detects_a_modified_proto(tmp_path: Path) -> None:
    proto = tmp_path / "proto"
    shutil.copytree(ROOT / "proto", proto)
    common = proto / "swarm" / "v1" / "common.proto"
    text = common.read_text()
    assert "bool zstd = 8;" in text
    common.write_text(text.replace("bool zstd = 8;", "bool zstd = 8;\n  uint32 extra = 99;"))
    out = tmp_path / "out"
    assert gen_proto("--proto-dir", str(proto), "--out-dir", str(out)).returncode == 0
    result = gen_proto("--check", "--out-dir", str(out))
    assert result.returncode == 1
    assert "changed: swarm/v1/common_pb2.py" in result.stderr
    assert "changed: swarm/v1/common_pb2.pyi" in result.stderr
    assert "stage_pb2.py" not in result.stderr


def fields(message: type) -> dict[str, int]:
    """Field name -> number of a generated message class."""
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def reserved(message: type) -> set[int]:
    proto = descriptor_pb2.DescriptorProto()
    message.DESCRIPTOR.CopyToProto(proto)
    return {n for r in proto.reserved_range for n in range(r.start, r.end)}


def test_schema() -> None:
    assert PROTOCOL_VERSION == 2 == common_pb2.PROTOCOL_VERSION_CURRENT
    services = {s.name: [m.name for m in s.methods] for s in stage_pb2.DESCRIPTOR.services_by_name.values()}
    assert services == {"Stage": ["Exchange", "Ping", "FetchSnapshot", "FetchEvidence"]}
    coordinator = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]
    assert [m.name for m in coordinator.methods] == [
        "Join",
        "Heartbeat",
        "Leave",
        "GetRunConfig",
        "FetchArtifact",
        "WatchRotations",
        "ReportStatistics",
        "ReportStep",
        "Status",
        "UploadArtifact",
        "ArtifactStatus",
        "ReportCheckpoint",
        "ReportFailure",
        "RequestCut",
        "ReportAudit",
    ]
    methods = coordinator.methods_by_name
    upload = methods["UploadArtifact"]
    assert upload.client_streaming and not upload.server_streaming
    assert upload.input_type.name == "ArtifactChunk" and upload.output_type.name == "UploadReply"
    assert methods["ArtifactStatus"].input_type.name == "ArtifactRequest"
    body = stage_pb2.StageMessage.DESCRIPTOR.oneofs_by_name["body"]
    assert [f.name for f in body.fields] == ["hello", "activation", "gradient", "sync", "error"]


def test_plan_schema() -> None:
    """Plans and epochs (protocol 2): the plan moved into ``Plan``; its old JoinReply numbers stay retired."""
    assert fields(coordinator_pb2.Plan) == {
        "epoch": 1,
        "stages": 2,
        "links": 3,
        "resume_step": 4,
        "restore": 5,
        "replicas": 6,
        "upload_snapshots": 7,
        "rebuild": 8,
        "evidence_secret": 9,
        "rotation_lineage": 10,
    }
    assert fields(coordinator_pb2.StageReplica) == {
        "node_id": 1,
        "microbatches": 2,
        "averaging_address": 3,
        "address": 4,
    }
    join = fields(coordinator_pb2.JoinReply)
    assert join["plan"] == 14 and join["run_complete"] == 15
    assert not {"stages", "links", "plan_epoch"} & join.keys()
    assert reserved(coordinator_pb2.JoinReply) == {5, 9, 10, 12}
    beat = fields(coordinator_pb2.HeartbeatReply)
    assert (beat["plan"], beat["run_complete"], beat["cut_requests"]) == (6, 7, 8)
    assert not {"stages", "links"} & beat.keys() and reserved(coordinator_pb2.HeartbeatReply) == {3, 4}
    request = fields(coordinator_pb2.HeartbeatRequest)
    assert (request["phase"], request["plan_epoch"]) == (3, 4)
    assert (request["averaging_address"], request["capacity_tokens_per_second"]) == (7, 8)
    assert fields(coordinator_pb2.StepReport)["plan_epoch"] == 9
    assert fields(coordinator_pb2.StatisticsReport)["plan_epoch"] == 10
    assert fields(coordinator_pb2.ArtifactChunk)["node_id"] == 5
    assert fields(coordinator_pb2.ArtifactRequest)["node_id"] == 3
    assert fields(stage_pb2.Hello)["plan_epoch"] == 8
    assert fields(common_pb2.ActivationFrame)["cut"] == 9
    assert stage_pb2.ERROR_CODE_PLAN_EPOCH == 10
    phases = coordinator_pb2.NodePhase.keys()
    assert phases == [
        "NODE_PHASE_UNSPECIFIED",
        "NODE_PHASE_JOINING",
        "NODE_PHASE_FETCHING",
        "NODE_PHASE_LOADING",
        "NODE_PHASE_READY",
        "NODE_PHASE_TRAINING",
        "NODE_PHASE_WAITING",
        "NODE_PHASE_LEAVING",
    ]


# -- (b) frame round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("zstd", [False, True])
def test_activation_round_trip_is_exact(zstd: bool) -> None:
    frame = typical_activation(zstd)
    assert round_trip(frame) == frame


def test_cut_mark_round_trips() -> None:
    frame = dataclasses.replace(typical_activation(), cut=True)
    assert round_trip(frame) == frame and round_trip(frame).cut
    assert to_message(frame).activation.cut and not to_message(typical_activation()).activation.cut


def test_gradient_round_trip_is_exact() -> None:
    payload = EncodedTensor("int8_row", 2**20, 2**16, bytes(range(256)) * 3)
    for zstd in (False, True):
        frame = GradientFrame(2**64 - 1, 2**32 - 1, 2**32 - 1, payload, zstd)
        assert round_trip(frame) == frame


def test_empty_payload_rows_round_trip() -> None:
    frame = GradientFrame(0, 0, 0, EncodedTensor("fp32", 0, 5, b""))
    assert round_trip(frame) == frame


def test_frames_cross_a_grpc_stream() -> None:
    class Echo(stage_pb2_grpc.StageServicer):
        def Exchange(self, request_iterator, context):
            yield from request_iterator

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    stage_pb2_grpc.add_StageServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        frames = [typical_activation(), GradientFrame(5, 1, 17, EncodedTensor("bf16", 3, 2, b"\x01" * 12))]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            replies = stage_pb2_grpc.StageStub(channel).Exchange(
                iter([to_message(f) for f in frames]), timeout=10
            )
            assert [frame_from_message(m) for m in replies] == frames
    finally:
        server.stop(None)


# -- (c) framing overhead ------------------------------------------------------------------------


def test_framing_overhead_is_small() -> None:
    frame = typical_activation()
    overhead = serialized_overhead(frame)
    print(f"framing overhead: {overhead} bytes on {frame.nbytes} ({100 * overhead / frame.nbytes:.3f}%)")
    assert 0 < overhead < 64
    assert overhead < 0.01 * frame.payload.nbytes
    assert to_message(frame).ByteSize() == len(to_message(frame).SerializeToString())


# -- (d) malformed messages ----------------------------------------------------------------------


def test_truncated_bytes_raise_payload_error() -> None:
    data = to_message(typical_activation()).SerializeToString()
    for cut in (1, 10, len(data) // 2, len(data) - 1):
        with pytest.raises(PayloadError, match="malformed stage message"):
            parse_message(data[:cut])


def test_invalid_utf8_format_raises_payload_error() -> None:
    data = to_message(typical_activation()).SerializeToString()
    assert data.count(b"bf16") == 1
    with pytest.raises(PayloadError, match="malformed stage message"):
        parse_message(data.replace(b"bf16", b"\xff\xfe16"))


@pytest.mark.parametrize(
    "message, match",
    [
        (
            stage_pb2.StageMessage(activation=common_pb2.ActivationFrame(step=4, batch=1)),
            "activation.*no payload",
        ),
        (stage_pb2.StageMessage(gradient=common_pb2.GradientFrame(step=4)), "gradient.*no payload"),
        (stage_pb2.StageMessage(), "no frame .body: empty"),
        (stage_pb2.StageMessage(hello=stage_pb2.Hello(protocol_version=1)), "no frame .body: hello"),
        (
            stage_pb2.StageMessage(
                gradient=common_pb2.GradientFrame(payload=common_pb2.EncodedTensor(rows=1))
            ),
            "no tensor format",
        ),
        (
            stage_pb2.StageMessage(
                activation=common_pb2.ActivationFrame(payload=common_pb2.EncodedTensor(format="bf16", rows=4))
            ),
            "activation frame payload: shape 4x0",
        ),
    ],
)
def test_missing_fields_raise_payload_error(message: stage_pb2.StageMessage, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        frame_from_message(parse_message(message.SerializeToString()))


# -- (e) rotations -------------------------------------------------------------------------------


def test_rotation_round_trip() -> None:
    rotation = SubspaceRotation(3, 1200, random_basis(32, 8, seed=1))
    pb = rotation_to_proto(rotation)
    assert (pb.d, pb.k, len(pb.basis_f64_le)) == (32, 8, 32 * 8 * 8)
    back = rotation_from_proto(common_pb2.Rotation.FromString(pb.SerializeToString()))
    assert (back.version, back.effective_step, back.digest) == (3, 1200, rotation.digest)
    assert back.basis.dtype == torch.float64 and torch.equal(back.basis, rotation.basis)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"digest": "0" * 64}, "digest does not match"),
        ({"digest": ""}, "no digest"),
        ({"effective_step": 1201}, "digest does not match"),
        ({"k": 0}, "need 0 < k <= d"),
        ({"d": 7}, "need 0 < k <= d"),
        ({"d": 31}, "basis_f64_le for 31x8 must be 1984 bytes, got 2048"),
    ],
)
def test_bad_rotation_raises_payload_error(change: dict, match: str) -> None:
    pb = rotation_to_proto(SubspaceRotation(3, 1200, random_basis(32, 8, seed=1)))
    for name, value in change.items():
        setattr(pb, name, value)
    with pytest.raises(PayloadError, match=match):
        rotation_from_proto(pb)


def test_non_orthonormal_rotation_is_rejected_even_with_its_digest() -> None:
    rotation = SubspaceRotation(1, 10, 2 * random_basis(16, 4, seed=2))
    with pytest.raises(PayloadError, match="not orthonormal"):
        rotation_from_proto(rotation_to_proto(rotation))
