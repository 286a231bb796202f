"""Recording a faulty stage's microbatches and an auditor beside it (tests and the verification bench).

The faults themselves are :mod:`swarm.runtime.faults` (nodes take them too, for the live tests). A
:class:`Recorder` keeps each microbatch's committed inputs and claimed output, and an
:class:`Auditor` holds the stage's weights at the step's version and recomputes them.
"""

from __future__ import annotations

import copy

import torch

from swarm.core.precision import layer_autocast
from swarm.runtime.audit import Comparison, compare, recompute
from swarm.runtime.worker import StageWorker


class Recorder:
    """Each microbatch's inputs and claimed output at ``worker``'s stage (after any fault)."""

    def __init__(self, worker: StageWorker):
        self.kept: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self.handle = worker.stage.register_forward_hook(self._keep)

    def _keep(self, module, inputs, out) -> None:
        tokens, x_in = inputs[0], inputs[1] if len(inputs) > 1 else None
        self.kept.append((tokens.detach(), None if x_in is None else x_in.detach(), out.detach()))

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
        kept, self.kept = self.kept, []
        return kept


class Auditor:
    """Holds a copy of ``worker``'s stage (made before any fault hooks it) at the step's version and
    recomputes in ``precision``."""

    def __init__(self, worker: StageWorker, precision: str = "fp32"):
        self.worker, self.precision = worker, precision
        self.stage = copy.deepcopy(worker.stage)

    def sync(self) -> None:
        """Take the stage's current weights (call before the step whose microbatches are audited)."""
        self.stage.load_state_dict(self.worker.stage.state_dict())

    def check(self, tokens: torch.Tensor, x_in: torch.Tensor | None, claimed: torch.Tensor) -> Comparison:
        with layer_autocast(self.precision, tokens.device):
            reference, _ = recompute(self.stage, tokens, x_in)
        return compare(reference.float(), claimed.float())
