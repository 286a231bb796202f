"""Shared builders for the tests: tiny configurations and deterministic token batches."""

from __future__ import annotations

import dataclasses

import torch

from swarm.core.config import CodecConfig, ModelConfig, RunConfig, TrainConfig


def tiny_config(
    kind: str = "subspace",
    rank: int = 8,
    n_stages: int = 4,
    constrain: bool = True,
    forward_format: str = "fp32",
    backward_format: str = "fp32",
    parametrisation: str = "standard",
    **train,
) -> RunConfig:
    """A 4-layer d=32 model small enough for exactness tests in fp64 (muP's base width: 16)."""
    model = ModelConfig(
        vocab_size=97,
        d_model=32,
        n_layers=4,
        n_heads=4,
        d_ff=64,
        max_seq_len=32,
        subspace_rank=rank,
        constrain_writes=constrain,
        parametrisation=parametrisation,
        base_width=16,
    )
    codec = CodecConfig(
        kind=kind, forward_format=forward_format, backward_format=backward_format, mapl_rank=8
    )
    train_cfg = dataclasses.replace(TrainConfig(batch_size=4, microbatches=2, seq_len=16, steps=100), **train)
    return RunConfig(model=model, codec=codec, train=train_cfg, n_stages=n_stages)


def random_batch(config: RunConfig, seed: int = 0) -> torch.Tensor:
    """``B x (T+1)`` token ids."""
    gen = torch.Generator().manual_seed(seed)
    t = config.train
    return torch.randint(0, config.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=gen)
