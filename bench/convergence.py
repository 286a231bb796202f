"""Convergence at equal steps: every codec trains the same model on the same batches.

Same seed, data, step count and schedule; only the boundary codec (and, for the
subspace codecs, the constraint it needs) differ. Baselines are sized to match the
subspace codec's bytes per token where their format allows it.
"""

from __future__ import annotations

import dataclasses

from bench.codecs import CodecCase
from swarm.core.config import ModelConfig, RotationConfig, RunConfig, TrainConfig
from swarm.io.data import TokenDataset
from swarm.runtime.train import train


def run_case(
    case: CodecCase,
    model: ModelConfig,
    train_cfg: TrainConfig,
    n_stages: int,
    dataset: TokenDataset,
    interval: int,
) -> dict:
    config = RunConfig(
        model=dataclasses.replace(model, constrain_writes=case.constrained),
        codec=case.codec,
        rotation=RotationConfig(interval=interval if case.rotate else 0, max_angle=0.05),
        train=train_cfg,
        n_stages=n_stages,
    )
    s = train(config, device="cpu", dataset=dataset, progress=False)
    return {
        "codec": case.name,
        "initial_val_loss": s.initial_val_loss,
        "final_val_loss": s.final_val_loss,
        "final_train_loss_avg10": sum(s.losses[-10:]) / len(s.losses[-10:]),
        "wire_B_per_token": s.wire_bytes_per_token,
        "compression_vs_bf16": s.compression,
        "seconds": s.seconds,
        "losses": s.losses,
    }


def run(
    cases: list[CodecCase],
    model: ModelConfig,
    train_cfg: TrainConfig,
    n_stages: int,
    dataset: TokenDataset,
    rotation_interval: int,
) -> list[dict]:
    return [run_case(c, model, train_cfg, n_stages, dataset, rotation_interval) for c in cases]
