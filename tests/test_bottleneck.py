"""The residual-bottleneck boundary (ResBM-like): k numbers per token cross, gradients exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.codecs.base import PayloadError
from swarm.core.config import CodecConfig, RunConfig
from swarm.runtime.pipeline import LocalPipeline
from swarm.runtime.wire import ActivationFrame
from tests.helpers import random_batch, tiny_config
from tests.test_pipeline import max_relative_error, pipeline_gradients, reference_gradients

K = 4


def bottleneck_config(n_stages: int = 4, fmt: str = "fp32", **train) -> RunConfig:
    config = tiny_config("identity", constrain=False, forward_format=fmt, backward_format=fmt, **train)
    model = dataclasses.replace(config.model, bottleneck_rank=K)
    return dataclasses.replace(config, model=model, n_stages=n_stages)


def test_bottlenecks_sit_at_the_stage_starts():
    assert bottleneck_config().model.bottleneck_layers == (1, 2, 3)
    assert bottleneck_config(n_stages=2).model.bottleneck_layers == (2,)
    with pytest.raises(ValueError, match="include the stage starts"):
        dataclasses.replace(bottleneck_config(n_stages=2), n_stages=4)
    with pytest.raises(ValueError, match="identity"):
        dataclasses.replace(bottleneck_config(), codec=CodecConfig(kind="subspace"))
    with pytest.raises(ValueError, match="unconstrained"):
        dataclasses.replace(tiny_config().model, bottleneck_rank=K)


def test_a_bottleneck_config_survives_toml(tmp_path):
    for config in (bottleneck_config(), tiny_config()):  # tuples, empty ones included, are TOML arrays
        path = tmp_path / "run.toml"
        path.write_text(config.to_toml())
        assert RunConfig.from_toml(path) == config


@pytest.mark.parametrize(
    ("dtype", "fmt", "tolerance"), [(torch.float32, "fp32", 1e-5), (torch.float64, "fp64", 1e-10)]
)
def test_bottleneck_pipeline_gradients_equal_the_whole_model(dtype, fmt, tolerance):
    """The whole model (every bottleneck inside one stage) against four stages over the wire."""
    config = bottleneck_config(fmt=fmt)
    ids = random_batch(config)
    ref_loss, ref = reference_gradients(config, ids, dtype)
    loss, got = pipeline_gradients(config, ids, dtype)
    assert abs(loss - ref_loss) / ref_loss < tolerance
    assert max_relative_error(got, ref) < tolerance
    assert any(name.startswith("bottleneck.") for name in got)


def test_frames_carry_k_numbers_per_token_and_malformed_ones_are_refused():
    config = bottleneck_config(fmt="bf16")
    pipe = LocalPipeline(config, frames=True)
    first, second = pipe.workers[:2]
    ids = random_batch(config)
    frame = first.forward(0, 0, ids[: config.train.batch_size // 2])
    assert isinstance(frame, ActivationFrame)
    tokens = frame.payload.rows
    assert frame.payload.cols == K
    assert len(frame.payload.data) == tokens * K * 2  # bf16
    bad = dataclasses.replace(frame, payload=dataclasses.replace(frame.payload, data=frame.payload.data[:-2]))
    with pytest.raises(PayloadError):
        second.forward(0, 0, bad)


def test_bottleneck_model_trains_and_is_split_free():
    """Training steps of the 4-stage bottleneck model equal those of the whole model in one stage."""
    config = bottleneck_config(fmt="fp64", warmup_steps=1)
    split = LocalPipeline(config, dtype=torch.float64)
    whole = LocalPipeline(dataclasses.replace(config, n_stages=1), dtype=torch.float64)
    for step in range(3):
        ids = random_batch(config, seed=step)
        assert split.train_step(step, ids).loss == pytest.approx(whole.train_step(step, ids).loss, rel=1e-9)
