"""DiLoCo's outer loop for one replica of a stage: pseudo-gradients out, one Nesterov step in.

Between syncs a replica steps its own optimizer on its own microbatches. At a sync it sends
its pseudo-gradient, the weights at the last sync minus its weights now (its trainable
parameters only: for a subspace-constrained stage that is ``W'``, ``k x in``), rounded to the
run's :class:`~swarm.runtime.sync_formats.SyncFormat`; what the rounding lost is added to the
next sync's pseudo-gradient (error feedback). Every replica then applies the same outer step
to the same averaged pseudo-gradient from the same weights at the last sync, in the same
order, so all replicas hold the same weights after it (bit for bit on devices of one kind):

    m <- mu m + delta;  w <- w_sync - lr (delta + mu m);  w_sync <- w

(Nesterov momentum as ``torch.optim.SGD(nesterov=True)``). With ``lr = 1`` and ``mu = 0`` the
outer step sets every replica to the average of their weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm.codecs.base import PayloadError
from swarm.core.config import ReplicaSyncConfig
from swarm.runtime.sync_formats import SyncFormat, sync_format


def sync_due(sync: ReplicaSyncConfig, step: int, steps: int, cut: bool) -> bool:
    """Whether replicas sync after ``step`` of ``steps``: every ``sync.every`` steps, at a
    checkpoint ``cut`` (the snapshot then holds the replicas' common weights) and at the end."""
    return (step + 1) % sync.every == 0 or cut or step == steps - 1


class OuterStep:
    """The outer state of one replica over ``params`` (its trainable parameters, in order)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], sync: ReplicaSyncConfig):
        self.params = list(params)
        self.lr, self.mu = sync.outer_lr, sync.outer_momentum
        self.format: SyncFormat = sync_format(sync.format)
        with torch.no_grad():
            self.anchor = [p.detach().clone() for p in self.params]  # the weights at the last sync
        self.momentum = [torch.zeros_like(p) for p in self.params] if self.mu else None
        self.residual = [torch.zeros(p.shape, dtype=torch.float64) for p in self.params]

    @torch.no_grad()
    def pseudo_gradient(self) -> list[torch.Tensor]:
        """This replica's pseudo-gradient plus the fed-back residual, rounded to the format
        (float64, on the CPU, one tensor per parameter); the new residual is kept."""
        sent = []
        for p, anchor, residual in zip(self.params, self.anchor, self.residual, strict=True):
            exact = (anchor - p).to("cpu", torch.float64) + residual
            rounded = self.format.roundtrip(exact)
            residual.copy_(exact - rounded)
            sent.append(rounded)
        return sent

    @torch.no_grad()
    def apply(self, averaged: Sequence[torch.Tensor]) -> None:
        """The outer step on the replicas' averaged pseudo-gradient (the same on every replica)."""
        momenta = self.momentum or [None] * len(self.params)
        for p, anchor, m, delta in zip(self.params, self.anchor, momenta, averaged, strict=True):
            delta = delta.to(p.device, p.dtype)
            if m is not None:  # one elementwise operation at a time: no fused multiply-add
                m.mul_(self.mu).add_(delta)
                delta = delta + m * self.mu
            p.copy_(anchor - delta * self.lr)
            anchor.copy_(p)

    def state_dict(self) -> dict:
        """The momentum and the error-feedback residual (host copies). The anchor is not in it: state
        is saved at checkpoint cuts, which always sync, so there the anchor is the weights."""
        momenta = None if self.momentum is None else [m.detach().cpu().clone() for m in self.momentum]
        return {"momentum": momenta, "residual": [r.clone() for r in self.residual]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a :meth:`state_dict` of the same parameters; the anchor becomes the weights now."""
        momenta, residuals = state.get("momentum"), state.get("residual")
        if (momenta is None) != (self.momentum is None) or not isinstance(residuals, list):
            raise PayloadError("outer-step state does not match the run's outer momentum")
        pairs = [(self.residual, residuals)] + ([(self.momentum, momenta)] if momenta is not None else [])
        for mine, saved in pairs:
            if len(saved) != len(mine) or any(
                not isinstance(t, torch.Tensor) or t.shape != m.shape or not torch.isfinite(t).all()
                for t, m in zip(saved, mine, strict=False)
            ):
                raise PayloadError("outer-step state: wrong shapes or non-finite values")
            for m, t in zip(mine, saved, strict=True):
                m.copy_(t)
        for p, anchor in zip(self.params, self.anchor, strict=True):
            anchor.copy_(p)
