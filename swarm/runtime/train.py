"""Training with the single-process pipeline: the engine of ``swarm train`` and of the benchmarks."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from swarm.core.config import RunConfig
from swarm.core.device import pick_device
from swarm.io import model_io
from swarm.io.data import BatchSampler, TokenDataset, ValidationBatches, batch_ids, load_dataset
from swarm.runtime.pipeline import LocalPipeline


@dataclass
class TrainSummary:
    config: dict
    device: str
    steps: int
    tokens: int
    seconds: float
    initial_val_loss: float
    final_val_loss: float
    losses: list[float] = field(default_factory=list)
    wire_bytes_per_token: float = 0.0
    dense_bytes_per_token: float = 0.0

    @property
    def compression(self) -> float:
        return self.dense_bytes_per_token / self.wire_bytes_per_token if self.wire_bytes_per_token else 1.0


@torch.no_grad()
def evaluate(pipe: LocalPipeline, dataset: TokenDataset, config: RunConfig, max_batches: int = 4) -> float:
    """Mean validation loss, through the same compressed boundaries as training."""
    batches = ValidationBatches(dataset.val, config.train.batch_size, config.train.seq_len, max_batches)
    losses = []
    for x, y in batches:
        source = batch_ids(x, y)
        for w in pipe.workers:
            source = w.forward(-1, -1, source, train=False)
        losses.append(source)
    return sum(losses) / len(losses)


def train(
    config: RunConfig,
    device: str = "auto",
    dataset: TokenDataset | None = None,
    progress: bool = True,
    out_dir: str | Path | None = None,
) -> TrainSummary:
    """Train ``config.train.steps`` steps on the run's corpus; with ``out_dir``, write ``summary.json``
    and the trained model to ``out_dir/model`` (the format a swarm's coordinator exports)."""
    dev = pick_device(device)
    torch.manual_seed(config.train.seed)
    dataset = dataset or load_dataset(config)
    sampler = BatchSampler(dataset.train, config.train.batch_size, config.train.seq_len, config.train.seed)
    pipe = LocalPipeline(config, device=dev)
    initial = evaluate(pipe, dataset, config)
    losses, tokens, wire, start = [], 0, 0, time.perf_counter()
    bar = tqdm(range(config.train.steps), disable=not progress, desc=config.codec.kind, unit="step")
    for step in bar:
        result = pipe.train_step(step, batch_ids(*sampler.next_batch()))
        losses.append(result.loss)
        tokens += result.tokens
        wire += result.wire_bytes_per_token * result.tokens
        rate = tokens / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{rate:.0f}", B_tok=f"{wire / tokens:.1f}")
    seconds = time.perf_counter() - start
    summary = TrainSummary(
        config=config.to_dict(),
        device=str(dev),
        steps=config.train.steps,
        tokens=tokens,
        seconds=seconds,
        initial_val_loss=initial,
        final_val_loss=evaluate(pipe, dataset, config),
        losses=losses,
        wire_bytes_per_token=wire / max(tokens, 1),
        dense_bytes_per_token=dense_bytes_per_token(config),
    )
    if out_dir is not None:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
        model_io.save(model_io.from_workers(pipe.workers, config.train.steps - 1), path / "model")
    return summary


def dense_bytes_per_token(config: RunConfig) -> float:
    """Uncompressed-equivalent traffic of one boundary: bf16 activations forward and back."""
    return 2 * 2 * config.model.d_model if config.n_stages > 1 else math.nan
