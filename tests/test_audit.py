"""Verification's core: commitments bind payloads, the draw is keyed, an auditor recomputes a stage
exactly and flags every fault mode, honest bf16 nodes pass the cross-precision tolerance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.faults import Auditor, Recorder
from swarm.core.config import MODEL_PRESETS, CodecConfig, DataConfig, RunConfig, TrainConfig
from swarm.io.data import batch_ids, load_dataset
from swarm.runtime.audit import (
    TOLERANCES,
    compare,
    recompute,
)
from swarm.runtime.faults import MODES, Fault
from swarm.runtime.pipeline import LocalPipeline


def test_compare_scores_a_sign_flip_noise_nan_and_a_wrong_shape():
    x = torch.randn(4, 8, 16)
    assert compare(x, x).rel_l2 == 0 and compare(x, x).cosine == pytest.approx(1)
    flipped = compare(x, -x)
    assert flipped.rel_l2 == pytest.approx(2) and flipped.cosine == pytest.approx(-1)
    nan = x.clone()
    nan[0, 0, 0] = float("nan")
    assert compare(x, nan).rel_l2 == float("inf") and compare(x, x[:2]).rel_l2 == float("inf")


def pipeline(precision: str = "fp32") -> tuple[RunConfig, LocalPipeline]:
    config = RunConfig(
        model=dataclasses.replace(MODEL_PRESETS["tiny"]),
        train=TrainConfig(
            batch_size=4, seq_len=16, microbatches=2, lr=1e-2, warmup_steps=1, precision=precision
        ),
        codec=CodecConfig(kind="subspace"),
        data=DataConfig(tokenizer="byte"),
        n_stages=3,
    )
    return config, LocalPipeline(config)


def audited_steps(config: RunConfig, pipe: LocalPipeline, mode: str | None, steps: int = 3) -> list[tuple]:
    """(step, comparison) of every microbatch of stage 1 (a middle one), lying in ``mode``."""
    t = config.train
    sampler = load_dataset(config).sampler(t.batch_size, t.seq_len, t.seed)
    worker = pipe.workers[1]
    auditor = Auditor(worker)
    fault = Fault(worker, mode) if mode else None
    recorder = Recorder(worker)
    out = []
    for step in range(steps):
        auditor.sync()
        pipe.train_step(step, batch_ids(*sampler.next_batch()))
        if fault:
            fault.stepped()
        out += [(step, auditor.check(*kept)) for kept in recorder.take()]
    return out


def test_an_auditor_recomputes_an_honest_stage_exactly_forward_and_backward():
    config, pipe = pipeline()
    assert all(c.rel_l2 == 0 for _, c in audited_steps(config, pipe, None))
    stage = pipe.workers[1].stage
    tokens = torch.randint(0, 256, (2, 16))
    x_in = torch.randn(2, 16, config.model.d_model, requires_grad=True)
    grad_out = torch.randn(2, 16, config.model.d_model)
    stage(tokens, x_in).backward(grad_out)
    out, grad_in = recompute(stage, tokens, x_in, grad_out)
    assert torch.equal(out, stage(tokens, x_in).detach()) and torch.equal(grad_in, x_in.grad)


@pytest.mark.parametrize("mode", MODES)
def test_every_fault_mode_is_flagged_on_every_audited_lie(mode):
    config, pipe = pipeline()
    tolerance = TOLERANCES[(False, "bf16")]  # the loosest tolerance still catches them
    checked = [c for step, c in audited_steps(config, pipe, mode) if step > 0]  # step 0: stale = current
    assert checked and all(not c.within(tolerance) for c in checked), [c.rel_l2 for c in checked]


def test_an_honest_bf16_node_passes_an_fp32_auditor():
    config, pipe = pipeline("bf16")
    checked = [c for _, c in audited_steps(config, pipe, None)]
    assert all(c.within(TOLERANCES[(False, "bf16")]) for c in checked)
    assert any(c.rel_l2 > 0 for c in checked)  # not the same arithmetic: the tolerance is needed


def _frames():
    from swarm.codecs.base import EncodedTensor
    from swarm.runtime.wire import ActivationFrame, GradientFrame

    payload = EncodedTensor("bf16", 2, 4, bytes(range(16)))
    activation = ActivationFrame(3, 0, 1, 1, 2, payload, b"\x01\x00\x02\x00\x03\x00")
    gradient = GradientFrame(3, 0, 1, payload)
    return activation, gradient


def test_a_frame_commitment_covers_every_byte_and_where_the_frame_belongs():
    from swarm.codecs.base import EncodedTensor
    from swarm.runtime.audit import frame_digest

    activation, gradient = _frames()
    base = frame_digest(1, activation)
    assert frame_digest(1, activation) == base != frame_digest(2, activation)  # another boundary
    assert frame_digest(1, gradient) != base  # another direction
    flipped = EncodedTensor("bf16", 2, 4, bytes([1]) + bytes(range(1, 16)))
    assert frame_digest(1, dataclasses.replace(activation, payload=flipped)) != base
    assert frame_digest(1, dataclasses.replace(activation, token_ids=b"\x01\x00\x02\x00\x03\x01")) != base
    assert frame_digest(1, dataclasses.replace(activation, microbatch=1)) != base


def test_the_tally_sums_in_any_order_and_forgets_steps_once_taken():
    from swarm.runtime.audit import CommitmentTally, frame_digest

    activation, gradient = _frames()
    other = dataclasses.replace(activation, microbatch=1)
    sender, receiver = CommitmentTally(), CommitmentTally()
    for frame in (activation, other):
        sender.record("sent", 1, frame)
    for frame in (other, activation):  # another order, as a second replica would see them
        receiver.record("received", 1, frame)
    receiver.record("sent", 1, gradient)
    (sent,) = sender.take(3)
    backward, forward = receiver.take(3)  # ordered by boundary, then direction
    assert sent.sent == forward.received == (frame_digest(1, activation) + frame_digest(1, other)) % 2**256
    assert (sent.sent_frames, forward.received_frames, backward.sent_frames) == (2, 2, 1)
    assert backward.direction == "backward" and backward.sent == frame_digest(1, gradient)
    sender.record("sent", 1, dataclasses.replace(activation, step=2))
    assert sender.take(4) == [] and sender.take(2) == []  # step 2 was dropped with step 4's take
