"""Compute emulation: a stage whose layers are calibrated waits, for benchmarks at paper scale.

An emulated stage runs what a node's CPU runs on real-size messages (decode, encode,
frames, gRPC, the schedule) and replaces what its GPU would run by waits whose lengths
come from a :class:`ComputeProfile` (a device's per-layer forward/backward time per token,
and its subspace boundary maps' time, kept in a JSON file with its source): the
transformer layers, and the boundary maps' project and lift (a d x k matrix product per
side). A 2B-parameter, 8-stage swarm then fits on a laptop while its links, codecs and
schedule behave as on the GPUs the profile describes.

An emulated stage therefore works on the wire's coordinates (``wire_width``: k for the
subspace codec, d for a dense boundary) and never builds the d-wide residual stream that
the boundary maps would. Stage 0 starts from a fixed slice of the fixed embedding plus a
fixed perturbation (so coordinates are not zero); the last stage adds a fixed perturbation
to the gradient it sends back, and its loss (no LM head) is the uniform predictor's
``ln V``. The numbers that cross the wire are therefore not a model's, but their sizes,
formats and costs are. Emulation has no weights: it refuses rotations, snapshots and MAPL
(whose boundary state is trained).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from swarm.core.profiles import ComputeProfile, boundary_sides

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


def wire_width(config: RunConfig, basis: torch.Tensor | None) -> int:
    """The width of what crosses a boundary: the subspace codec's k, or the full d."""
    if config.codec.kind == "subspace":
        if basis is None:
            raise ValueError("the subspace codec needs a basis")
        return basis.shape[1]
    return config.model.d_model


class EmulatedStage(nn.Module):
    """Stands in for :class:`swarm.core.model.Stage` (same attributes and calling convention) with
    no layers: it takes and returns the wire's coordinates, which the boundary maps pass through."""

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
        self.width = wire_width(config, basis)
        # The boundary maps a GPU would run for this stage: lift on the way in, project on the way out.
        self.boundary_sides = boundary_sides(config.codec.kind, self.is_first, self.is_last)
        self.register_buffer("fixed_embedding", fixed_embedding, persistent=False)
        self.register_buffer("basis", basis.clone() if model.constrained else None)
        gen = torch.Generator().manual_seed(config.train.seed)
        bump = torch.randn(config.train.seq_len, self.width, generator=gen) * model.init_std
        self.register_buffer("bump", bump, persistent=False)

    def forward(self, tokens: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            # a leaf that wants a gradient, so stage 0's backward (and its wait) runs as well
            start = self.fixed_embedding[tokens, : self.width] + self.bump[: tokens.shape[1]]
            x = start.requires_grad_()
        elif x is None:
            raise ValueError(f"stage [{self.start}, {self.end}) needs the incoming residual stream")
        forward_s, backward_s = self.profile.stage_seconds(self.end - self.start, tokens.numel())
        maps_s = self.profile.boundary_side_seconds(tokens.numel()) * self.boundary_sides
        return _Wait.apply(x, forward_s + maps_s, backward_s + maps_s, self.bump if self.is_last else None)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The uniform predictor's ``ln V``, with a (zero) gradient path back through the stage."""
        return output.float().mean() * 0 + math.log(self.config.vocab_size)
