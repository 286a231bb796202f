"""Norm bounds on received boundary tensors: a finite but scaled-up frame is refused; honest
training, rotations and MAPL included, never trips them."""

from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch

from swarm.codecs.base import PayloadError
from swarm.core.config import MODEL_PRESETS, CodecConfig, DataConfig, RotationConfig, RunConfig, TrainConfig
from swarm.io.data import BatchSampler, batch_ids, load_dataset
from swarm.runtime.norm_guard import NormBound, NormGuard
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config


def test_guard_refuses_a_jump_after_warmup_and_forgets_nothing_it_refused():
    guard = NormGuard("test", NormBound(factor=100.0, window=8, warmup=4))
    guard.check(torch.full((4, 4), 1e6))  # warm-up: no history to compare with yet
    for _ in range(3):
        guard.check(torch.ones(4, 4))
    with pytest.raises(PayloadError, match=r"test RMS 1e\+03 exceeds 100 x the recent median"):
        guard.check(torch.full((4, 4), 1e3))
    assert len(guard.history) == 4  # the refused tensor is not remembered
    for scale in (2.0, 4.0, 8.0, 16.0):  # slow honest growth is accepted
        guard.check(torch.full((4, 4), scale))
    zeros = NormGuard("zeros", NormBound(warmup=1))
    zeros.check(torch.zeros(3))
    zeros.check(torch.ones(3))  # a zero median bounds nothing


def scaled(frame, factor: float = 1e4):
    """``frame`` with its bf16 coordinates multiplied by ``factor`` (still finite)."""
    values = torch.frombuffer(bytearray(frame.payload.data), dtype=torch.bfloat16) * factor
    data = values.view(torch.uint8).numpy().tobytes()
    return dataclasses.replace(frame, payload=dataclasses.replace(frame.payload, data=data))


def test_a_worker_refuses_scaled_activations_and_gradients():
    config = tiny_config(n_stages=2, forward_format="bf16", backward_format="bf16")
    pipe = LocalPipeline(config, norm_bound=NormBound(warmup=2), frames=True)
    for step in range(2):
        pipe.train_step(step, random_batch(config, seed=step))
    first, last = pipe.workers
    ids = random_batch(config, seed=5)[:2]
    for w in pipe.workers:
        w.begin_step(2)
    with pytest.raises(PayloadError, match="stage 1: received activations RMS"):
        last.forward(2, 0, scaled(first.forward(2, 0, ids)))
    last.forward(2, 1, first.forward(2, 1, ids))  # honest frames still pass
    with pytest.raises(PayloadError, match="stage 0: received gradients RMS"):
        first.backward(2, 1, scaled(last.backward(2, 1), 1e6))  # gradients: 10^4 x the median


@pytest.mark.parametrize(
    "codec",
    [
        CodecConfig(kind="subspace", forward_format="bf16", backward_format="bf16"),
        CodecConfig(kind="mapl", forward_format="rvq", backward_format="bf16", mapl_rank=16),
    ],
    ids=["subspace-rotating", "mapl-rvq"],
)
def test_honest_training_never_trips_the_default_bound(codec: CodecConfig):
    rank = 16 if codec.kind == "subspace" else 0
    config = dataclasses.replace(
        tiny_config(kind=codec.kind, rank=rank),
        codec=codec,
        rotation=RotationConfig(interval=10 if codec.kind == "subspace" else 0),
    )
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, lr=1e-2))
    pipe = LocalPipeline(config, norm_bound=NormBound())
    losses = [pipe.train_step(step, random_batch(config, seed=step % 4)).loss for step in range(80)]
    assert losses[-1] < losses[0]  # it learned the four batches; no frame was refused


def test_an_honest_outlier_microbatch_gradient_passes():
    """Regression: on the bundled data (byte tokens) one honest microbatch's gradient at step 33 is
    410x its neighbours' median; activations' 100x bound would have evicted an honest stage."""
    config = RunConfig(  # the run it was found in: the tiny preset and lr as they were then
        model=dataclasses.replace(MODEL_PRESETS["tiny"], parametrisation="standard"),
        train=TrainConfig(steps=40, batch_size=12, seq_len=64, microbatches=6, lr=3e-3),
        data=DataConfig(tokenizer="byte"),
        n_stages=2,
    )
    t = config.train
    sampler = BatchSampler(load_dataset(config).train, t.batch_size, t.seq_len, t.seed)
    pipe = LocalPipeline(config, norm_bound=NormBound())
    for step in range(34):
        pipe.train_step(step, batch_ids(*sampler.next_batch()))
    history = pipe.workers[0].gradient_guard.history
    assert max(history) > 100 * statistics.median(history)  # the outlier is in there, accepted
