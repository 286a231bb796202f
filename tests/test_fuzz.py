"""Property-based: random and mutated bytes thrown at every decoder that reads a peer's bytes.

Each decoder gets valid input mutated (bytes flipped, cut, inserted), structurally random
protobuf messages, or plain noise, and must either return a well-formed result (finite,
of the shape the configuration allows) or raise :class:`PayloadError`: never another
exception, never a hang (zstd bombs and huge declared sizes are refused before
allocation). The default suite tries a few hundred cases per decoder; ``-m slow`` many
thousands.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm._proto.swarm.v1 import common_pb2, stage_pb2
from swarm.codecs.base import PayloadError
from swarm.core.mapl import pack_gradients, unpack_gradients
from swarm.core.subspace import SubspaceRotation, random_basis
from swarm.net.frames import frame_from_message, parse_message, to_message
from swarm.runtime.pipeline import LocalPipeline
from swarm.runtime.wire import ActivationFrame
from tests.helpers import random_batch, tiny_config

# (kind, forward format, backward format, zstd level): every format a frame can carry.
CODECS = [
    ("identity", "bf16", "fp16", 0),
    ("identity", "int8_block", "int4_block", 0),
    ("identity", "topk", "lowrank", 0),
    ("subspace", "int8_row", "bf16", 3),
    ("subspace", "fp32", "fp64", 0),
    ("mapl", "rvq", "bf16", 0),
]
QUICK = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
THOROUGH = settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))


@functools.cache
def boundary(codec: tuple[str, str, str, int]):
    """A 2-stage tiny pipeline's sender and receiver, and valid activation and gradient messages."""
    kind, fwd, bwd, zstd = codec
    config = tiny_config(kind=kind, n_stages=2, forward_format=fwd, backward_format=bwd)
    config.codec.zstd_level = zstd
    sender, receiver = LocalPipeline(config, frames=True).workers
    sender.begin_step(0)
    receiver.begin_step(0)
    frame = sender.forward(0, 0, random_batch(config)[:2])
    receiver.forward(0, 0, frame)
    gradient = receiver.backward(0, 0)
    return sender, receiver, to_message(frame).SerializeToString(), to_message(gradient).SerializeToString()


def decode(codec, data: bytes) -> None:
    """What a receiving stage does with a message's bytes; checks whatever comes out."""
    sender, receiver, _, _ = boundary(codec)
    frame = frame_from_message(parse_message(data))
    if isinstance(frame, ActivationFrame):
        z, ids = receiver.inbound.decode_activation(frame, 0, "cpu", torch.float32)
        assert z.shape[:2] == ids[:, :-1].shape and z.shape[2] == receiver.inbound.map.width
    else:
        shape = (2, 16, sender.outbound.map.width)
        z = sender.outbound.decode_gradient(frame, 0, shape, "cpu", torch.float32)
        assert z.shape == shape
    assert torch.isfinite(z).all()


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (operation, position, byte) edits: flip a byte, cut the tail, or insert a byte."""
    out = bytearray(data)
    for op, pos, value in edits:
        if not out:
            break
        pos %= len(out)
        if op == 0:
            out[pos] ^= value or 1
        elif op == 1:
            del out[pos:]
        else:
            out.insert(pos, value)
    return bytes(out)


FORMATS = ["bf16", "fp16", "fp32", "fp64", "int8_row", "int8_block", "int4_block", "topk", "lowrank", "rvq"]
U32 = st.integers(0, (1 << 32) - 1) | st.integers(0, 64)  # every uint32 field; small values often
EDITS = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6)
MESSAGES = st.builds(
    lambda body, step, mb, version, fmt, rows, cols, data, batch, seq, ids, zstd: stage_pb2.StageMessage(
        **{
            body: dict(
                step=step,
                microbatch=mb,
                subspace_version=version,
                payload=common_pb2.EncodedTensor(format=fmt, rows=rows, cols=cols, data=data),
                zstd=zstd,
                **(dict(batch=batch, seq_len=seq, token_ids=ids) if body == "activation" else {}),
            )
        }
    ).SerializeToString(),
    st.sampled_from(["activation", "gradient"]),
    st.integers(0, 3),
    st.integers(0, 3),
    st.integers(0, 2),
    st.sampled_from(FORMATS) | st.text(max_size=8),
    U32,
    U32,
    st.binary(max_size=4096),
    U32,
    U32,
    st.binary(max_size=256),
    st.booleans(),
)


def frames_survive(codec, which: int, edits, random_message: bytes, noise: bytes) -> None:
    valid = boundary(codec)[2 + which]
    for data in (mutate(valid, edits), random_message, noise):
        with contextlib.suppress(PayloadError):
            decode(codec, data)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: "-".join(map(str, c)))
@QUICK
@given(st.integers(0, 1), EDITS, MESSAGES, st.binary(max_size=512))
def test_frame_decoders_only_raise_payload_errors(codec, which, edits, random_message, noise):
    frames_survive(codec, which, edits, random_message, noise)


@pytest.mark.slow
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: "-".join(map(str, c)))
@THOROUGH
@given(st.integers(0, 1), EDITS, MESSAGES, st.binary(max_size=512))
def test_frame_decoders_only_raise_payload_errors_thoroughly(codec, which, edits, random_message, noise):
    frames_survive(codec, which, edits, random_message, noise)


@functools.cache
def mapl_share():
    config = tiny_config(kind="mapl", n_stages=2)
    pipe = LocalPipeline(config)
    pipe.train_step(0, random_batch(config, seed=0))
    pipe.forward_backward(1, random_batch(config, seed=1))
    worker = pipe.workers[0]
    return worker.mapl["out"], pack_gradients(worker.boundary_gradients("out"))


def sync_messages_survive(edits, noise: bytes) -> None:
    mapl, share = mapl_share()
    rotation = SubspaceRotation(1, 10, random_basis(32, 8, 0)).to_bytes()
    for data in (mutate(share, edits), noise):
        try:
            grads = unpack_gradients(data, mapl)
            assert all(torch.isfinite(g).all() for g in grads.values())
        except PayloadError:
            pass
    for data in (mutate(rotation, edits), noise):
        try:
            rot = SubspaceRotation.from_bytes(data)
            assert torch.isfinite(rot.basis).all()
        except PayloadError:
            pass


@QUICK
@given(EDITS, st.binary(max_size=2048))
def test_sync_decoders_only_raise_payload_errors(edits, noise):
    sync_messages_survive(edits, noise)


@pytest.mark.slow
@THOROUGH
@given(EDITS, st.binary(max_size=2048))
def test_sync_decoders_only_raise_payload_errors_thoroughly(edits, noise):
    sync_messages_survive(edits, noise)
