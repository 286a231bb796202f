"""Snapshots in fewer bytes: Adam's moments in 8 bits for transfer (``checkpoint.moments = "int8"``).

A stage's snapshot is ~3x its weights in fp32 (the weights and Adam's two moments). The moments
only steer the next updates, so they travel in 8 bits with one fp32 scale per block of
:data:`BLOCK` values: ``exp_avg`` signed (absmax / 127 per block, rounded to nearest),
``exp_avg_sq`` as its square root (max / 255 per block, rounded *up*, so no nonzero second moment
becomes zero and inflates an update by 1/eps). Weights, buffers and every other state stay exact;
the snapshot shrinks to about half. The fp32 master weights cannot be rebuilt losslessly from
bf16 ones (bf16 drops 16 mantissa bits), so weights are never compacted.
"""

from __future__ import annotations

import math
from typing import Any

import torch

BLOCK = 256
_SIGNED, _ROOT = "exp_avg", "exp_avg_sq"  # Adam's first and second moments


def _blocks(x: torch.Tensor) -> torch.Tensor:
    flat = x.detach().reshape(-1).float()
    pad = (-flat.numel()) % BLOCK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)


def encode(x: torch.Tensor, root: bool) -> dict[str, Any]:
    """``x`` in 8 bits per value: signed absmax blocks, or (``root``) its nonnegative square root."""
    blocks = _blocks(x.clamp_min(0).sqrt() if root else x)
    top = blocks.abs().amax(dim=1, keepdim=True)
    levels = 255.0 if root else 127.0
    scale = torch.where(top > 0, top / levels, torch.ones_like(top))
    if root:
        q = torch.ceil(blocks / scale).clamp(0, 255).to(torch.uint8)
    else:
        q = torch.round(blocks / scale).clamp(-127, 127).to(torch.int8)
    return {"q": q, "scale": scale.squeeze(1), "shape": list(x.shape), "dtype": str(x.dtype), "root": root}


def decode(packed: dict[str, Any]) -> torch.Tensor:
    """The tensor :func:`encode` packed (to within its 8-bit resolution)."""
    values = packed["q"].float() * packed["scale"].unsqueeze(1)
    if packed["root"]:
        values = values.square()
    n = math.prod(packed["shape"])
    dtype = getattr(torch, packed["dtype"].removeprefix("torch."))
    return values.reshape(-1)[:n].reshape(packed["shape"]).to(dtype)


def compact_moments(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a :func:`~swarm.io.checkpoint.capture` with Adam's moments in 8 bits."""
    optimizers = []
    for opt in state["optimizers"]:
        if not isinstance(opt.get("state"), dict):
            optimizers.append(opt)
            continue
        per_param = {
            key: {
                name: encode(value, name == _ROOT)
                if name in (_SIGNED, _ROOT) and value.is_floating_point()
                else value
                for name, value in param_state.items()
            }
            for key, param_state in opt["state"].items()
        }
        optimizers.append({**opt, "state": per_param})
    return {**state, "optimizers": optimizers, "moments": "int8"}


def expand_moments(state: dict[str, Any]) -> dict[str, Any]:
    """The capture :func:`compact_moments` packed, moments back in their dtype (as is if not packed)."""
    if state.get("moments") != "int8":
        return state
    optimizers = [
        opt
        if not isinstance(opt.get("state"), dict)
        else {
            **opt,
            "state": {
                key: {
                    name: decode(v) if isinstance(v, dict) and "q" in v else v
                    for name, v in param_state.items()
                }
                for key, param_state in opt["state"].items()
            },
        }
        for opt in state["optimizers"]
    ]
    return {k: v for k, v in state.items() if k != "moments"} | {"optimizers": optimizers}
