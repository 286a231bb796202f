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

Overlapped (Streaming DiLoCo's overlap, ``replica_sync.overlap`` steps): the all-reduce runs while
the replica takes its next inner steps, and the outer step lands on the weights those steps
reached: ``w <- w + (w_global - w_sent)``, where ``w_global`` is the outer step's result from the
weights at the last sync and ``w_sent`` the weights the pseudo-gradient was taken from. The
weights at the last sync become ``w_global`` (the same on every replica); the replicas' weights
differ by their own steps since the send until the next sync takes them in.
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
        self._sent: list[torch.Tensor] | None = None  # the weights an overlapped send was taken from
        self._residual_before: list[torch.Tensor] | None = None

    @torch.no_grad()
    def pseudo_gradient(self, overlapped: bool = False) -> list[torch.Tensor]:
        """This replica's pseudo-gradient plus the fed-back residual, rounded to the format
        (float64, on the CPU, one tensor per parameter); the new residual is kept. ``overlapped``:
        inner steps will run before :meth:`apply`, which then keeps their progress."""
        if overlapped:  # until apply, state_dict describes the replica as if nothing was sent
            self._sent = [p.detach().clone() for p in self.params]
            self._residual_before = [r.clone() for r in self.residual]
        sent = []
        for p, anchor, residual in zip(self.params, self.anchor, self.residual, strict=True):
            exact = (anchor - p).to("cpu", torch.float64) + residual
            rounded = self.format.roundtrip(exact)
            residual.copy_(exact - rounded)
            sent.append(rounded)
        return sent

    @property
    def pending(self) -> bool:
        """Whether an overlapped pseudo-gradient was sent and its outer step not applied yet."""
        return self._sent is not None

    @torch.no_grad()
    def apply(self, averaged: Sequence[torch.Tensor]) -> None:
        """The outer step on the replicas' averaged pseudo-gradient (the same on every replica);
        after an overlapped send it keeps the inner steps taken since."""
        n = len(self.params)
        momenta = self.momentum or [None] * n
        sent = self._sent or [None] * n
        rows = zip(self.params, self.anchor, momenta, averaged, sent, strict=True)
        for p, anchor, m, delta, w_sent in rows:
            delta = delta.to(p.device, p.dtype)
            if m is not None:  # one elementwise operation at a time: no fused multiply-add
                m.mul_(self.mu).add_(delta)
                delta = delta + m * self.mu
            anchor.sub_(delta * self.lr)
            if w_sent is None:
                p.copy_(anchor)
            else:
                p.add_(anchor - w_sent)
        self._sent = self._residual_before = None

    def state_dict(self) -> dict:
        """The momentum, the error-feedback residual and the weights at the last sync (host copies;
        None where they equal the weights, as at checkpoint cuts, which always sync). With an
        overlapped send pending: the residual from before it (a replica resumed from this state
        sends its progress since the last sync afresh)."""
        momenta = None if self.momentum is None else [m.detach().cpu().clone() for m in self.momentum]
        residual = self._residual_before or self.residual
        at_weights = all(torch.equal(a, p) for a, p in zip(self.anchor, self.params, strict=True))
        anchor = None if at_weights else [a.detach().cpu().clone() for a in self.anchor]
        return {"momentum": momenta, "residual": [r.clone() for r in residual], "anchor": anchor}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a :meth:`state_dict` of the same parameters (the weights at the last sync: the
        weights now where it holds none)."""
        momenta, residuals, anchors = state.get("momentum"), state.get("residual"), state.get("anchor")
        if (momenta is None) != (self.momentum is None) or not isinstance(residuals, list):
            raise PayloadError("outer-step state does not match the run's outer momentum")
        pairs = [(self.residual, residuals)]
        pairs += [(self.momentum, momenta)] if momenta is not None else []
        pairs += [(self.anchor, anchors)] if anchors is not None else []
        for mine, saved in pairs:
            if (
                not isinstance(saved, list)
                or len(saved) != len(mine)
                or any(
                    not isinstance(t, torch.Tensor) or t.shape != m.shape or not torch.isfinite(t).all()
                    for t, m in zip(saved, mine, strict=False)
                )
            ):
                raise PayloadError("outer-step state: wrong shapes or non-finite values")
            for m, t in zip(mine, saved, strict=True):
                m.copy_(t)
        if anchors is None:
            for p, anchor in zip(self.params, self.anchor, strict=True):
                anchor.copy_(p)
        self._sent = self._residual_before = None
