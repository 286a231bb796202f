"""Quality at high compression: how much sooner a swarm reaches dense quality on a slow link.

Every variant trains the same model on the same batches (seed, data, schedule) through the
single-process pipeline with its real codecs at every boundary, and records the validation
loss every ``eval_every`` steps. Dense bf16 is the reference: its validation loss at 25%, 50%
and 100% of its run are the targets. For each variant the section reports

* the loss at equal steps and its gap to dense at those points, and whether the gap shrinks,
  holds or grows along the run (what decides what a long run would show);
* the steps it needs to reach each target (interpolated between evaluations; ``None``: not
  reached in the run);
* its step time on a real local swarm (coordinator + node processes, netns + tbf where
  available, the transport's delay) on each link, measured side by side, and so its time to
  each target on that link = steps x step time;
* an analytic estimate of the same at paper size with measured H200 compute
  (:func:`paper_step_seconds`): the 2B, 8-stage model's step on that link if its boundaries
  shrink by the variant's measured ratio. A model, labelled as such, not a measurement.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import lr_search
from bench.throughput import Link, attempt, resolve_shaper
from swarm.codecs.base import PayloadError
from swarm.core.config import (
    CodecConfig,
    ModelConfig,
    RotationConfig,
    RunConfig,
    TrainConfig,
    stage_layer_ranges,
)
from swarm.core.profiles import ComputeProfile, load_profile
from swarm.io.data import TokenDataset
from swarm.runtime.train import TrainSummary, dense_bytes_per_token, train

TARGET_FRACTIONS = (0.25, 0.5, 1.0)  # dense's loss at these fractions of its run are the targets


@dataclass(frozen=True)
class Variant:
    """One line of the table: a model and codec, and the lever it pulls (empty: none)."""

    name: str
    model: ModelConfig
    codec: CodecConfig
    rotation: RotationConfig = field(default_factory=RotationConfig)
    lever: str = ""
    stiefel_optimizer: str = "sgd"

    def config(self, train_cfg: TrainConfig, n_stages: int) -> RunConfig:
        train_cfg = dataclasses.replace(train_cfg, stiefel_optimizer=self.stiefel_optimizer)
        return RunConfig(
            model=self.model, codec=self.codec, rotation=self.rotation, train=train_cfg, n_stages=n_stages
        )


@dataclass
class QualityPlan:
    model: ModelConfig
    train: TrainConfig  # steps: the length of every run; eval_every: its evaluation interval
    n_stages: int
    variants: list[str]  # names from :func:`variants`, dense first
    links: list[Link]
    eval_batches: int = 16
    timing_train: TrainConfig | None = None  # the swarm runs that measure step times (None: no timing)
    # tune: every variant at its own best lr (bench.lr_search's rule, from train.lr; variants whose
    # layers write at full rank from dense_lr when given), lrs one seed cannot rank with tie_seed too
    tune: bool = False
    dense_lr: float | None = None
    tie_seed: int | None = 1
    confirm_seeds: list[int] = field(default_factory=list)  # more seeds every tuned lr is run on
    shaper: str = "netns"
    paper_profile: str = "h200-2b-8layer-mb512"  # a bundled profile name or a JSON path


def parameter_count(m: ModelConfig) -> int:
    """Trainable parameters of the whole model (the fixed embedding and the basis are not trained)."""
    d = m.d_model
    total = m.vocab_size * (m.subspace_rank if m.constrained else d)  # embedding's trainable part
    for layer in range(m.n_layers):
        rows = m.write_rank(layer) or d
        total += 3 * d * d + rows * d + 2 * m.d_ff * d + rows * m.d_ff + 2 * d  # attn, mlp, norms
    return total + d + m.vocab_size * d  # final norm, head


def matched_d_ff(m: ModelConfig, target: int) -> int:
    """The FFN width (a multiple of 8) whose model has about ``target`` trainable parameters."""
    return min(
        range(8, 16 * m.d_ff, 8), key=lambda f: abs(parameter_count(dataclasses.replace(m, d_ff=f)) - target)
    )


GROW_INTERVAL = 100  # steps between growths of a growing rank
MAPL_PCA_STEPS = 20  # steps of boundary inputs whose principal directions restart MAPL's projections


def variants(model: ModelConfig, n_stages: int) -> list[Variant]:
    """The line-up: dense, the subspace method from ~8x to ~100x, the levers at ~60x, and MAPL,
    int8 and top-k near ~30x (ranks scale with ``d_model``, so a small model keeps the ratios)."""
    d = model.d_model

    def k(ratio: int) -> int:  # bf16 coordinates: 2k bytes per token and direction vs 2d dense
        return max(1, round(d / ratio))

    def sub(rank: int, **kw) -> ModelConfig:
        return dataclasses.replace(model, subspace_rank=rank, constrain_writes=True, **kw)

    def codec(kind: str, fwd: str = "bf16", bwd: str = "bf16", **kw) -> CodecConfig:
        return CodecConfig(kind=kind, forward_format=fwd, backward_format=bwd, **kw)

    def growing(lo: int, hi: int) -> Variant:
        step = max(1, (hi - lo) // 4)
        return Variant(
            f"subspace k={lo}->{hi} growing",
            sub(lo),
            codec("subspace"),
            RotationConfig(interval=GROW_INTERVAL, max_angle=0.0, grow_by=step, max_rank=hi),
            lever=f"rank grows by {step} every {GROW_INTERVAL} steps from {lo} to {hi}",
        )

    dense = dataclasses.replace(model, constrain_writes=False)
    k60 = k(64)
    last_start, _ = stage_layer_ranges(model.n_layers, n_stages)[-1]
    wide = sub(k60, d_ff=matched_d_ff(sub(k60), parameter_count(dense)))
    return [
        Variant("dense bf16", dense, codec("identity")),
        Variant(f"subspace k={k(8)}", sub(k(8)), codec("subspace")),
        Variant(f"subspace k={k(32)}", sub(k(32)), codec("subspace")),
        Variant(f"subspace k={k60}", sub(k60), codec("subspace")),
        Variant(f"subspace k={k(128)}", sub(k(128)), codec("subspace")),
        Variant(
            f"subspace k={k60} + full-rank last stage",
            sub(k60, full_rank_layers=model.n_layers - last_start),
            codec("subspace"),
            lever="last stage writes at full rank (exact)",
        ),
        Variant(
            f"subspace k={k60} + parameter-matched FFN",
            wide,
            codec("subspace"),
            lever=f"d_ff {model.d_ff} -> {wide.d_ff}",
        ),
        Variant(
            f"subspace k={k60}, bottleneck at boundaries only",
            dataclasses.replace(model, subspace_rank=k60, constrain_writes=False),
            codec("subspace"),
            lever="layers write at full rank; only a stage's output is projected onto E_fixed + col(U)",
        ),
        Variant(
            f"subspace k={k60} + rotation",
            sub(k60),
            codec("subspace"),
            RotationConfig(interval=25, max_angle=0.2),
            lever="Grassmann step every 25 steps, up to 0.2 rad",
        ),
        *(growing(lo, hi) for lo, hi in ((k(128), k60), (k60, k(32)))),
        Variant(f"subspace k={k(32)} int8/token", sub(k(32)), codec("subspace", "int8_row")),
        Variant(
            f"subspace k={k(21)} int4/block",
            sub(k(21)),
            codec("subspace", "int4_block", "int4_block"),
            lever="3x the rank of the bf16 variant at ~60x: coordinates and their gradients in 4 bits "
            "(one fp16 scale per 64 values)",
        ),
        Variant(f"MAPL r={k(32)}", dense, codec("mapl", mapl_rank=k(32), anchor_rank=k(32))),
        Variant(
            f"MAPL r={k(32)} + Riemannian Adam",
            dense,
            codec("mapl", mapl_rank=k(32), anchor_rank=k(32)),
            lever="projections stepped by Riemannian Adam instead of SGD",
            stiefel_optimizer="adam",
        ),
        Variant(
            f"MAPL r={k(32)}, Adam + PCA init",
            dense,
            codec("mapl", mapl_rank=k(32), anchor_rank=k(32), mapl_pca_steps=MAPL_PCA_STEPS),
            lever=f"Riemannian Adam; projections restart at the top principal directions of the "
            f"boundary inputs of the first {MAPL_PCA_STEPS} steps",
            stiefel_optimizer="adam",
        ),
        Variant("top-k (~30x)", dense, codec("identity", "topk", topk=max(1, d // 64))),
    ]


def _pick(available: list[Variant], names: list[str]) -> list[Variant]:
    by_name = {v.name: v for v in available}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown quality variants {unknown}; choose from {list(by_name)}")
    return [by_name[n] for n in names]


def steps_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """The (linearly interpolated) step at which a validation curve first reaches ``target``."""
    for (s0, l0), (s1, l1) in itertools.pairwise(curve):
        if l1 <= target:
            return s1 if l0 == l1 else s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return None


def loss_at(curve: list[tuple[int, float]], step: int) -> float:
    """The validation loss at the evaluation closest to ``step``."""
    return min(curve, key=lambda point: abs(point[0] - step))[1]


def gap_trend(gaps: list[float], tolerance: float = 0.01) -> str:
    """Whether a relative gap to dense shrinks, holds or grows between the run's middle and its end."""
    if len(gaps) < 2:
        return "n/a"
    change = gaps[-1] - gaps[len(gaps) // 2]
    return "shrinking" if change < -tolerance else "growing" if change > tolerance else "steady"


def paper_step_seconds(
    profile: ComputeProfile, bytes_per_token: float, link: Link, stages: int = 8, microbatches: int = 16
) -> float:
    """Analytic GPipe step of the 2B, 8-layer model (one layer per stage, ``profile.seq_len``-token
    microbatches): the pipeline runs ``M + P - 1`` slots of its slowest part (a stage's compute, or
    its busiest uplink moving one microbatch's activations and gradients), plus a round trip of
    the link's one-way delay per boundary."""
    tokens = profile.seq_len
    compute = sum(profile.stage_seconds(1, tokens))
    transfer = bytes_per_token * tokens * 8 / (link.mbps * 1e6) if link.mbps else 0.0
    return (microbatches + stages - 1) * max(compute, transfer) + 2 * (stages - 1) * link.one_way_ms / 1e3


def run(
    plan: QualityPlan,
    dataset: TokenDataset,
    cache: Path | None = None,
    progress: Callable[[str], None] = print,
) -> dict:
    """Every variant's curve, then its step times on the links, then the comparison with dense.

    ``cache``: a folder keeping each variant's curve under its configuration's hash, so an
    interrupted section (an hour on a CPU) resumes where it stopped and a changed variant reruns."""
    chosen = _pick(variants(plan.model, plan.n_stages), plan.variants)
    profile = load_profile(plan.paper_profile)
    measure = tuned_curve if plan.tune else curve
    runs = [(v, measure(v, plan, dataset, cache, progress)) for v in chosen]
    diverged = [row for _, row in runs if "diverged" in row]
    runs = [(v, row) for v, row in runs if "diverged" not in row]
    rows = [row for _, row in runs]
    if plan.timing_train is not None:
        shaper = resolve_shaper(plan.shaper)
        for v, row in runs:
            row["step_seconds"] = {}
            for link in plan.links:
                progress(f"quality: step time of {v.name} on {link.name}")
                timed = attempt(v.config(plan.timing_train, plan.n_stages), v.name, link, shaper)
                row["step_seconds"][link.name] = statistics.median(timed["step_seconds"])
                row["shaper"] = timed["shaper"]
    compare(rows, plan, profile)
    links = [dataclasses.asdict(x) for x in plan.links]
    out = {"rows": rows, "diverged": diverged, "links": links, "profile": profile.name}
    if plan.tune:
        out["tuning"] = {
            "factor": lr_search.LR_FACTOR,
            "seed_noise": lr_search.SEED_NOISE,
            "tie_seed": plan.tie_seed,
            "confirm_seeds": plan.confirm_seeds,
        }
    return out


def _changed(values: dict, defaults: dict) -> dict:
    """The entries of ``values`` that differ from ``defaults`` (nested dictionaries entry by entry)."""
    out = {}
    for name, value in values.items():
        default = defaults.get(name)
        if isinstance(value, dict) and isinstance(default, dict):
            value = _changed(value, default)
            if value:
                out[name] = value
        elif value != default:
            out[name] = value
    return out


# Defaults changed after curves were cached, at the values the cache's keys are relative to.
KEYED_DEFAULTS = {"model": {"subspace_rank": 32, "parametrisation": "standard"}, "train": {"lr": 3e-3}}


def key_defaults() -> dict:
    """The defaults cache keys are relative to: :class:`RunConfig`'s, the changed ones as they were."""
    defaults = RunConfig().to_dict()
    for section, values in KEYED_DEFAULTS.items():
        defaults[section] |= values
    return defaults


def run_key(config: RunConfig, eval_batches: int) -> str:
    """A curve's cache key: the run's settings that differ from :func:`key_defaults`.

    An option added later with a default that keeps the old behaviour leaves the keys of the
    curves measured before it, so adding a variant reruns only that variant; a default changed
    later goes into ``KEYED_DEFAULTS`` at its old value, so every cached curve keeps its key.
    """
    changed = _changed(config.to_dict(), key_defaults())
    text = json.dumps(changed, sort_keys=True, default=str)
    return hashlib.sha256(f"{text}/{eval_batches}".encode()).hexdigest()[:16]


def curve(
    v: Variant,
    plan: QualityPlan,
    dataset: TokenDataset,
    cache: Path | None,
    progress: Callable[[str], None],
    lr: float | None = None,
    seed: int | None = None,
) -> dict:
    """One variant's training run and validation curve (from ``cache`` when it holds this exact run;
    a run interrupted part way continues from its last evaluation, kept beside the cache entry).
    ``lr``, ``seed``: instead of the plan's."""
    train_cfg = dataclasses.replace(
        plan.train, lr=plan.train.lr if lr is None else lr, seed=plan.train.seed if seed is None else seed
    )
    config = v.config(train_cfg, plan.n_stages)
    key = run_key(config, plan.eval_batches)
    label = (
        v.name
        + (f" at lr {lr:.3g}" if lr is not None else "")
        + (f" seed {seed}" if seed not in (None, plan.train.seed) else "")
    )
    saved = cache / f"{key}.json" if cache is not None else None
    if saved is not None and saved.exists():
        progress(f"quality: {label} from {saved}")
        return json.loads(saved.read_text())
    progress(f"quality: training {label}")
    try:
        resume = saved.with_suffix(".progress.pt") if saved is not None else None
        s = train(config, "auto", dataset, False, eval_batches=plan.eval_batches, resume=resume)
    except PayloadError as e:  # non-finite values reached a boundary: the variant diverged
        row = {"variant": v.name, "lever": v.lever, "diverged": str(e)}
        if resume is not None:
            resume.unlink(missing_ok=True)  # the row is final: nothing to resume
    else:
        row = _trained_row(v, config, s)
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(row))
    return json.loads(json.dumps(row))  # the same types whether trained now or read back


def tuned_curve(
    v: Variant, plan: QualityPlan, dataset: TokenDataset, cache: Path | None, progress: Callable[[str], None]
) -> dict:
    """``v``'s row at its best lr by :func:`bench.lr_search.search` (the plan seed's curve), with
    ``lr``, ``lr_sweep`` (lr -> the score it was ranked on: a two-seed mean where one seed could
    not rank it) and ``seed_finals`` (seed -> final loss at that lr, every seed the sweep and
    ``plan.confirm_seeds`` ran).
    The sweep starts at ``plan.dense_lr`` for models whose layers write at full rank."""
    rows: dict[tuple[float, int], dict] = {}

    def loss(lr: float, seed: int) -> float:
        rows[lr, seed] = curve(v, plan, dataset, cache, progress, lr, seed)
        final = rows[lr, seed].get("final_val_loss", math.inf)
        return math.inf if math.isnan(final) else final  # NaN would read as "not run"

    full_rank = not v.model.constrained
    start = plan.dense_lr if full_rank and plan.dense_lr is not None else plan.train.lr
    best, scores = lr_search.search(loss, start, plan.train.seed, plan.tie_seed)
    for seed in plan.confirm_seeds:  # a gap of a point or two needs every variant on the same seeds
        if (best, seed) not in rows and math.isfinite(scores.get(best, math.inf)):
            loss(best, seed)
    sweep = {f"{lr:.3g}": score for lr, score in sorted(scores.items())}
    interior = lr_search.interior(best, scores)
    if not interior:
        progress(f"quality: {v.name}: no interior best lr ({sweep})")
    seeds = {str(seed): row.get("final_val_loss", math.inf) for (lr, seed), row in rows.items() if lr == best}
    tuned = {"lr": best, "lr_sweep": sweep, "lr_interior": interior, "seed_finals": seeds}
    return rows[best, plan.train.seed] | tuned


def _trained_row(v: Variant, config: RunConfig, s: TrainSummary) -> dict:
    return {
        "variant": v.name,
        "lever": v.lever,
        "parameters": parameter_count(v.model),
        "wire_B_per_token": s.wire_bytes_per_token,
        "compression_vs_dense_bf16": dense_bytes_per_token(config) / s.wire_bytes_per_token,
        "val_curve": s.val_losses,
        "off_subspace_curve": s.off_subspace,
        "final_val_loss": s.final_val_loss,
        "train_seconds": s.seconds,
    }


def compare(rows: list[dict], plan: QualityPlan, profile: ComputeProfile) -> None:
    """Add, to every row, its gaps to dense, steps and times to dense's targets (in place)."""
    dense = rows[0]
    steps = plan.train.steps
    targets = {f: loss_at(dense["val_curve"], round(f * steps)) for f in TARGET_FRACTIONS}
    dense_steps = {f: steps_to(dense["val_curve"], target) for f, target in targets.items()}
    dense_paper_bytes = 2 * 2 * 4096  # bf16 activations and gradients of the 2B model, per token
    for row in rows:
        curve = row["val_curve"]
        points = [s for s, _ in curve if s > 0]
        row["gap_vs_dense"] = {s: loss_at(curve, s) / loss_at(dense["val_curve"], s) - 1 for s in points}
        row["gap_trend"] = gap_trend(list(row["gap_vs_dense"].values()))
        paper_bytes = dense_paper_bytes / row["compression_vs_dense_bf16"]
        measured = row.get("step_seconds", {})
        step_seconds = {  # per link: (this machine's swarm, the analytic H200 step)
            link.name: (measured.get(link.name), paper_step_seconds(profile, paper_bytes, link))
            for link in plan.links
        }
        row["targets"] = {}
        for fraction, target in targets.items():
            reached = steps_to(curve, target)
            entry = {"loss": target, "steps": reached, "steps_vs_dense": None, "seconds": {}}
            if reached is not None and dense_steps[fraction]:
                entry["steps_vs_dense"] = reached / dense_steps[fraction]
            for link, (local, paper) in step_seconds.items():
                entry["seconds"][link] = {
                    "swarm": reached * local if reached is not None and local else None,
                    "paper_h200_estimate": reached * paper if reached is not None else None,
                }
            row["targets"][str(fraction)] = entry
    for row in rows:  # how much sooner than dense, per target, link and setting
        for fraction, entry in row["targets"].items():
            base = dense["targets"][fraction]["seconds"]
            entry["speedup_vs_dense"] = {
                link: {
                    setting: (base[link][setting] / t if t and base[link][setting] else None)
                    for setting, t in times.items()
                }
                for link, times in entry["seconds"].items()
            }
