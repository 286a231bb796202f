"""Stages that compute wrong on purpose: the faulty volunteers of the tests and the verification bench.

A :class:`Fault` hooks a stage worker's layers and, on a ``fraction`` of its microbatches, replaces
the stage's output with a wrong one of the same shape: its sign flipped, noise of the same norm, the
output of weights ``lag`` steps old, or the output with its last layer skipped. Gradients still flow
through the honest computation (the value is replaced, not the graph), as a cheater that trains
normally but sends lies would. A node takes one with the hidden ``swarm-node join --fault`` flag
(:class:`FaultSpec`); nothing else in the product does.
"""

from __future__ import annotations

import collections
import copy
import random
from dataclasses import dataclass

import torch

from swarm.runtime.worker import StageWorker

MODES = ("sign", "noise", "stale", "skip")
ACCUSE = "accuse"  # not a stage's lie: the node reports every audit it runs as a mismatch


def _replace(out: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` forward, ``out``'s gradient path backward."""
    return out + (value.to(out.dtype) - out).detach()


class Fault:
    """``worker``'s stage lies on a microbatch with probability ``fraction`` (``mode``: :data:`MODES`),
    once it has forwarded ``after`` microbatches honestly."""

    def __init__(
        self,
        worker: StageWorker,
        mode: str,
        fraction: float = 1.0,
        seed: int = 0,
        lag: int = 1,
        after: int = 0,
    ):
        if mode not in MODES:
            raise ValueError(f"fault mode {mode!r} must be one of {MODES}")
        self.worker, self.mode, self.fraction, self.lag, self.after = worker, mode, fraction, lag, after
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
        lie = len(self.lied) >= self.after and self.rng.random() < self.fraction
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


@dataclass(frozen=True)
class FaultSpec:
    """``MODE[:FRACTION][@AFTER]``: lie in ``MODE`` (:data:`MODES`) on ``FRACTION`` of the
    microbatches (default all) once ``AFTER`` microbatches of an epoch were forwarded honestly; or
    ``accuse``: compute honestly, report every audit of a sibling as a mismatch (:data:`ACCUSE`)."""

    mode: str
    fraction: float = 1.0
    after: int = 0

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        head, _, after = text.partition("@")
        mode, _, fraction = head.partition(":")
        if mode not in (*MODES, ACCUSE):
            raise ValueError(f"--fault mode {mode!r} must be one of {(*MODES, ACCUSE)}")
        try:
            spec = cls(mode, float(fraction) if fraction else 1.0, int(after) if after else 0)
        except ValueError:
            raise ValueError(f"--fault {text!r} is not MODE[:FRACTION][@AFTER]") from None
        if not 0.0 <= spec.fraction <= 1.0 or spec.after < 0:
            raise ValueError(f"--fault {text!r}: FRACTION in [0, 1], AFTER >= 0")
        return spec

    def attach(self, worker: StageWorker, seed: int) -> Fault | None:
        """The stage's lie (None for :data:`ACCUSE`: its lies are in audit reports)."""
        if self.mode == ACCUSE:
            return None
        return Fault(worker, self.mode, self.fraction, seed=seed, after=self.after)
