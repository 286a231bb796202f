"""The single-process pipeline: P stage workers in one process, GPipe microbatching by default.

Frames between stages carry what the wire would: the values the receiver decodes and, counted
from the formats, the bytes. By default they are handed over on the device without being
serialised (:class:`~swarm.runtime.wire.CarriedActivation`), bit for bit what a decoded frame
holds; ``frames=True`` (or zstd, whose size depends on the data) encodes every crossing to bytes
and decodes it on the other side, the wire's own code path. This is the oracle the
distributed runtime is tested against and the engine of the convergence experiments. The
microbatch order and the end-of-step syncs come from :mod:`swarm.runtime.steps`, as on a node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.core.config import RunConfig
from swarm.core.subspace import SubspaceRotation, initial_artifacts, next_rotation
from swarm.runtime.norm_guard import NormBound
from swarm.runtime.steps import (
    FORWARD,
    end_step,
    pipeline_order,
    run_in_process,
    share_mapl_gradients,
    ship_codebooks,
)
from swarm.runtime.wire import ActivationFrame, CarriedActivation, CarriedGradient, GradientFrame
from swarm.runtime.worker import StageWorker


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
    """All stages of a run in this process, following the microbatch order of ``schedule``
    (``norm_bound``: check boundary norms as a swarm node does; ``frames``: serialise every
    boundary crossing instead of handing the decoded values over)."""

    def __init__(
        self,
        config: RunConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        norm_bound: NormBound | None = None,
        schedule: str = "gpipe",
        frames: bool = False,
    ):
        self.config, self.schedule = config, schedule
        fixed, basis = initial_artifacts(config)
        self.workers = [
            StageWorker(
                config,
                i,
                fixed,
                basis,
                device=device,
                dtype=dtype,
                norm_bound=norm_bound,
                in_process=not frames,
            )
            for i in range(config.n_stages)
        ]
        self.version = 0

    def forward_backward(self, step: int, token_ids: torch.Tensor) -> tuple[float, list[int], list[int]]:
        """Every microbatch forward and backward through all stages, in the schedule's order.

        Leaves the gradients in place; returns (mean loss, forward bytes, backward bytes) per boundary.
        """
        for w in self.workers:
            w.begin_step(step)
        chunks = token_ids.chunk(self.config.train.microbatches)
        fwd, bwd = [0] * (len(self.workers) - 1), [0] * (len(self.workers) - 1)
        activations: dict[
            tuple[int, int], ActivationFrame | CarriedActivation
        ] = {}  # by (boundary, microbatch)
        gradients: dict[tuple[int, int], GradientFrame | CarriedGradient] = {}
        losses = []
        for stage, (kind, mb) in pipeline_order(self.schedule, len(self.workers), len(chunks)):
            w = self.workers[stage]
            if kind == FORWARD:
                out = w.forward(step, mb, chunks[mb] if w.is_first else activations.pop((stage - 1, mb)))
                if w.is_last:
                    losses.append(out)
                else:
                    activations[stage, mb] = out
                    fwd[stage] += out.nbytes
            else:
                grad = w.backward(step, mb, gradients.pop((stage, mb), None))
                if grad is not None:
                    gradients[stage - 1, mb] = grad
                    bwd[stage - 1] += grad.nbytes
        return sum(losses) / len(losses), fwd, bwd

    def exchange_boundary_state(self, step: int = 0) -> int:
        """Sum MAPL gradient shares across each boundary (``step``: the messages' label); bytes moved."""
        return run_in_process([share_mapl_gradients(w, step) for w in self.workers])[1]

    def ship_codebooks(self, step: int = 0) -> int:
        """Learn the RVQ codebooks and ship their deltas across each boundary; bytes moved."""
        return run_in_process([ship_codebooks(w, step) for w in self.workers])[1]

    def train_step(self, step: int, token_ids: torch.Tensor) -> StepResult:
        """One optimizer step on a ``B x (T+1)`` batch of token ids."""
        loss, fwd, bwd = self.forward_backward(step, token_ids)
        stats, sync = run_in_process([end_step(w, step) for w in self.workers])
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
        rotation = next_rotation(basis, stats, self.version, step + 1, self.config.rotation)
        for w in self.workers:
            w.schedule_rotation(rotation)
        self.version = rotation.version
        return rotation
