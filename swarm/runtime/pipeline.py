"""The single-process pipeline: P stage workers in one process, GPipe microbatching.

Frames between stages are the real thing (encoded to bytes, decoded and validated on
the other side); only the transport is a function call. This is the oracle the
distributed runtime is tested against and the engine of the convergence experiments.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.core.config import RunConfig
from swarm.core.mapl import pack_gradients, sum_gradients
from swarm.core.subspace import SubspaceRotation, initial_artifacts, next_rotation
from swarm.runtime.norm_guard import NormBound
from swarm.runtime.worker import StageStats, StageWorker


@dataclass
class StepResult:
    step: int
    loss: float
    tokens: int
    bytes_forward: list[int]  # per boundary, activation frames (payload + token ids)
    bytes_backward: list[int]  # per boundary, gradient frames
    bytes_sync: int  # MAPL gradient shares + RVQ codebook deltas, all boundaries
    off_subspace_fraction: list[float | None] = field(default_factory=list)
    rotation: SubspaceRotation | None = None

    @property
    def wire_bytes_per_token(self) -> float:
        """Bytes crossing one boundary per token, forward + backward, averaged over boundaries."""
        n = max(1, len(self.bytes_forward))
        return (sum(self.bytes_forward) + sum(self.bytes_backward) + self.bytes_sync) / n / self.tokens


class LocalPipeline:
    """All stages of a run in this process (``norm_bound``: check boundary norms as a swarm node does)."""

    def __init__(
        self,
        config: RunConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        norm_bound: NormBound | None = None,
    ):
        self.config = config
        fixed, basis = initial_artifacts(config)
        self.workers = [
            StageWorker(config, i, fixed, basis, device=device, dtype=dtype, norm_bound=norm_bound)
            for i in range(config.n_stages)
        ]
        self.version = 0

    def forward_backward(self, step: int, token_ids: torch.Tensor) -> tuple[float, list[int], list[int]]:
        """GPipe: every microbatch forward through all stages, then all backward in reverse.

        Leaves the gradients in place; returns (mean loss, forward bytes, backward bytes) per boundary.
        """
        for w in self.workers:
            w.begin_step(step)
        chunks = token_ids.chunk(self.config.train.microbatches)
        n_boundaries = len(self.workers) - 1
        fwd, bwd = [0] * n_boundaries, [0] * n_boundaries
        losses = []
        for mb, ids in enumerate(chunks):
            source = ids
            for i, w in enumerate(self.workers):
                source = w.forward(step, mb, source)
                if i < n_boundaries:
                    fwd[i] += source.nbytes
            losses.append(source)
        for mb in reversed(range(len(chunks))):
            grad = None
            for i in reversed(range(len(self.workers))):
                grad = self.workers[i].backward(step, mb, grad)
                if grad is not None:
                    bwd[i - 1] += grad.nbytes
        return sum(losses) / len(losses), fwd, bwd

    def exchange_boundary_state(self) -> int:
        """Sum MAPL gradient shares across each boundary and ship RVQ deltas; returns bytes moved."""
        moved = 0
        for sender, receiver in zip(self.workers, self.workers[1:], strict=False):
            if "out" in sender.mapl:
                a, b = sender.boundary_gradients("out"), receiver.boundary_gradients("in")
                total = sum_gradients(a, b)
                sender.set_boundary_gradients("out", total)
                receiver.set_boundary_gradients("in", total)
                moved += len(pack_gradients(a)) + len(pack_gradients(b))
        return moved

    def ship_codebooks(self) -> int:
        moved = 0
        for sender, receiver in zip(self.workers, self.workers[1:], strict=False):
            delta = sender.codebook_delta()
            if delta is not None:
                receiver.apply_codebook_delta(delta)
                moved += len(delta)
        return moved

    def train_step(self, step: int, token_ids: torch.Tensor) -> StepResult:
        """One optimizer step on a ``B x (T+1)`` batch of token ids."""
        loss, fwd, bwd = self.forward_backward(step, token_ids)
        sync = self.exchange_boundary_state()
        stats: list[StageStats] = [w.optimizer_step(step) for w in self.workers]
        sync += self.ship_codebooks()
        result = StepResult(
            step,
            loss,
            stats[0].tokens,
            fwd,
            bwd,
            sync,
            [s.off_subspace_fraction for s in stats[1:]],
        )
        result.rotation = self._maybe_rotate(step)
        return result

    def _maybe_rotate(self, step: int) -> SubspaceRotation | None:
        interval = self.config.rotation.interval
        if interval <= 0 or not self.config.model.constrained or (step + 1) % interval:
            return None
        stats = [w.statistic.gram_times_basis for w in self.workers if w.statistic is not None]
        if not stats:
            return None
        basis = self.workers[0].stage.basis
        rotation = next_rotation(basis, stats, self.version, step + 1, self.config.rotation.max_angle)
        for w in self.workers:
            w.schedule_rotation(rotation)
        self.version = rotation.version
        return rotation
