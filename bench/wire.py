"""Wire bytes per token per boundary, forward and backward, from real serialized stage messages.

Two settings:

* ``d=4096, k=40`` (the paper's): no model of that size fits these machines, so the
  coordinates are synthetic (Gaussian, bf16-representable) and only the formats'
  sizes and the protobuf framing are measured; zstd on synthetic floats is a lower
  bound of what it does on real activations.
* the model we train: a 2-stage pipeline of the benchmark model, a real forward and
  backward through the boundary, every frame serialized as the ``StageMessage`` that
  goes on the gRPC stream.

Per-step boundary state (MAPL gradient shares, RVQ codebook deltas) is reported
separately, amortised over the tokens of one step.
"""

from __future__ import annotations

import dataclasses

import torch

from bench.codecs import CodecCase, codec_cases
from swarm.codecs import make_format
from swarm.codecs.boundary import BoundaryCodec, IdentityMap
from swarm.core.config import ModelConfig, RunConfig, TrainConfig
from swarm.net.frames import to_message
from swarm.runtime.pipeline import LocalPipeline

PAPER_D, PAPER_K, PAPER_VOCAB = 4096, 40, 32000
PUBLIC_NODE_BYTES = 41 * 4  # the public Subspace Networks node: 40 float32 coordinates + the id as float32


def _width(case: CodecCase, d: int, k: int) -> int:
    return {"identity": d, "subspace": k, "mapl": case.codec.mapl_rank}[case.kind]


def synthetic_row(case: CodecCase, d: int, k: int, tokens: int, vocab: int) -> dict:
    """Serialized bytes/token of one activation and one gradient frame of ``tokens`` tokens."""
    width = _width(case, d, k)
    gen = torch.Generator().manual_seed(0)
    batch, seq = 4, tokens // 4
    codec = BoundaryCodec(
        IdentityMap(width),
        make_format(case.codec.forward_format, width, case.codec),
        make_format(case.codec.backward_format, width, case.codec),
        vocab,
        seq,
        case.codec.zstd_level,
    )
    z = torch.randn(batch, seq, width, generator=gen)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    fwd = codec.encode_activation(z, ids, 0, 0, 0)
    bwd = codec.encode_gradient(torch.randn(batch, seq, width, generator=gen) * 1e-3, 0, 0, 0)
    n = batch * seq
    return {
        "codec": case.name,
        "forward_B_per_token": to_message(fwd).ByteSize() / n,
        "backward_B_per_token": to_message(bwd).ByteSize() / n,
        "codec_accounted_B_per_token": (fwd.nbytes + bwd.nbytes) / n,
    }


def measured_row(case: CodecCase, model: ModelConfig, train: TrainConfig) -> dict:
    """Bytes/token of real frames of a 2-stage pipeline of ``model`` (one microbatch, one step)."""
    model = dataclasses.replace(model, constrain_writes=case.constrained)
    config = RunConfig(model=model, codec=case.codec, train=train, n_stages=2)
    pipe = LocalPipeline(config, frames=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(
        0, model.vocab_size, (train.batch_size // train.microbatches, train.seq_len + 1), generator=gen
    )
    sender, receiver = pipe.workers
    frame = sender.forward(0, 0, ids)
    receiver.forward(0, 0, frame)
    grad = receiver.backward(0, 0)
    sender.backward(0, 0, grad)
    n = ids[:, :-1].numel()
    step_tokens = train.batch_size * train.seq_len
    return {
        "codec": case.name,
        "forward_B_per_token": to_message(frame).ByteSize() / n,
        "backward_B_per_token": to_message(grad).ByteSize() / n,
        "codec_accounted_B_per_token": (frame.nbytes + grad.nbytes) / n,
        "sync_B_per_token": step_sync_bytes(config, gen) / step_tokens,
    }


def step_sync_bytes(config: RunConfig, gen: torch.Generator) -> float:
    """Boundary-state bytes one side sends in a training step (MAPL gradient share, RVQ delta),
    measured at the second step of a full batch: MAPL's anchor map starts at zero, so the first
    step's share has no anchor rows."""
    t, vocab = config.train, config.model.vocab_size
    pipe = LocalPipeline(config)
    pipe.train_step(0, torch.randint(0, vocab, (t.batch_size, t.seq_len + 1), generator=gen))
    pipe.forward_backward(1, torch.randint(0, vocab, (t.batch_size, t.seq_len + 1), generator=gen))
    sync = pipe.exchange_boundary_state() / 2  # each side sends its share once
    for w in pipe.workers:
        w.optimizer_step(1)
    return sync + pipe.ship_codebooks()


def run(model: ModelConfig, train: TrainConfig, tokens: int = 4096) -> dict:
    """Both tables, with the reference rows of the paper's setting."""
    k = model.subspace_rank
    paper_cases = codec_cases(PAPER_K, mapl_rank=PAPER_K, topk=PAPER_K, lowrank=PAPER_K // 2)
    model_cases = codec_cases(k, mapl_rank=k, topk=k // 2, lowrank=max(1, k * 2 // 3))
    paper = [synthetic_row(c, PAPER_D, PAPER_K, tokens, PAPER_VOCAB) for c in paper_cases if not c.rotate]
    dense = 2 * PAPER_D
    for row in paper:
        row["forward_ratio_vs_bf16"] = dense / row["forward_B_per_token"]
    measured = [measured_row(c, model, train) for c in model_cases if not c.rotate]
    for row in measured:
        row["forward_ratio_vs_bf16"] = 2 * model.d_model / row["forward_B_per_token"]
    return {
        "paper_setting": {"d": PAPER_D, "k": PAPER_K, "vocab": PAPER_VOCAB, "tokens_per_frame": tokens},
        "reference_rows": {
            "uncompressed bf16 (B/token forward)": dense,
            "public Subspace Networks node (B/token forward)": PUBLIC_NODE_BYTES,
        },
        "paper": paper,
        "model": {
            "config": dataclasses.asdict(model),
            "tokens_per_frame": train.batch_size // train.microbatches * train.seq_len,
        },
        "measured": measured,
    }
