"""A cheap screen on every received activation frame: moving statistics that flag a sender drifting.

An honest stage's boundary coordinates keep a persistent mean direction across microbatches (the
residual stream's bias directions) once training has settled past its first steps. The screen
learns the moving mean of the per-frame mean vector and of the fraction of a frame's energy that
lies in its mean, and starts judging once :attr:`ScreenSettings.warmup` consecutive frames kept
their mean within :attr:`ScreenSettings.stable_cosine` of the moving one (a stream that never
settles is never judged: no false alarms, and no screen). A frame whose mean points away from the
moving mean (a sign flip: cosine near -1) or whose energy no longer sits in a mean (noise of the
same norm: the fraction falls toward 1/sqrt(tokens)) is flagged; flagged frames do not update
the statistics, so a sender cannot drag them along. The screen never evicts: a flag is evidence
for the coordinator (``swarm status``, ``swarm_screen_drifted_frames_total``), and the reason to
audit the sender once sampled recomputation runs live (not yet: ``docs/limits.md``).

What it cannot see: a sender that lies from its first frame (the screen learns its lie as the
norm), lies that keep the mean (a skipped layer, stale weights), and gradients, whose per-frame
means have no stable direction (cosine to their moving mean ~0.2 on average for an honest stage,
often negative): those are left to sampled recomputation (:mod:`swarm.runtime.audit`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ScreenSettings:
    decay: float = 0.9  # weight of the moving statistics' past per honest frame
    warmup: int = 20  # consecutive settled frames before any is judged
    stable_cosine: float = 0.9  # a settled frame's mean against the moving mean
    min_cosine: float = 0.5  # a frame's mean against the moving mean
    min_mean_share: float = 0.25  # a frame's mean-energy fraction against the moving fraction


class ActivationScreen:
    """The moving statistics of one boundary's received activations."""

    def __init__(self, settings: ScreenSettings = ScreenSettings()):
        self.settings = settings
        self.mean: torch.Tensor | None = None  # moving mean of the per-frame mean vectors
        self.share = 0.0  # moving fraction of a frame's energy in its mean
        self.frames = 0  # honest-looking frames learned from
        self.settled = 0  # consecutive frames whose mean stayed within stable_cosine of the moving one
        self.armed = False  # judging (after warmup settled frames)

    def observe(self, z: torch.Tensor) -> str | None:
        """Judge one frame (``... x width``); the reason it drifts, or None (and learn from it)."""
        rows = z.detach().float().reshape(-1, z.shape[-1])
        mean = rows.mean(dim=0)
        share = float(mean.pow(2).sum() / rows.pow(2).sum(dim=1).mean().clamp_min(1e-30))
        if self.mean is None or self.mean.shape != mean.shape:  # a new width (the rank grew): relearn
            self.mean, self.share, self.frames, self.settled, self.armed = mean, share, 1, 0, False
            return None
        s = self.settings
        cosine = float(torch.nn.functional.cosine_similarity(mean, self.mean, dim=0))
        if self.armed:
            if cosine < s.min_cosine:
                return f"its mean turned from the moving mean (cosine {cosine:.2f} < {s.min_cosine})"
            if share < s.min_mean_share * self.share:
                return (
                    f"its energy left the mean ({share:.3g} of it against {self.share:.3g} on average, "
                    f"< {s.min_mean_share:.0%} of that)"
                )
        else:
            self.settled = self.settled + 1 if cosine >= s.stable_cosine else 0
            self.armed = self.settled >= s.warmup
        self.mean = s.decay * self.mean + (1 - s.decay) * mean
        self.share = s.decay * self.share + (1 - s.decay) * share
        self.frames += 1
        return None
