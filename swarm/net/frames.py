"""Conversions between the in-memory boundary frames and rotations and their protobuf messages.

The conversions are structural: a message coming in is checked for what the schema
cannot enforce (a required sub-message that is absent, a tensor without format or
shape), and everything wrong raises :class:`~swarm.codecs.base.PayloadError`. What the
bytes mean (shapes against the model, subspace versions, token ranges, zstd bounds) is
checked by :class:`~swarm.codecs.boundary.BoundaryCodec` when the frame is decoded.
Rotations are validated by :meth:`SubspaceRotation.from_bytes` itself (finiteness,
orthonormality), on the very byte layout :meth:`SubspaceRotation.to_bytes` produces.
"""

from __future__ import annotations

import struct

from google.protobuf.message import DecodeError

from swarm._proto.swarm.v1 import common_pb2, stage_pb2
from swarm.codecs.base import EncodedTensor, PayloadError, check_shape
from swarm.core.subspace import SubspaceRotation
from swarm.runtime.wire import ActivationFrame, GradientFrame

PROTOCOL_VERSION: int = common_pb2.PROTOCOL_VERSION_CURRENT

Frame = ActivationFrame | GradientFrame

# The header of SubspaceRotation.to_bytes: version, effective step, d, k (little-endian).
_ROTATION_HEADER = struct.Struct("<QQII")


def tensor_to_proto(tensor: EncodedTensor) -> common_pb2.EncodedTensor:
    return common_pb2.EncodedTensor(
        format=tensor.format, rows=tensor.rows, cols=tensor.cols, data=tensor.data
    )


def tensor_from_proto(pb: common_pb2.EncodedTensor, what: str) -> EncodedTensor:
    """The tensor of ``pb``; ``what`` names its frame in error messages."""
    if not pb.format:
        raise PayloadError(f"{what} payload has no tensor format")
    try:
        check_shape(pb.rows, pb.cols)
    except PayloadError as e:
        raise PayloadError(f"{what} payload: {e}") from None
    return EncodedTensor(pb.format, pb.rows, pb.cols, pb.data)


def activation_to_proto(frame: ActivationFrame) -> common_pb2.ActivationFrame:
    return common_pb2.ActivationFrame(
        step=frame.step,
        microbatch=frame.microbatch,
        subspace_version=frame.subspace_version,
        batch=frame.batch,
        seq_len=frame.seq_len,
        payload=tensor_to_proto(frame.payload),
        token_ids=frame.token_ids,
        zstd=frame.zstd,
        cut=frame.cut,
    )


def activation_from_proto(pb: common_pb2.ActivationFrame) -> ActivationFrame:
    if not pb.HasField("payload"):
        raise PayloadError(f"activation frame (step {pb.step}, microbatch {pb.microbatch}) has no payload")
    return ActivationFrame(
        step=pb.step,
        microbatch=pb.microbatch,
        subspace_version=pb.subspace_version,
        batch=pb.batch,
        seq_len=pb.seq_len,
        payload=tensor_from_proto(pb.payload, "activation frame"),
        token_ids=pb.token_ids,
        zstd=pb.zstd,
        cut=pb.cut,
    )


def gradient_to_proto(frame: GradientFrame) -> common_pb2.GradientFrame:
    return common_pb2.GradientFrame(
        step=frame.step,
        microbatch=frame.microbatch,
        subspace_version=frame.subspace_version,
        payload=tensor_to_proto(frame.payload),
        zstd=frame.zstd,
    )


def gradient_from_proto(pb: common_pb2.GradientFrame) -> GradientFrame:
    if not pb.HasField("payload"):
        raise PayloadError(f"gradient frame (step {pb.step}, microbatch {pb.microbatch}) has no payload")
    return GradientFrame(
        step=pb.step,
        microbatch=pb.microbatch,
        subspace_version=pb.subspace_version,
        payload=tensor_from_proto(pb.payload, "gradient frame"),
        zstd=pb.zstd,
    )


def to_message(frame: Frame) -> stage_pb2.StageMessage:
    """The boundary-stream message carrying ``frame``."""
    if isinstance(frame, ActivationFrame):
        return stage_pb2.StageMessage(activation=activation_to_proto(frame))
    return stage_pb2.StageMessage(gradient=gradient_to_proto(frame))


def frame_from_message(msg: stage_pb2.StageMessage) -> Frame:
    """The frame a boundary-stream message carries; :class:`PayloadError` if it carries none."""
    body = msg.WhichOneof("body")
    if body == "activation":
        return activation_from_proto(msg.activation)
    if body == "gradient":
        return gradient_from_proto(msg.gradient)
    raise PayloadError(f"stage message carries no frame (body: {body or 'empty'})")


def parse_message(data: bytes) -> stage_pb2.StageMessage:
    """Parse serialized ``StageMessage`` bytes; :class:`PayloadError` if they are not one."""
    try:
        return stage_pb2.StageMessage.FromString(data)
    except DecodeError as e:
        raise PayloadError(f"malformed stage message ({len(data)} bytes): {e}") from None


def serialized_overhead(frame: Frame) -> int:
    """Bytes the protobuf framing adds: serialized ``StageMessage`` size minus ``frame.nbytes``."""
    return to_message(frame).ByteSize() - frame.nbytes


def rotation_to_proto(rotation: SubspaceRotation) -> common_pb2.Rotation:
    d, k = rotation.basis.shape
    return common_pb2.Rotation(
        version=rotation.version,
        effective_step=rotation.effective_step,
        basis_f64_le=rotation.to_bytes()[_ROTATION_HEADER.size :],
        d=d,
        k=k,
        digest=rotation.digest,
    )


def rotation_from_proto(pb: common_pb2.Rotation) -> SubspaceRotation:
    """Rebuild and validate a rotation (size, finiteness, orthonormality, digest)."""
    if not 0 < pb.k <= pb.d:
        raise PayloadError(f"rotation basis shape {pb.d}x{pb.k}: need 0 < k <= d")
    size, expected = len(pb.basis_f64_le), 8 * pb.d * pb.k
    if size != expected:
        raise PayloadError(f"rotation basis_f64_le for {pb.d}x{pb.k} must be {expected} bytes, got {size}")
    if not pb.digest:
        raise PayloadError(f"rotation to version {pb.version} has no digest")
    header = _ROTATION_HEADER.pack(pb.version, pb.effective_step, pb.d, pb.k)
    rotation = SubspaceRotation.from_bytes(header + pb.basis_f64_le)
    if rotation.digest != pb.digest:
        raise PayloadError(f"rotation to version {pb.version}: digest does not match its contents")
    return rotation
