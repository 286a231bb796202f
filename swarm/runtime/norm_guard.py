"""Norm bounds on what a neighbour sends: a poisoned frame can be finite and still wreck a model.

Each stage keeps the RMS of the last ``window`` boundary tensors it accepted from a neighbour
(activations from upstream, gradients from downstream) and refuses, after ``warmup`` of them,
one whose RMS exceeds ``factor`` times their median (activations) or ``gradient_factor`` times it
(gradients). Training moves activation norms by a few times over many steps; per-microbatch
gradients are heavy-tailed (one honest microbatch of unusual text measured 410x its neighbours'
median on the tiny model), so their bound is looser, and each stage's gradient clipping bounds
what a gradient under it can do. An attacker who scales a frame up by orders of magnitude is
refused like any malformed frame (and evicted), and one who ramps up slowly can grow the norm
by at most the factor per half window.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, replace

import torch

from swarm.codecs.base import PayloadError


def root_mean_square(x: torch.Tensor) -> float:
    return float(x.detach().double().pow(2).mean().sqrt()) if x.numel() else 0.0


@dataclass(frozen=True)
class NormBound:
    factor: float = 100.0
    window: int = 64
    warmup: int = 16
    gradient_factor: float = 10_000.0

    def for_gradients(self) -> NormBound:
        """The bound received gradients are held to."""
        return replace(self, factor=self.gradient_factor)


class NormGuard:
    """The bound for one direction of one boundary (``what`` names it in errors)."""

    def __init__(self, what: str, bound: NormBound = NormBound()):
        self.what, self.bound = what, bound
        self.history: deque[float] = deque(maxlen=bound.window)

    def check(self, x: torch.Tensor) -> None:
        """Accept ``x`` (and remember its RMS), or raise :class:`PayloadError`."""
        rms = root_mean_square(x)
        if len(self.history) >= self.bound.warmup:
            typical = statistics.median(self.history)
            if typical > 0 and rms > self.bound.factor * typical:
                limit = f"{self.bound.factor:g} x the recent median {typical:.3g}"
                raise PayloadError(f"{self.what} RMS {rms:.3g} exceeds {limit}")
        self.history.append(rms)
