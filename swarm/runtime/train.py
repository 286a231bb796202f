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
from swarm.io.data import TokenDataset, ValidationBatches, batch_ids, load_dataset
from swarm.io.prepared import PreparedDataset
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
    # (steps done, validation loss) every ``train.eval_every`` steps, from (0, initial) to the end
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    # (steps done, ||(I-P)G|| / ||G|| of the boundary gradients since the previous evaluation)
    off_subspace: list[tuple[int, float]] = field(default_factory=list)
    wire_bytes_per_token: float = 0.0
    dense_bytes_per_token: float = 0.0

    @property
    def compression(self) -> float:
        return self.dense_bytes_per_token / self.wire_bytes_per_token if self.wire_bytes_per_token else 1.0


@torch.no_grad()
def evaluate(
    pipe: LocalPipeline, dataset: TokenDataset | PreparedDataset, config: RunConfig, max_batches: int = 4
) -> float:
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
    dataset: TokenDataset | PreparedDataset | None = None,
    progress: bool = True,
    out_dir: str | Path | None = None,
    eval_batches: int = 4,
) -> TrainSummary:
    """Train ``config.train.steps`` steps on the run's corpus, evaluating on ``eval_batches``
    validation batches every ``train.eval_every`` steps; with ``out_dir``, write ``summary.json``
    and the trained model to ``out_dir/model`` (the format a swarm's coordinator exports)."""
    dev = pick_device(device)
    torch.manual_seed(config.train.seed)
    dataset = dataset or load_dataset(config)
    sampler = dataset.sampler(config.train.batch_size, config.train.seq_len, config.train.seed)
    pipe = LocalPipeline(config, device=dev)
    initial = evaluate(pipe, dataset, config, eval_batches)
    val_losses = [(0, initial)]
    losses, tokens, wire, start = [], 0, 0, time.perf_counter()
    every, eval_seconds = config.train.eval_every, 0.0
    off_subspace, energy = [], (0.0, 0.0)
    bar = tqdm(range(config.train.steps), disable=not progress, desc=config.codec.kind, unit="step")
    for step in bar:
        result = pipe.train_step(step, batch_ids(*sampler.next_batch()))
        losses.append(result.loss)
        tokens += result.tokens
        wire += result.wire_bytes_per_token * result.tokens
        rate = tokens / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{rate:.0f}", B_tok=f"{wire / tokens:.1f}")
        done = step + 1
        if done == config.train.steps or (every > 0 and done % every == 0):
            t0 = time.perf_counter()
            val_losses.append((done, evaluate(pipe, dataset, config, eval_batches)))
            eval_seconds += time.perf_counter() - t0
            fraction, energy = _off_subspace_since(pipe, energy)
            if fraction is not None:
                off_subspace.append((done, fraction))
    seconds = time.perf_counter() - start - eval_seconds  # training only
    summary = TrainSummary(
        config=config.to_dict(),
        device=str(dev),
        steps=config.train.steps,
        tokens=tokens,
        seconds=seconds,
        initial_val_loss=initial,
        final_val_loss=val_losses[-1][1],
        losses=losses,
        val_losses=val_losses,
        off_subspace=off_subspace,
        wire_bytes_per_token=wire / max(tokens, 1),
        dense_bytes_per_token=dense_bytes_per_token(config),
    )
    if out_dir is not None:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
        model_io.save(model_io.from_workers(pipe.workers, config.train.steps - 1), path / "model")
    return summary


def _off_subspace_since(
    pipe: LocalPipeline, before: tuple[float, float]
) -> tuple[float | None, tuple[float, float]]:
    """The off-subspace fraction of the boundary gradients since ``before`` (the lifetime energies
    then), and the energies now; None without a subspace codec."""
    stats = [w.statistic for w in pipe.workers if w.statistic is not None]
    now = (sum(s.lifetime_off for s in stats), sum(s.lifetime_total for s in stats))
    off, total = now[0] - before[0], now[1] - before[1]
    return ((off / total) ** 0.5 if total > 0 else None), now


def dense_bytes_per_token(config: RunConfig) -> float:
    """Uncompressed-equivalent traffic of one boundary: bf16 activations forward and back."""
    return 2 * 2 * config.model.d_model if config.n_stages > 1 else math.nan
