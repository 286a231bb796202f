"""One pipeline stage at work: its layers, its two boundary codecs, its optimizer.

:class:`StageWorker` is the unit a node hosts and the single-process pipeline strings
together. Per microbatch it turns an incoming :class:`~swarm.runtime.wire.ActivationFrame`
(or the token ids, on stage 0) into an outgoing frame (or the loss, on the last stage),
and an incoming :class:`~swarm.runtime.wire.GradientFrame` into the one it sends upstream. Every
boundary crossing is a real encode -> bytes -> decode (or, between workers in one process, the
same values handed over with the bytes counted from the formats). At the end of a step the
worker exchanges what its boundary neighbours need (MAPL gradient shares, RVQ codebook
deltas), steps its optimizer, and applies subspace rotations at their announced step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarm.codecs import make_format
from swarm.codecs.base import PayloadError
from swarm.codecs.boundary import BoundaryCodec, IdentityMap, SubspaceMap
from swarm.codecs.rvq import ResidualVQ
from swarm.core.config import RunConfig, stage_layer_ranges
from swarm.core.mapl import MaplBoundary, boundary_gradients, pack_projection, set_boundary_gradients
from swarm.core.model import Stage, name_seed
from swarm.core.optim import build_optimizer
from swarm.core.precision import check_master_dtype, layer_autocast
from swarm.core.profiles import load_profile
from swarm.core.subspace import BoundaryStatistic, SubspaceRotation, rotate_stage
from swarm.runtime.emulation import EmulatedStage
from swarm.runtime.norm_guard import NormBound, NormGuard
from swarm.runtime.outer_step import OuterStep
from swarm.runtime.screen import ActivationScreen
from swarm.runtime.wire import ActivationFrame, CarriedActivation, CarriedGradient, GradientFrame


def _build_stage(
    config: RunConfig, start: int, end: int, fixed_embedding: torch.Tensor, basis: torch.Tensor | None
) -> torch.nn.Module:
    """The stage's layers: real ones (compiled when the run says so), or a compute-emulated stand-in
    when the run names a profile."""
    if config.emulation.profile:
        profile = load_profile(config.emulation.profile)
        return EmulatedStage(config, start, end, fixed_embedding, basis, profile)
    stage = Stage(config.model, start, end, fixed_embedding, basis, config.train.seed)
    if config.train.compile:
        stage.compile_layers()
    return stage


@dataclass
class _Microbatch:
    output: torch.Tensor  # coordinates sent downstream, or the scaled loss on the last stage
    received: torch.Tensor | None  # coordinates received from upstream (a leaf requiring grad)


@dataclass
class StageStats:
    """What a worker did in one step; summed into the step's metrics."""

    tokens: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    grad_norm: float = 0.0
    off_subspace_fraction: float | None = None
    drifted_frames: int = 0  # received activation frames the screen flagged (swarm.runtime.screen)
    drift: str = ""  # why the last of them was flagged


class StageWorker:
    """Stage ``index`` of a run: builds its layers from the run seed and codecs from the config
    (``in_process``: its neighbours are in this process; frames are carried, not serialised)."""

    def __init__(
        self,
        config: RunConfig,
        index: int,
        fixed_embedding: torch.Tensor,
        basis: torch.Tensor | None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        norm_bound: NormBound | None = None,
        in_process: bool = False,
    ):
        self.config, self.index, self.in_process = config, index, in_process
        # What neighbours send is bounded against its recent norms (None: not checked; the
        # single-process pipeline trusts itself).
        self.activation_guard = (
            NormGuard(f"stage {index}: received activations", norm_bound) if norm_bound else None
        )
        self.gradient_guard = (
            NormGuard(f"stage {index}: received gradients", norm_bound.for_gradients())
            if norm_bound
            else None
        )
        # Received activations are screened against their moving statistics (flags, never refusals).
        self.activation_screen = ActivationScreen() if norm_bound and index > 0 else None
        self.device, self.dtype = torch.device(device), dtype
        check_master_dtype(config.train.precision, dtype)
        start, end = stage_layer_ranges(config.model.n_layers, config.n_stages)[index]
        self.stage = _build_stage(config, start, end, fixed_embedding, basis).to(device, dtype)
        # The codec's basis: the stage's own buffer when the model is constrained (rotations
        # then move both together), a private copy when it only serves the codec.
        self.basis = self.stage.basis
        if self.basis is None and basis is not None:
            self.basis = basis.to(device, dtype, copy=True)
        self.mapl: dict[str, MaplBoundary] = {}
        self.inbound = self._make_codec(index - 1, "in") if index > 0 else None
        self.outbound = self._make_codec(index, "out") if not self.stage.is_last else None
        self.optimizer = build_optimizer([self.stage, *self.mapl.values()], config.train)
        self.outer: OuterStep | None = None  # DiLoCo's outer state, when replicas take outer steps
        self.version = 0
        self.pending_rotation: SubspaceRotation | None = None
        self.statistic = (
            BoundaryStatistic(self.basis)
            if self.inbound is not None and isinstance(self.inbound.map, SubspaceMap)
            else None
        )
        self._microbatches: dict[int, _Microbatch] = {}
        self._forwarded: set[int] = set()  # the microbatches of this step forwarded so far
        self._sent_rows: list[torch.Tensor] = []
        self.stats = StageStats()

    @property
    def is_first(self) -> bool:
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

    def _make_codec(self, boundary: int, side: str) -> BoundaryCodec:
        cfg, model = self.config.codec, self.config.model
        if isinstance(self.stage, EmulatedStage):  # its wait stands for the maps: coordinates pass through
            bmap = IdentityMap(self.stage.width)
        elif cfg.kind == "identity":  # the residual stream, or a bottleneck model's k numbers
            bmap = IdentityMap(model.boundary_width)
        elif cfg.kind == "subspace":
            bmap = SubspaceMap(self.stage.fixed_embedding, self.basis)
        elif cfg.kind == "mapl":
            bmap = MaplBoundary(
                self.stage.fixed_embedding, cfg.mapl_rank, cfg.anchor_rank, self.config.train.seed, boundary
            ).to(self.device, self.dtype)
            if side == "out" and cfg.mapl_pca_steps:
                bmap.track_input_moment()
            self.mapl[side] = bmap
        else:
            raise ValueError(f"unknown codec kind {cfg.kind!r}; choose identity, subspace or mapl")
        seed = name_seed(self.config.train.seed, f"codebook.{boundary}")
        return BoundaryCodec(
            bmap,
            make_format(cfg.forward_format, bmap.width, cfg, seed),
            make_format(cfg.backward_format, bmap.width, cfg, seed),
            model.vocab_size,
            model.max_seq_len,
            cfg.zstd_level,
            self.in_process,
        )

    def parameters(self) -> list[torch.nn.Parameter]:
        params = list(self.stage.parameters())
        for boundary in self.mapl.values():
            params += list(boundary.parameters())
        return params

    # -- microbatch traffic ---------------------------------------------------------------------

    def forward(
        self,
        step: int,
        microbatch: int,
        source: torch.Tensor | ActivationFrame | CarriedActivation,
        train: bool = True,
    ):
        """Run the stage on one microbatch.

        ``source`` is the ``B x (T+1)`` token ids on stage 0 and an activation frame
        elsewhere. Returns the frame for the next stage, or the loss (float) on the last.
        With ``train=False`` (evaluation) nothing is kept for backward or counted in the stats.
        """
        received = None
        if train:
            self._check_new_microbatch(step, microbatch)
        if self.is_first:
            if not isinstance(source, torch.Tensor):
                raise TypeError("stage 0 takes token ids, not a frame")
            ids = source.to(self.device)
            with layer_autocast(self.config.train.precision, self.device):
                x = self.stage(ids[:, :-1])
        else:
            if not isinstance(source, (ActivationFrame, CarriedActivation)):
                raise TypeError(f"stage {self.index} takes an activation frame")
            self._check_step(source.step, step)
            z, ids = self.inbound.decode_activation(source, self.version, self.device, self.dtype)
            if self.activation_guard is not None and train:
                self.activation_guard.check(z)
            # (not while a MAPL sender's PCA warm-up may still re-initialise its projection)
            if self.activation_screen is not None and train and step > self.config.codec.mapl_pca_steps:
                self._screen(z, microbatch)
            received = z.requires_grad_(train)
            x_in = self.inbound.map.lift(received, ids[:, :-1])
            if self.statistic is not None and train:
                x_in.register_hook(self.statistic.add)
            with layer_autocast(self.config.train.precision, self.device):
                x = self.stage(ids[:, :-1], x_in)
        if self.is_last:
            loss = self.stage.loss(x, ids[:, 1:])
            output = loss / self.config.train.microbatches
        else:
            if train and self.config.codec.mapl_pca_steps > step:  # the sender's PCA warm-up
                self.mapl["out"].observe(x, ids[:, :-1])
            output = self.outbound.map.project(x, ids[:, :-1])
            frame = self.outbound.encode_activation(output, ids, step, microbatch, self.version)
        if train:
            self._record(microbatch, ids, output, received)
        if self.is_last:
            return loss.item()
        return frame

    def _screen(self, z: torch.Tensor, microbatch: int) -> None:
        drift = self.activation_screen.observe(z)
        if drift is not None:
            self.stats.drifted_frames += 1
            self.stats.drift = f"microbatch {microbatch}: {drift}"

    def _check_new_microbatch(self, step: int, microbatch: int) -> None:
        """A replayed microbatch (already forwarded this step) or one outside the step is refused."""
        if not 0 <= microbatch < self.config.train.microbatches:
            raise PayloadError(
                f"stage {self.index}: microbatch {microbatch} of step {step} is outside "
                f"[0, {self.config.train.microbatches})"
            )
        if microbatch in self._forwarded:
            raise PayloadError(f"stage {self.index}: microbatch {microbatch} of step {step} replayed")
        self._forwarded.add(microbatch)

    def _record(self, microbatch: int, ids: torch.Tensor, output: torch.Tensor, received) -> None:
        tokens = ids[:, :-1].numel()
        self.stats.tokens += tokens
        self._microbatches[microbatch] = _Microbatch(output, received)
        if self.is_last:
            self.stats.loss_sum += output.item() * self.config.train.microbatches * tokens
            self.stats.loss_count += tokens
        elif self.outbound.codebooks is not None:
            self._sent_rows.append(output.detach().reshape(-1, output.shape[-1]))

    @property
    def live_microbatches(self) -> int:
        """Microbatches whose activations are held for their backward pass."""
        return len(self._microbatches)

    def backward(self, step: int, microbatch: int, gradient: GradientFrame | CarriedGradient | None = None):
        """Backpropagate one microbatch; returns the frame for the previous stage (None on stage 0)."""
        saved = self._microbatches.pop(microbatch, None)
        if saved is None:
            raise PayloadError(
                f"stage {self.index}: backward for unknown microbatch {microbatch} of step {step}"
            )
        if self.is_last:
            saved.output.backward()
        else:
            if gradient is None:
                raise TypeError(f"stage {self.index} needs the gradient frame of microbatch {microbatch}")
            self._check_step(gradient.step, step)
            g = self.outbound.decode_gradient(
                gradient, self.version, saved.output.shape, self.device, self.dtype
            )
            if self.gradient_guard is not None:
                self.gradient_guard.check(g)
            saved.output.backward(g)
        if self.is_first:
            return None
        return self.inbound.encode_gradient(saved.received.grad, step, microbatch, self.version)

    def _check_step(self, got: int, expected: int) -> None:
        if got != expected:
            raise PayloadError(f"stage {self.index}: frame of step {got} arrived during step {expected}")

    # -- end of step ---------------------------------------------------------------------------

    def boundary_gradients(self, side: str) -> dict[str, torch.Tensor]:
        """This side's share of the MAPL boundary gradients (``side``: ``in`` or ``out``)."""
        return boundary_gradients(self.mapl[side])

    def set_boundary_gradients(self, side: str, grads: dict[str, torch.Tensor]) -> None:
        set_boundary_gradients(self.mapl[side], grads)

    def principal_projection(self) -> bytes:
        """MAPL PCA initialisation, sender side: switch the outbound projection to the principal
        directions of the inputs seen during the warm-up; returns it packed for the receiver."""
        a = self.mapl["out"].principal_directions()
        self.mapl["out"].resize_input_moment(torch.Size([0]))
        self.install_projection("out", a)
        return pack_projection(a)

    def install_projection(self, side: str, a: torch.Tensor) -> None:
        """Make ``a`` (float64) this side's MAPL projection; its Stiefel optimizer state restarts."""
        self.mapl[side].replace_projection(a.to(self.device, self.dtype), self.optimizer.stiefel)

    def optimizer_step(self, step: int) -> StageStats:
        """Step the optimizer, learn the outbound codebooks, and return (then reset) the step's stats."""
        self.stats.grad_norm = self.optimizer.step(step, self.parameters())
        self.optimizer.zero_grad()
        if self.statistic is not None:
            self.stats.off_subspace_fraction = self.statistic.off_fraction
        stats, self.stats = self.stats, StageStats()
        return stats

    def codebooks(self, side: str) -> ResidualVQ | None:
        """The RVQ codebooks of this side's boundary (``side``: ``in`` or ``out``); None where it has none."""
        codec = self.inbound if side == "in" else self.outbound
        return codec.codebooks if codec is not None else None

    def codebook_delta(self) -> bytes | None:
        """Learn the outbound RVQ codebooks from this step's coordinates; the delta the receiver needs."""
        fmt = self.codebooks("out")
        if fmt is None or not self._sent_rows:
            return None
        version = fmt.version
        fmt.update(torch.cat(self._sent_rows).float().cpu())
        self._sent_rows.clear()
        return fmt.delta_since(version)

    def apply_codebook_delta(self, delta: bytes) -> None:
        fmt = self.codebooks("in")
        if fmt is None:
            raise PayloadError(f"stage {self.index}: codebook delta for a boundary without RVQ")
        fmt.apply_delta(delta)

    def schedule_rotation(self, rotation: SubspaceRotation) -> None:
        """Accept a rotation; it is applied when :meth:`begin_step` reaches its effective step."""
        if rotation.version != self.version + 1:
            raise PayloadError(f"rotation to version {rotation.version} while at version {self.version}")
        self.pending_rotation = rotation

    def begin_step(self, step: int) -> None:
        """Start a step: no microbatch forwarded yet; apply a pending rotation whose step has come."""
        self._forwarded.clear()
        rot = self.pending_rotation
        if rot is not None and step >= rot.effective_step:
            if step > rot.effective_step:
                raise PayloadError(f"rotation for step {rot.effective_step} applied late, at step {step}")
            rotate_stage(self.stage, rot.basis, self.optimizer)
            self.version, self.pending_rotation = rot.version, None
            if self.statistic is not None:
                self.statistic.reset()
