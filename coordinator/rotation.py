"""Boundary statistics in, subspace rotations out.

Rotations run only when ``config.rotation.interval > 0`` and the model is subspace
constrained. After optimizer step ``s`` with ``(s + 1) % interval == 0``, each stage
``1 .. P-1`` reports the d x k statistic ``sum G^T (G U)`` of its inbound boundary
``b = stage - 1`` under the current subspace version. Once all ``P - 1`` boundaries of
step ``s`` are in, they are summed in ascending boundary order (the order the
single-process :class:`~swarm.runtime.pipeline.LocalPipeline` sums its stages in, so both compute
bit-identical rotations) into :func:`~swarm.core.subspace.next_rotation`, effective from step
``s + 1``. A rotation may also grow the basis (``rotation.grow_by``); statistics are then
``d x k`` for the width ``k`` of the version they were measured under.
"""

from __future__ import annotations

import torch
from swarm.coordinator.errors import Rejected

from swarm.core.config import RunConfig
from swarm.core.subspace import SubspaceRotation, next_rotation


class RotationCollector:
    """Collects the boundary statistics of a rotation step and turns a full set into the next rotation."""

    def __init__(self, config: RunConfig, initial_basis: torch.Tensor | None, last: SubspaceRotation | None):
        self.enabled = config.rotation.interval > 0 and config.model.constrained
        self.interval = config.rotation.interval
        self.rotation = config.rotation
        self.n_boundaries = config.n_stages - 1
        self.basis = last.basis if last is not None else initial_basis
        self.version = last.version if last is not None else 0
        self.effective_step = last.effective_step if last is not None else 0
        self.pending: dict[int, dict[int, torch.Tensor]] = {}

    def offer(self, step: int, boundary: int, version: int, data: bytes) -> SubspaceRotation | None:
        """Accept one boundary's statistic; the new rotation once the step's set is complete.

        Raises :class:`Rejected` for a report that cannot be used (rotations off, a step that
        is not a rotation step or already past, another version, a malformed matrix).
        """
        if not self.enabled:
            raise Rejected("rotation_disabled", "rotations are disabled in this run")
        if not 0 <= boundary < self.n_boundaries:
            raise Rejected("malformed", f"boundary {boundary} outside [0, {self.n_boundaries})")
        if (step + 1) % self.interval or step + 1 <= self.effective_step:
            raise Rejected(
                "bad_step",
                f"step {step} is not a rotation step after step {self.effective_step} "
                f"(interval {self.interval})",
            )
        if version != self.version:
            raise Rejected("stale_version", f"statistic for version {version}, current is {self.version}")
        d, k = self.basis.shape  # the current basis: a grown one is wider
        if len(data) != 8 * d * k:
            raise Rejected(
                "malformed", f"statistic must be {d}x{k} float64 ({8 * d * k} bytes), got {len(data)}"
            )
        stat = torch.frombuffer(bytearray(data), dtype=torch.float64).view(d, k)
        if not bool(torch.isfinite(stat).all()):
            raise Rejected("malformed", "statistic holds non-finite values")
        reports = self.pending.setdefault(step, {})
        reports[boundary] = stat
        if len(reports) < self.n_boundaries:
            return None
        rotation = next_rotation(
            self.basis, [reports[b] for b in range(self.n_boundaries)], self.version, step + 1, self.rotation
        )
        self.basis, self.version, self.effective_step = (
            rotation.basis,
            rotation.version,
            rotation.effective_step,
        )
        self.pending.clear()
        return rotation
