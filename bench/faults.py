"""Stages that compute wrong on purpose, and an auditor beside them (tests and the verification bench).

A :class:`Fault` hooks a stage worker's layers and, on a ``fraction`` of its microbatches, replaces
the stage's output with a wrong one of the same shape: its sign flipped, noise of the same norm, the
output of weights ``lag`` steps old, or the output with its last layer skipped. Gradients still flow
through the honest computation (the value is replaced, not the graph), as a cheater that trains
normally but sends lies would. A :class:`Recorder` keeps each microbatch's committed inputs and
claimed output, and an :class:`Auditor` holds the stage's weights at the step's version and
recomputes them.
"""

from __future__ import annotations

import collections
import copy
import random

import torch

from swarm.core.precision import layer_autocast
from swarm.runtime.audit import Comparison, compare, recompute
from swarm.runtime.worker import StageWorker

MODES = ("sign", "noise", "stale", "skip")


def _replace(out: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` forward, ``out``'s gradient path backward."""
    return out + (value.to(out.dtype) - out).detach()


class Fault:
    """``worker``'s stage lies on a microbatch with probability ``fraction`` (``mode``: :data:`MODES`)."""

    def __init__(self, worker: StageWorker, mode: str, fraction: float = 1.0, seed: int = 0, lag: int = 1):
        if mode not in MODES:
            raise ValueError(f"fault mode {mode!r} must be one of {MODES}")
        self.worker, self.mode, self.fraction, self.lag = worker, mode, fraction, lag
        self.rng = random.Random(seed)
        self.lied: list[bool] = []  # per microbatch forwarded, whether it lied
        self.stale = copy.deepcopy(worker.stage) if mode == "stale" else None
        self.history: collections.deque[dict] = collections.deque(maxlen=lag + 1)
        if mode == "skip":
            last = list(worker.stage.layers.values())[-1]
            self.handle = last.register_forward_hook(self._skip)
        else:
            self.handle = worker.stage.register_forward_hook(self._output)

    def _lies(self) -> bool:
        lie = self.rng.random() < self.fraction
        self.lied.append(lie)
        return lie

    def _output(self, module, inputs, out):
        if not self._lies():
            return None
        if self.mode == "sign":
            return _replace(out, -out)
        if self.mode == "noise":
            noise = torch.randn_like(out, dtype=torch.float32)
            return _replace(out, noise * (out.float().norm() / noise.norm()))
        with torch.no_grad():
            stale = self.stale(*inputs)
        return _replace(out, stale)

    def _skip(self, module, inputs, out):
        return _replace(out, inputs[0]) if self._lies() else None

    def stepped(self) -> None:
        """After an optimizer step: the stale copy takes the weights of ``lag`` steps ago."""
        if self.stale is not None:
            self.history.append(copy.deepcopy(self.worker.stage.state_dict()))
            if len(self.history) == self.lag + 1:  # (until then the stale copy holds the first weights)
                self.stale.load_state_dict(self.history[0])


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
