"""Training with the single-process pipeline: the engine of ``swarm train`` and of the benchmarks."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from swarm.codecs.base import PayloadError
from swarm.core.config import RunConfig, config_hash
from swarm.core.device import pick_device
from swarm.core.subspace import SubspaceRotation
from swarm.io import checkpoint, model_io
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
    resume: str | Path | None = None,
) -> TrainSummary:
    """Train ``config.train.steps`` steps on the run's corpus, evaluating on ``eval_batches``
    validation batches every ``train.eval_every`` steps; with ``out_dir``, write ``summary.json``
    and the trained model to ``out_dir/model`` (the format a swarm's coordinator exports).

    With ``resume``, the whole run's state is saved to that file at every evaluation and a run
    started with the file present continues from it, bit for bit as if never interrupted; the
    file is removed once the run completes."""
    dev = pick_device(device)
    torch.manual_seed(config.train.seed)
    dataset = dataset or load_dataset(config)
    sampler = dataset.sampler(config.train.batch_size, config.train.seq_len, config.train.seed)
    pipe = LocalPipeline(config, device=dev)
    progress_file = Path(resume) if resume is not None else None
    if progress_file is not None and progress_file.exists():
        record = _load_progress(progress_file, pipe, sampler, config)
    else:
        initial = evaluate(pipe, dataset, config, eval_batches)
        record = Progress(val_losses=[(0, initial)])
    start = time.perf_counter() - record.seconds
    every = config.train.eval_every
    losses, val_losses, off_subspace = record.losses, record.val_losses, record.off_subspace
    bar = tqdm(
        range(record.steps, config.train.steps),
        disable=not progress,
        desc=config.codec.kind,
        unit="step",
        initial=record.steps,
        total=config.train.steps,
    )
    tokens, wire, eval_seconds = record.tokens, record.wire, record.eval_seconds
    stats = [w.statistic for w in pipe.workers if w.statistic is not None]
    for stat, (off, total) in zip(stats, record.energies, strict=False):  # none at a start
        stat.lifetime_off, stat.lifetime_total = off, total
    energy = _energies(stats)  # the statistics' lifetime energies at the last evaluation
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
            fraction, energy = _off_subspace_since(stats, energy)
            if fraction is not None:
                off_subspace.append((done, fraction))
            if progress_file is not None and done < config.train.steps:
                elapsed = time.perf_counter() - start
                lifetime = [(st.lifetime_off, st.lifetime_total) for st in stats]
                kept = Progress(
                    done, losses, val_losses, off_subspace, tokens, wire, elapsed, eval_seconds, lifetime
                )
                _save_progress(progress_file, pipe, sampler, config, kept)
    seconds = time.perf_counter() - start - eval_seconds  # training only
    summary = TrainSummary(
        config=config.to_dict(),
        device=str(dev),
        steps=config.train.steps,
        tokens=tokens,
        seconds=seconds,
        initial_val_loss=val_losses[0][1],
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
    if progress_file is not None:
        progress_file.unlink(missing_ok=True)
    return summary


@dataclass
class Progress:
    """A run's bookkeeping after ``steps`` optimizer steps (what :func:`train` resumes with)."""

    steps: int = 0
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    off_subspace: list[tuple[int, float]] = field(default_factory=list)
    tokens: int = 0
    wire: float = 0.0
    seconds: float = 0.0  # wall time since the start, evaluations included
    eval_seconds: float = 0.0
    # each boundary statistic's lifetime (off, total) energies: the off-subspace fractions are
    # differences of them, so a resumed run continues the same sums (bit for bit)
    energies: list[tuple[float, float]] = field(default_factory=list)


def _save_progress(
    path: Path, pipe: LocalPipeline, sampler: checkpoint.Sampler, config: RunConfig, record: Progress
) -> None:
    """Every stage's state, pending rotations, the sampler and RNG, and ``record``, written atomically."""
    state = {
        "config": json.dumps(config.to_dict(), sort_keys=True, default=str),
        "record": asdict(record),
        "stages": [
            checkpoint.capture(w, record.steps - 1, sampler if w.is_first else None) for w in pipe.workers
        ],
        "rotations": [
            None
            if (r := w.pending_rotation) is None
            else {"version": r.version, "effective_step": r.effective_step, "basis": r.basis.cpu()}
            for w in pipe.workers
        ],
        "version": pipe.version,
        "rng": torch.get_rng_state(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    torch.save(state, partial)
    partial.replace(path)


def _load_progress(
    path: Path, pipe: LocalPipeline, sampler: checkpoint.Sampler, config: RunConfig
) -> Progress:
    """Load :func:`_save_progress`'s file into a freshly built pipeline; refuses another run's file."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not _same_run(json.loads(state["config"]), config):
        raise ValueError(
            f"{path} holds the progress of a different run; remove it to start afresh (a run on the "
            "embedded defaults resumes only under the release that wrote it: pass its --config)"
        )
    for worker, saved, rotation in zip(pipe.workers, state["stages"], state["rotations"], strict=True):
        # the same run (checked above); its configuration may have gained sections since
        saved["config_hash"] = config_hash(worker.config)
        try:
            checkpoint.restore(worker, saved, sampler if worker.is_first else None)
        except PayloadError as e:  # not the model's divergence: the file does not fit this run
            raise ValueError(f"{path} cannot be restored: {e}") from None
        if rotation is not None:
            worker.schedule_rotation(SubspaceRotation(**rotation))
    pipe.version = state["version"]
    torch.set_rng_state(state["rng"])
    record = state["record"]
    for name in ("val_losses", "off_subspace", "energies"):
        record[name] = [tuple(x) for x in record.get(name, [])]  # "energies": newer than some files
    return Progress(**record)


def _same_run(saved: dict, config: RunConfig) -> bool:
    """Whether a progress file's ``saved`` configuration is ``config``'s: a section or field the file
    lacks was added to the configuration since it was written and matches while it holds its default."""

    def plain(d: dict) -> dict:
        return json.loads(json.dumps(d, sort_keys=True, default=str))

    def matches(saved: dict, current: dict, default: dict) -> bool:
        for key, value in current.items():
            if key not in saved:
                if value != default.get(key):
                    return False
            elif isinstance(value, dict) and isinstance(saved[key], dict):
                if not matches(saved[key], value, default.get(key, {})):
                    return False
            elif saved[key] != value:
                return False
        return saved.keys() <= current.keys()

    return matches(saved, plain(config.to_dict()), plain(RunConfig().to_dict()))


def _energies(stats: list) -> tuple[float, float]:
    """The summed lifetime (off-subspace, total) energies of the boundary statistics."""
    return sum(s.lifetime_off for s in stats), sum(s.lifetime_total for s in stats)


def _off_subspace_since(stats: list, before: tuple[float, float]) -> tuple[float | None, tuple[float, float]]:
    """The off-subspace fraction of the boundary gradients ``stats`` saw since ``before`` (their
    lifetime energies then), and the energies now; None without a subspace codec (no stats)."""
    now = _energies(stats)
    off, total = now[0] - before[0], now[1] - before[1]
    return ((off / total) ** 0.5 if total > 0 else None), now


def dense_bytes_per_token(config: RunConfig) -> float:
    """Uncompressed-equivalent traffic of one boundary: bf16 activations forward and back."""
    return 2 * 2 * config.model.d_model if config.n_stages > 1 else math.nan
