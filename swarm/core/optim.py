"""Optimizers of a stage: AdamW for Euclidean parameters, a Riemannian step for Stiefel ones.

The subspace constraint needs no special optimizer (it is a reparametrisation, see
:mod:`swarm.core.model`). MAPL projections must stay orthonormal: both Stiefel optimizers
take the Riemannian gradient ``xi = G - A sym(A^T G)``, keep their first moment in the
tangent space (transported by re-projection onto the current point's tangent space), and
retract with a sign-fixed QR, so ``A^T A = I`` holds after every step. Both are
deterministic functions of the (summed) gradient: the two copies of a boundary step alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from swarm.core.config import TrainConfig
from swarm.core.model import Stage, lr_multipliers, parameter_kinds


def tangent_projection(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Project ``g`` onto the tangent space of the Stiefel manifold at ``a``."""
    s = a.T @ g
    return g - a @ ((s + s.T) / 2)


def qr_retraction(y: torch.Tensor) -> torch.Tensor:
    """The Q factor of ``y`` with columns sign-fixed so the retraction is continuous."""
    q, r = torch.linalg.qr(y)
    return q * torch.sign(torch.sign(torch.diagonal(r)) + 0.5)


class _StiefelOptimizer(torch.optim.Optimizer):
    """A Riemannian step ``A <- qr(A - update)``; subclasses compute the tangent update (lr included)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for a in group["params"]:
                if a.grad is not None:
                    update = self._update(a, tangent_projection(a, a.grad), self.state[a], group)
                    a.copy_(qr_retraction(a - update))

    def _update(self, a: torch.Tensor, xi: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        raise NotImplementedError


class StiefelSGD(_StiefelOptimizer):
    """Riemannian SGD with momentum on matrices with orthonormal columns.

    The step is normalised by the RMS of the momentum, so ``lr`` is roughly how far each
    entry moves per step, independent of the gradient's scale (which, for a boundary
    projection, changes by orders of magnitude during training).
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, eps: float = 1e-12):
        super().__init__(params, {"lr": lr, "momentum": momentum, "eps": eps})

    def _update(self, a: torch.Tensor, xi: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        buf = state.get("momentum")
        buf = xi if buf is None else group["momentum"] * tangent_projection(a, buf) + xi
        state["momentum"] = buf
        return group["lr"] * buf / (buf.pow(2).mean().sqrt() + group["eps"])


class StiefelAdam(_StiefelOptimizer):
    """Riemannian Adam on matrices with orthonormal columns (Becigneul & Ganea, 2019).

    The first moment is an EMA of Riemannian gradients, re-projected onto the tangent space
    at each new point; the second moment is one scalar per matrix (the EMA of the gradient's
    mean square: the manifold's metric, so the direction stays tangent and invariant to
    rotations of the columns). Both are bias-corrected as in Adam. Unlike :class:`StiefelSGD`,
    the step shrinks when successive gradients disagree (near an optimum, or under noise):
    ``lr`` is about the largest RMS step per entry, not the step. ``betas[1]`` is short (0.95,
    as the stage's AdamW): a boundary gradient's scale falls by orders of magnitude during
    training, and a long memory of early, larger gradients would stall the projection.
    """

    def __init__(
        self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-12
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    def _update(self, a: torch.Tensor, xi: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        beta1, beta2 = group["betas"]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(a), exp_avg_sq=a.new_zeros(()))
        state["step"] += 1
        t = state["step"]
        state["exp_avg"] = beta1 * tangent_projection(a, state["exp_avg"]) + (1 - beta1) * xi
        state["exp_avg_sq"] = beta2 * state["exp_avg_sq"] + (1 - beta2) * xi.pow(2).mean()
        denom = state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**t) + group["eps"]
        return group["lr"] * state["exp_avg"] / (1 - beta1**t) / denom


_STIEFEL_CLASSES: dict[str, type[_StiefelOptimizer]] = {"sgd": StiefelSGD, "adam": StiefelAdam}


@dataclass
class StageOptimizer:
    """The optimizers of one stage, stepped together under one learning-rate schedule."""

    adamw: torch.optim.AdamW | None
    stiefel: StiefelSGD | StiefelAdam | None
    config: TrainConfig
    muon: torch.optim.Muon | None = None  # the layers' matrices when ``train.optimizer == "muon"``

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer, in the order snapshots store their states."""
        return [o for o in (self.adamw, self.muon, self.stiefel) if o is not None]

    @property
    def state(self) -> dict:
        """The per-parameter state of the Euclidean optimizers (what a subspace rotation transforms)."""
        return {p: s for o in (self.adamw, self.muon) if o is not None for p, s in o.state.items()}

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
    """Per-group learning rates follow the model's parametrisation (:func:`swarm.core.model.lr_multipliers`),
    one group per optimizer, decay and multiplier. AdamW (decay on matrices only) for Euclidean
    parameters, except, with ``train.optimizer == "muon"``, the layers' matrices (attention, MLP,
    residual writes ``W'``): torch's Muon with its update scaled to AdamW's RMS, so the same lr and
    multipliers apply. ``stiefel`` parameters take ``config.stiefel_optimizer`` at ``config.stiefel_lr``."""
    groups: dict[tuple[str, bool, float], list[nn.Parameter]] = {}
    stiefel = []
    for module in modules:
        kinds = parameter_kinds(module) if isinstance(module, Stage) else {}
        multipliers = lr_multipliers(module) if isinstance(module, Stage) else {}
        for name, p in module.named_parameters():
            if getattr(p, "stiefel", False):
                stiefel.append(p)
                continue
            decays = p.dim() >= 2 and not name.endswith("embed.low")
            muon = config.optimizer == "muon" and kinds.get(name) in ("hidden", "write")
            groups.setdefault(("muon" if muon else "adamw", decays, multipliers.get(name, 1.0)), []).append(p)

    def param_groups(kind: str) -> list[dict]:
        chosen = sorted((key for key in groups if key[0] == kind), key=lambda key: (not key[1], key[2]))
        return [
            {
                "params": groups[key],
                "weight_decay": config.weight_decay if key[1] else 0.0,
                "base_lr": config.lr * key[2],
            }
            for key in chosen
        ]

    adamw = muon = riemannian = None
    if param_groups("adamw"):
        adamw = torch.optim.AdamW(param_groups("adamw"), lr=config.lr, betas=(0.9, 0.95))
    if param_groups("muon"):
        muon = torch.optim.Muon(param_groups("muon"), lr=config.lr, adjust_lr_fn="match_rms_adamw")
    if stiefel:
        kind = _STIEFEL_CLASSES[config.stiefel_optimizer]
        riemannian = kind([{"params": stiefel, "base_lr": config.stiefel_lr}], lr=config.stiefel_lr)
    return StageOptimizer(adamw, riemannian, config, muon)
