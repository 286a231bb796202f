"""Compute emulation: a stage whose layers are calibrated waits, for benchmarks at paper scale.

An emulated stage runs everything a real one does on real-size tensors (decode, the
boundary map's lift and project with autograd, encode, frames, gRPC) except its
transformer layers: their forward and backward are replaced by waits whose lengths come
from a :class:`ComputeProfile` (a device's per-layer forward/backward time per token,
kept in a JSON file with its source). A 2B-parameter, 8-stage swarm then fits on a
laptop while its links, codecs and schedule behave as on the GPUs the profile describes.

The emulated layers pass the residual stream through unchanged (stage 0 starts from the
fixed embedding plus a fixed perturbation, so coordinates are not zero) and add a fixed
perturbation to the gradient the last stage sends back (whose loss, with no LM head, is
the uniform predictor's ``ln V``). The numbers that cross the wire are therefore not a
model's, but their sizes, formats and costs are. Emulation has no weights: it refuses
rotations, snapshots and MAPL (whose boundary state is trained).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from swarm.core.profiles import ComputeProfile

if TYPE_CHECKING:
    from swarm.core.config import RunConfig


class _Wait(torch.autograd.Function):
    """Identity whose forward and backward take the profile's time; the backward adds ``bump``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float, bump: torch.Tensor | None):
        time.sleep(forward_s)
        ctx.backward_s, ctx.bump = backward_s, bump
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.backward_s)
        if ctx.bump is not None:
            grad = grad + ctx.bump[: grad.shape[1]].to(grad.dtype)
        return grad, None, None, None


class EmulatedStage(nn.Module):
    """Stands in for :class:`swarm.core.model.Stage`: same attributes and calling convention, no layers."""

    def __init__(
        self,
        config: RunConfig,
        start: int,
        end: int,
        fixed_embedding: torch.Tensor,
        basis: torch.Tensor | None,
        profile: ComputeProfile,
    ):
        super().__init__()
        model = config.model
        self.config, self.start, self.end, self.profile = model, start, end, profile
        self.is_first, self.is_last = start == 0, end == model.n_layers
        self.register_buffer("fixed_embedding", fixed_embedding, persistent=False)
        self.register_buffer("basis", basis.clone() if model.constrained else None)
        gen = torch.Generator().manual_seed(config.train.seed)
        bump = torch.randn(config.train.seq_len, model.d_model, generator=gen) * model.init_std
        self.register_buffer("bump", bump, persistent=False)

    def forward(self, tokens: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            # a leaf that wants a gradient, so stage 0's backward (and its wait) runs as well
            x = (self.fixed_embedding[tokens] + self.bump[: tokens.shape[1]]).requires_grad_()
        elif x is None:
            raise ValueError(f"stage [{self.start}, {self.end}) needs the incoming residual stream")
        forward_s, backward_s = self.profile.stage_seconds(self.end - self.start, tokens.numel())
        x = _Wait.apply(x, forward_s, backward_s, self.bump if self.is_last else None)
        if self.is_last:  # a uniform prediction: loss ln V, and a gradient path back to x
            return x.mean(-1, keepdim=True).expand(*x.shape[:-1], self.config.vocab_size)
        return x
