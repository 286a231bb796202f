"""Run configuration: one dataclass per concern, loadable from TOML, hashed for the wire.

The coordinator serves exactly this object to every node; its :func:`config_hash` is
what a node checks so that all stages run the same model, codec and schedule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from swarm.core.profiles import load_profile

Compression = Literal["none", "subspace", "mapl"]
PARAMETRISATIONS = ("standard", "mup", "mup-anchored")


@dataclass
class ModelConfig:
    """A LLaMA-style decoder.

    ``subspace_rank > 0`` turns on the Subspace Networks constraint: every matrix that
    writes to the residual stream has its rows in one shared ``k``-dimensional subspace,
    and the token embedding is a frozen full-rank part plus a trainable part in it.
    ``constrain_writes=False`` keeps the basis (for the subspace codec) but leaves the
    model dense: the ablation that shows what the constraint buys. ``full_rank_layers = n``
    frees the last ``n`` layers' writes (exact as long as they all sit in the last stage, whose
    output never crosses a boundary: :class:`RunConfig` checks it).
    """

    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 688
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # The embedded default run (this model in 4 stages) is `swarm plan`'s recommendation for its
    # width and stages at the plan's default link and profile: k, parametrisation and train.lr as
    # the scaling bench measured them at d=256 (tests/test_plan.py keeps them in step).
    subspace_rank: int = 8
    constrain_writes: bool = True
    full_rank_layers: int = 0
    # How init scales and learning rates follow the width (swarm.core.width): "standard", or
    # "mup", whose hyperparameters tuned at d_model = base_width carry over to other widths, or
    # "mup-anchored" (default): muP that is the standard model at base_width for constrained models too.
    parametrisation: str = "mup-anchored"
    base_width: int = 128
    # A residual bottleneck (ResBM-like) at each stage boundary: the stream leaving a stage is
    # ``(X - E_fixed[tok]) P`` (k = bottleneck_rank numbers per token), the next stage starts from
    # ``E_fixed[tok] + Z Q``; P and Q are trained with the model, whose layers stay full-width.
    # ``bottleneck_layers``: the layers the stream enters through one (RunConfig fills in its stage
    # starts). 0: none.
    bottleneck_rank: int = 0
    bottleneck_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.parametrisation not in PARAMETRISATIONS:
            raise ValueError(
                f"model.parametrisation={self.parametrisation!r} must be one of {PARAMETRISATIONS}"
            )
        if self.base_width < 1:
            raise ValueError(f"model.base_width={self.base_width} must be >= 1")
        self.bottleneck_layers = tuple(self.bottleneck_layers)
        if not 0 <= self.bottleneck_rank <= self.d_model:
            raise ValueError(
                f"model.bottleneck_rank={self.bottleneck_rank} must lie in [0, d_model={self.d_model}]"
            )
        if self.bottleneck_rank and self.constrained:
            raise ValueError("model.bottleneck_rank needs an unconstrained model (constrain_writes = false)")
        if any(not 0 < layer < self.n_layers for layer in self.bottleneck_layers):
            raise ValueError(
                f"model.bottleneck_layers={self.bottleneck_layers} must lie in (0, {self.n_layers})"
            )
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model={self.d_model} must split into {self.n_heads} heads of even size")
        if not 0 <= self.subspace_rank <= self.d_model:
            raise ValueError(f"subspace_rank={self.subspace_rank} must lie in [0, d_model={self.d_model}]")
        if not 0 <= self.full_rank_layers <= self.n_layers:
            raise ValueError(
                f"full_rank_layers={self.full_rank_layers} must lie in [0, n_layers={self.n_layers}]"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def boundary_width(self) -> int:
        """Numbers per token of the residual stream between stages: the bottleneck's rank, else d."""
        return self.bottleneck_rank or self.d_model

    @property
    def constrained(self) -> bool:
        """Whether residual writes are restricted to the subspace (else ``U`` only serves the codec)."""
        return self.subspace_rank > 0 and self.constrain_writes

    def write_rank(self, layer: int, rank: int | None = None) -> int:
        """The rank of layer ``layer``'s residual writes: ``k`` under the constraint, 0 (full) otherwise
        and for the last ``full_rank_layers`` layers, whose writes never cross a stage boundary.

        ``rank`` is the basis' current width when it has grown past ``subspace_rank``."""
        constrained = self.constrained and layer < self.n_layers - self.full_rank_layers
        return (rank or self.subspace_rank) if constrained else 0


MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(  # its own base width: mup-anchored is then the standard model, as it was measured
        vocab_size=512,
        d_model=64,
        n_layers=4,
        n_heads=4,
        d_ff=172,
        max_seq_len=64,
        subspace_rank=16,
        base_width=64,
    ),
    "small": ModelConfig(),
    "150m": ModelConfig(
        vocab_size=32000, d_model=1024, n_layers=12, n_heads=16, d_ff=2816, max_seq_len=1024, subspace_rank=64
    ),
    "2b-8layer": ModelConfig(
        vocab_size=32000, d_model=4096, n_layers=8, n_heads=32, d_ff=11008, max_seq_len=2048, subspace_rank=40
    ),
    "8b": ModelConfig(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        d_ff=14336,
        max_seq_len=4096,
        subspace_rank=40,
    ),
}


@dataclass
class CodecConfig:
    """What crosses each stage boundary, forward and backward.

    ``kind`` picks the boundary map (``identity`` full activations, ``subspace``
    coordinates in ``U``, ``mapl`` learned per-boundary projections, or one of the
    ablation baselines applied to full activations: ``topk``, ``int8_block``,
    ``int4_block``, ``lowrank``). ``forward_format`` / ``backward_format`` are the tensor
    formats of :mod:`swarm.codecs` for the matrix that crosses (``fp32``, ``bf16``,
    ``fp16``, ``int8_row``, ``rvq`` ...). ``zstd_level > 0`` adds an entropy stage.
    ``mapl_pca_steps = N > 0`` re-initialises each MAPL projection, after the first ``N``
    steps, to the top principal directions of the inputs its sender saw (0: random start only).
    """

    kind: str = "subspace"
    forward_format: str = "bf16"
    backward_format: str = "bf16"
    zstd_level: int = 0
    mapl_rank: int = 32
    anchor_rank: int = 16
    mapl_pca_steps: int = 0
    rvq_codebooks: int = 4
    rvq_codebook_size: int = 256
    topk: int = 40
    lowrank: int = 20

    def __post_init__(self) -> None:
        if self.mapl_pca_steps < 0:
            raise ValueError(f"codec.mapl_pca_steps={self.mapl_pca_steps} must be >= 0")
        if self.mapl_pca_steps and self.kind != "mapl":
            raise ValueError(f"codec.mapl_pca_steps needs codec kind 'mapl', not {self.kind!r}")


@dataclass
class RotationConfig:
    """Changes of the shared subspace ``U`` every ``interval`` steps (0: a static basis).

    Each change either turns ``U`` by one Grassmann step of at most ``max_angle`` radians or,
    while the rank is below ``max_rank`` and ``grow_by > 0``, grows it by ``grow_by`` columns
    toward the strongest off-subspace gradient directions (a rank that grows: the run starts at
    ``model.subspace_rank`` and its boundaries send more coordinates as it grows).
    """

    interval: int = 0
    max_angle: float = 0.05
    grow_by: int = 0
    max_rank: int = 0

    def __post_init__(self) -> None:
        if self.interval < 0 or self.grow_by < 0 or self.max_rank < 0:
            raise ValueError("rotation.interval, grow_by and max_rank must be >= 0")
        if self.max_rank and not self.grow_by:
            raise ValueError("rotation.max_rank needs rotation.grow_by > 0 (else the rank never grows)")
        if self.grow_by and not self.interval:
            raise ValueError("rotation.grow_by > 0 needs rotation.interval > 0 (growth happens at rotations)")

    def grows(self, rank: int) -> int:
        """How many columns the next change adds to a basis of ``rank`` columns (0: it turns)."""
        return min(self.grow_by, self.max_rank - rank) if self.grow_by and rank < self.max_rank else 0


@dataclass
class CheckpointConfig:
    """Stage snapshots: every stage snapshots after the same steps, so the snapshots form cuts.

    After step ``s`` with ``(s + 1) % interval == 0`` (and after the last step) each stage
    writes its snapshot and uploads it to the coordinator; a run that loses a node resumes
    from the latest cut every stage has uploaded. ``keep`` cuts are kept (on nodes and on
    the coordinator). ``interval = 0`` turns snapshots off: a lost node then restarts the
    run from step 0.

    ``lost_stage`` says what happens when no copy of a middle stage's snapshot is left at the
    newest cut: ``"rollback"`` (exact) resumes every stage from an older cut that has all of
    them, or step 0; ``"rebuild"`` (CheckFree, arXiv 2506.15461) resumes from the newest cut
    anyway, the lost stage's layers the mean of its two neighbours' and its optimizer fresh.
    """

    interval: int = 25
    keep: int = 3
    # "exact": snapshots restore bit for bit; "int8": Adam's moments travel in 8 bits (about half
    # the bytes; a restored stage then continues close to, not exactly as, the original).
    moments: str = "exact"
    lost_stage: str = "rollback"

    def __post_init__(self) -> None:
        if self.interval < 0 or self.keep < 1:
            raise ValueError(f"checkpoint interval {self.interval} must be >= 0 and keep {self.keep} >= 1")
        if self.moments not in ("exact", "int8"):
            raise ValueError(f"checkpoint.moments={self.moments!r} must be 'exact' or 'int8'")
        if self.lost_stage not in ("rollback", "rebuild"):
            raise ValueError(f"checkpoint.lost_stage={self.lost_stage!r} must be 'rollback' or 'rebuild'")

    def is_cut(self, step: int, steps: int) -> bool:
        """Whether every stage snapshots after ``step`` (of a run of ``steps`` steps)."""
        return self.interval > 0 and ((step + 1) % self.interval == 0 or step == steps - 1)


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 128
    microbatches: int = 2
    lr: float = 2e-3  # under muP, the base width's lr carried to every width (see ModelConfig.subspace_rank)
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    stiefel_lr: float = 0.01
    # MAPL projections' optimizer: "sgd" (StiefelSGD) or "adam" (StiefelAdam); both take stiefel_lr
    # as the per-entry step size (Adam's steps shrink below it when gradients disagree).
    stiefel_optimizer: str = "sgd"
    # The layers' matrices: "adamw", or "muon" (torch.optim.Muon, update RMS matched to AdamW's, so
    # the same lr); embeddings, head and norms always take AdamW.
    optimizer: str = "adamw"
    eval_every: int = 50
    seed: int = 0
    schedule: str = "gpipe"  # microbatch order per stage: "gpipe" or "1f1b" (PipeDream-flush)
    # Most nodes hosting one stage. Above 1, a node that finds every stage hosted joins the
    # slowest stage as a replica: the stage's microbatches are dealt among its replicas, which
    # average gradients (hivemind all-reduce) before every optimizer step, or take outer steps
    # (see ReplicaSyncConfig).
    replicas: int = 1
    # What the stages' layers compute in: "fp32", or "bf16" (autocast around fp32 master weights and
    # optimizer state; the basis, boundary maps and wire formats keep their own precision).
    precision: str = "fp32"
    # Compile each layer with torch.compile (inductor) on its first use: the first training step
    # and the first evaluation take the compile time (seconds to a minute), later ones run the
    # fused kernels. Same maths, rounding aside; emulated stages ignore it.
    compile: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"train.schedule={self.schedule!r} must be one of {SCHEDULES}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r} must be one of {PRECISIONS}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer={self.optimizer!r} must be one of {OPTIMIZERS}")
        if self.stiefel_optimizer not in STIEFEL_OPTIMIZERS:
            raise ValueError(
                f"train.stiefel_optimizer={self.stiefel_optimizer!r} must be one of {STIEFEL_OPTIMIZERS}"
            )


SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("fp32", "bf16")
STIEFEL_OPTIMIZERS = ("sgd", "adam")
OPTIMIZERS = ("adamw", "muon")


@dataclass
class EmulationConfig:
    """Benchmarks only: replace every stage's layers by waits from a compute profile
    (:mod:`swarm.runtime.emulation`; a bundled profile's name or a JSON path). Empty: real compute.
    ``slow_stage`` (-1: none) computes ``slowdown`` times as long as it does (the extra time is
    a wait, so replicas of it on one machine still add capacity): a bottleneck stage on demand."""

    profile: str = ""
    slow_stage: int = -1
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        if not self.slowdown >= 1.0:
            raise ValueError(f"emulation.slowdown={self.slowdown} must be >= 1")


@dataclass
class ReplicaSyncConfig:
    """How the replicas of a stage (``train.replicas > 1``) keep their weights identical.

    ``mode = "step"`` averages their gradients (float64) before every optimizer step. ``"outer"``
    is DiLoCo: each replica takes ``every`` optimizer steps on its own microbatches, then the
    replicas average the pseudo-gradient (their trainable weights at the last sync minus now),
    sent as ``format`` (``fp64``, ``fp32``, ``bf16``, or ``int8`` with one power-of-two scale per
    256 values; the rounding error is fed back into the next sync), and every replica takes the
    same Nesterov step of ``outer_lr`` and ``outer_momentum`` from the weights at the last sync.
    Checkpoint cuts and the run's last step always sync. ``overlap`` (outer, ``< every``): a sync's
    all-reduce runs behind that many inner steps and its outer step lands after them, keeping
    their progress (Streaming DiLoCo's overlap; 0 waits for it; cuts and the last step always wait).
    """

    mode: str = "step"
    every: int = 10
    format: str = "int8"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    overlap: int = 0

    def __post_init__(self) -> None:
        if self.mode not in SYNC_MODES:
            raise ValueError(f"replica_sync.mode={self.mode!r} must be one of {SYNC_MODES}")
        if self.format not in SYNC_FORMATS:
            raise ValueError(f"replica_sync.format={self.format!r} must be one of {SYNC_FORMATS}")
        if self.every < 1 or not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError("replica_sync needs every >= 1, outer_lr > 0 and 0 <= outer_momentum < 1")
        if not 0 <= self.overlap < self.every:
            raise ValueError(f"replica_sync.overlap={self.overlap} must lie in [0, every={self.every})")


SYNC_MODES = ("step", "outer")
AUDITABLE_FORMATS = ("fp64", "fp32", "fp16", "bf16")  # wire formats audits compare through


@dataclass
class AuditConfig:
    """Sampled recomputation (``swarm.runtime.audit``) between the replicas of a stage.

    In runs with replicas averaging every step (``replica_sync.mode = "step"``: siblings hold the
    same weights at every step), each replica recomputes each of its siblings' microbatches with
    probability ``rate`` (its own private draw: the audited node cannot tell which), from the frames
    the neighbouring stages' nodes kept (``window`` steps of them), and reports the comparison. A node
    that ``confirmations`` distinct auditors found computing wrong is evicted and the run resumes from
    the newest cut before it first hosted a stage. A node whose activations a downstream screen
    flagged lately is audited at ``suspect_rate`` instead. ``rate = 0`` turns audits off.
    """

    rate: float = 0.02
    confirmations: int = 2
    window: int = 4
    suspect_rate: float = 0.25  # the rate for a suspect (flagged or accused), if above ``rate``

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"audit.rate={self.rate} must lie in [0, 1]")
        if not 0.0 <= self.suspect_rate <= 1.0:
            raise ValueError(f"audit.suspect_rate={self.suspect_rate} must lie in [0, 1]")
        if self.confirmations < 2:
            raise ValueError(
                f"audit.confirmations={self.confirmations} must be >= 2 (one auditor never evicts)"
            )
        if self.window < 2:
            raise ValueError(f"audit.window={self.window} must be >= 2 steps")


SYNC_FORMATS = ("fp64", "fp32", "bf16", "int8")


@dataclass
class DataConfig:
    """The run's corpus. ``source``: a raw corpus (a text file, a folder of .txt/.md/.jsonl, a JSONL
    file; ``None``: the bundled plays) tokenised by ``tokenizer``, or a prepared corpus (``swarm data
    prepare``): its folder or the base URLs of its mirrors, whitespace-separated, tried in order.
    ``corpus``: the prepared corpus's id, which its manifest must hash to (needed with URLs)."""

    source: str | None = None
    tokenizer: str = "bpe"
    corpus: str | None = None


@dataclass
class RunConfig:
    """Everything that defines a run; the unit the coordinator serves and hashes.

    The defaults are the embedded default run (``swarm train``/``swarm up`` without ``--config``,
    ``swarm-coordinator serve`` without ``--config``): the small preset, subspace bf16 both ways, 4 stages.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    rotation: RotationConfig = field(default_factory=RotationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    replica_sync: ReplicaSyncConfig = field(default_factory=ReplicaSyncConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    n_stages: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.n_stages <= self.model.n_layers:
            raise ValueError(f"n_stages={self.n_stages} must lie in [1, n_layers={self.model.n_layers}]")
        if self.codec.kind == "subspace" and self.model.subspace_rank == 0:
            raise ValueError("codec 'subspace' needs model.subspace_rank > 0")
        if self.train.batch_size % self.train.microbatches:
            raise ValueError("train.batch_size must be a multiple of train.microbatches")
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        self._check_replicas()
        self._check_rebuild()
        self._check_growth()
        self._place_bottlenecks()
        last_start, _ = stage_layer_ranges(self.model.n_layers, self.n_stages)[-1]
        if self.model.full_rank_layers > self.model.n_layers - last_start:
            raise ValueError(
                f"model.full_rank_layers={self.model.full_rank_layers} exceeds the "
                f"{self.model.n_layers - last_start} layers of the last stage: "
                "earlier stages' writes cross a boundary"
            )
        if self.emulation.slow_stage >= self.n_stages:
            raise ValueError(
                f"emulation.slow_stage={self.emulation.slow_stage} is not a stage of {self.n_stages}"
            )
        if self.emulation.profile:
            load_profile(self.emulation.profile)
            self._check_emulable()

    def _place_bottlenecks(self) -> None:
        """A bottleneck model has a bottleneck at every stage start (filled in when not given); more, inside
        stages, keep the architecture of a run split differently (one stage holding the whole model)."""
        if not self.model.bottleneck_rank:
            return
        starts = tuple(start for start, _ in stage_layer_ranges(self.model.n_layers, self.n_stages)[1:])
        if not self.model.bottleneck_layers:
            self.model = dataclasses.replace(self.model, bottleneck_layers=starts)
        elif not set(starts) <= set(self.model.bottleneck_layers):
            raise ValueError(
                f"model.bottleneck_layers={self.model.bottleneck_layers} must include the stage "
                f"starts {starts}"
            )
        if self.codec.kind != "identity":
            raise ValueError(
                f"a bottleneck model sends its k numbers through codec 'identity', not {self.codec.kind!r}"
            )

    def _check_rebuild(self) -> None:
        if self.checkpoint.lost_stage != "rebuild":
            return
        c = self.codec
        if c.kind == "mapl" or "rvq" in (c.forward_format, c.backward_format) or self.model.bottleneck_rank:
            # A rebuilt stage takes its neighbours' layers; a boundary's learned maps have no such source.
            raise ValueError(
                "checkpoint.lost_stage 'rebuild' needs boundaries without learned state: no MAPL, "
                "RVQ or bottleneck maps"
            )

    def _check_replicas(self) -> None:
        t, c = self.train, self.codec
        if not 1 <= t.replicas <= t.microbatches:
            raise ValueError(
                f"train.replicas={t.replicas} must lie in [1, train.microbatches={t.microbatches}]"
            )
        if self.replica_sync.mode == "outer" and self.rotation.interval and self.model.constrained:
            # A rotation turns W' between syncs; the weights at the last sync would not follow.
            raise ValueError("replica_sync.mode 'outer' cannot be combined with rotation.interval > 0")
        if t.replicas > 1 and (c.kind == "mapl" or "rvq" in (c.forward_format, c.backward_format)):
            # MAPL projections and RVQ codebooks are boundary state shared by exactly two nodes.
            raise ValueError(
                "train.replicas > 1 needs boundary codecs without per-boundary learned state: "
                "codec kind 'identity' or 'subspace' with a format other than 'rvq'"
            )

    def _check_growth(self) -> None:
        r, m = self.rotation, self.model
        if not r.grow_by:
            return
        if not m.constrained:
            raise ValueError("rotation.grow_by needs a subspace-constrained model (model.subspace_rank > 0)")
        if not m.subspace_rank < r.max_rank <= m.d_model:
            raise ValueError(
                f"rotation.max_rank={r.max_rank} must lie in (model.subspace_rank={m.subspace_rank}, "
                f"d_model={m.d_model}] for the rank to grow"
            )
        if self.train.replicas > 1:
            # The replica averager's tensors are fixed in shape when it starts.
            raise ValueError("rotation.grow_by cannot be combined with train.replicas > 1")
        if "rvq" in (self.codec.forward_format, self.codec.backward_format):
            raise ValueError(
                "rotation.grow_by cannot be combined with the 'rvq' format: its codebooks have the width k"
            )

    def _check_emulable(self) -> None:
        """Raise ``ValueError`` for what an emulated run cannot do (it has no weights to train)."""
        if self.codec.kind == "mapl":
            raise ValueError("compute emulation cannot run MAPL: its boundary projections are trained")
        if self.rotation.interval and self.model.constrained:
            raise ValueError("compute emulation has no weights to rotate: set rotation.interval = 0")
        if self.replica_sync.mode == "outer":
            raise ValueError("compute emulation has no weights for outer steps: set replica_sync.mode = step")
        if self.checkpoint.interval:
            raise ValueError("compute emulation has no weights to snapshot: set checkpoint.interval = 0")

    @property
    def audits(self) -> bool:
        """Whether replicas audit each other: a rate above 0, replicas that hold the same weights at
        every step (averaging every step), real layers (not emulated) and float wire formats (a
        recomputation re-quantized by a coarser format may land a whole step off an honest value)."""
        return (
            self.audit.rate > 0
            and self.train.replicas > 1
            and self.replica_sync.mode == "step"
            and not self.emulation.profile
            and {self.codec.forward_format, self.codec.backward_format} <= set(AUDITABLE_FORMATS)
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        sections = {"model": ModelConfig, "codec": CodecConfig, "rotation": RotationConfig}
        sections |= {"train": TrainConfig, "data": DataConfig, "checkpoint": CheckpointConfig}
        sections |= {"emulation": EmulationConfig, "replica_sync": ReplicaSyncConfig, "audit": AuditConfig}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown run configuration keys: {sorted(unknown)}")
        kwargs: dict[str, Any] = {}
        for name, value in d.items():
            kind = sections.get(name)
            kwargs[name] = _build(kind, value, name) if kind else value
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        with open(path, "rb") as f:
            return cls.from_dict(tomllib.load(f))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def to_toml(self) -> str:
        """The configuration as TOML that :meth:`from_toml` reads back (``None`` values are omitted)."""
        top, sections = [], []
        for key, value in self.to_dict().items():
            if isinstance(value, dict):
                body = [f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None]
                sections.append(f"[{key}]\n" + "\n".join(body))
            elif value is not None:
                top.append(f"{key} = {_toml_value(value)}")
        return "\n".join(top) + "\n\n" + "\n\n".join(sections) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def _build(kind: type, value: Any, section: str) -> Any:
    if isinstance(value, kind):
        return value
    if isinstance(value, str) and kind is ModelConfig:
        if value not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {value!r}; choose from {sorted(MODEL_PRESETS)}")
        return dataclasses.replace(MODEL_PRESETS[value])
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = set(value) - names
    if unknown:
        raise ValueError(f"unknown keys in [{section}]: {sorted(unknown)}")
    return kind(**value)


def config_hash(config: RunConfig) -> str:
    """Content hash of a run configuration (sha256 of its canonical JSON)."""
    return hashlib.sha256(config.to_json().encode()).hexdigest()


def stage_layer_ranges(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Split ``n_layers`` into ``n_stages`` contiguous ranges, earlier stages taking the extra layers."""
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        end = start + base + (1 if s < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges
