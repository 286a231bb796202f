"""Optimizers of a stage: AdamW for Euclidean parameters, a Riemannian step for Stiefel ones.

The subspace constraint needs no special optimizer (it is a reparametrisation, see
:mod:`swarm.core.model`). MAPL projections must stay orthonormal: :class:`StiefelSGD` takes
the Riemannian gradient ``xi = G - A sym(A^T G)``, keeps a momentum in the tangent
space, and retracts with a sign-fixed QR, so ``A^T A = I`` holds after every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from swarm.core.config import TrainConfig


def tangent_projection(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Project ``g`` onto the tangent space of the Stiefel manifold at ``a``."""
    s = a.T @ g
    return g - a @ ((s + s.T) / 2)


def qr_retraction(y: torch.Tensor) -> torch.Tensor:
    """The Q factor of ``y`` with columns sign-fixed so the retraction is continuous."""
    q, r = torch.linalg.qr(y)
    return q * torch.sign(torch.sign(torch.diagonal(r)) + 0.5)


class StiefelSGD(torch.optim.Optimizer):
    """Riemannian SGD with momentum on matrices with orthonormal columns.

    The step is normalised by the RMS of the momentum, so ``lr`` is roughly how far each
    entry moves per step, independent of the gradient's scale (which, for a boundary
    projection, changes by orders of magnitude during training).
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, eps: float = 1e-12):
        super().__init__(params, {"lr": lr, "momentum": momentum, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for a in group["params"]:
                if a.grad is None:
                    continue
                xi = tangent_projection(a, a.grad)
                state = self.state[a]
                buf = state.get("momentum")
                buf = xi if buf is None else group["momentum"] * tangent_projection(a, buf) + xi
                state["momentum"] = buf
                rms = buf.pow(2).mean().sqrt()
                a.copy_(qr_retraction(a - group["lr"] * buf / (rms + group["eps"])))


@dataclass
class StageOptimizer:
    """The optimizers of one stage, stepped together under one learning-rate schedule."""

    adamw: torch.optim.AdamW | None
    stiefel: StiefelSGD | None
    config: TrainConfig

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.adamw, self.stiefel) if o is not None]

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to ``min_lr_ratio``: the factor applied to each base lr."""
        c = self.config
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        progress = min(1.0, (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps))
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def step(self, step: int, parameters: list[nn.Parameter]) -> float:
        """Clip this stage's gradients, step every optimizer at the scheduled lr; returns the grad norm."""
        grads = [p for p in parameters if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, self.config.grad_clip) if grads else torch.tensor(0.0)
        factor = self.lr_at(step)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * factor
            opt.step()
        return float(norm)

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)


def build_optimizer(modules: list[nn.Module], config: TrainConfig) -> StageOptimizer:
    """AdamW (decay on matrices only) for Euclidean parameters, StiefelSGD for ``stiefel`` ones."""
    decay, no_decay, stiefel = [], [], []
    for module in modules:
        for name, p in module.named_parameters():
            if getattr(p, "stiefel", False):
                stiefel.append(p)
            elif p.dim() < 2 or name.endswith("embed.low"):
                no_decay.append(p)
            else:
                decay.append(p)
    adamw = None
    if decay or no_decay:
        groups = [
            {"params": decay, "weight_decay": config.weight_decay, "base_lr": config.lr},
            {"params": no_decay, "weight_decay": 0.0, "base_lr": config.lr},
        ]
        adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr, betas=(0.9, 0.95))
    sgd = None
    if stiefel:
        sgd = StiefelSGD([{"params": stiefel, "base_lr": config.stiefel_lr}], lr=config.stiefel_lr)
    return StageOptimizer(adamw, sgd, config)
