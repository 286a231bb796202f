"""Codec overhead: encode + decode time per token against one stage's forward + backward.

Measured side by side in one process: for each codec, the time to encode and decode
one microbatch's activation and gradient frames (including zstd where configured)
next to the time of the stage's own forward and backward on the same microbatch.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from bench.codecs import CodecCase
from swarm.core.config import ModelConfig, RunConfig, TrainConfig
from swarm.runtime.pipeline import LocalPipeline


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_case(case: CodecCase, model: ModelConfig, train: TrainConfig, repeats: int = 3) -> dict:
    config = RunConfig(
        model=dataclasses.replace(model, constrain_writes=case.constrained),
        codec=case.codec,
        train=train,
        n_stages=2,
    )
    pipe = LocalPipeline(config, frames=True)
    sender, receiver = pipe.workers
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(
        0, model.vocab_size, (train.batch_size // train.microbatches, train.seq_len + 1), generator=gen
    )
    tokens = ids[:, :-1]
    codec = sender.outbound

    x = sender.stage(tokens)
    z = codec.map.project(x, tokens).detach()
    g = torch.randn_like(z) * 1e-3

    def codec_round_trip() -> None:
        frame = codec.encode_activation(z, ids, 0, 0, 0)
        receiver.inbound.decode_activation(frame, 0, torch.device("cpu"), torch.float32)
        gframe = receiver.inbound.encode_gradient(g, 0, 0, 0)
        codec.decode_gradient(gframe, 0, z.shape, torch.device("cpu"), torch.float32)

    def stage_fwd_bwd() -> None:
        out = sender.stage(tokens)
        out.backward(torch.ones_like(out) * 1e-3)
        sender.optimizer.zero_grad()

    n = tokens.numel()
    codec_s = _best_of(codec_round_trip, repeats)
    stage_s = _best_of(stage_fwd_bwd, repeats)
    return {
        "codec": case.name,
        "codec_us_per_token": 1e6 * codec_s / n,
        "stage_us_per_token": 1e6 * stage_s / n,
        "overhead_fraction": codec_s / stage_s,
        "stage_layers": sender.stage.end - sender.stage.start,
    }


def run(cases: list[CodecCase], model: ModelConfig, train: TrainConfig) -> list[dict]:
    return [run_case(c, model, train) for c in cases if not c.rotate]
