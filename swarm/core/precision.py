"""Mixed precision: what a stage's layers compute in, around full-precision master weights.

``train.precision = "bf16"`` runs each stage's layers under ``torch.autocast`` in bfloat16 on
the stage's device: matmuls and attention in bf16, norms and the residual stream in fp32.
Parameters, their gradients and the optimizer state stay in the stage's dtype (fp32). What the
Subspace Networks constraint rests on stays out of autocast: the boundary maps (project, lift)
run outside it, and the layers' products with the basis ``U`` switch it off
(:func:`basis_product`), so a residual write lies in ``col(U)`` to fp32 rounding, as in an fp32
run, and a boundary still reconstructs the residual stream. The backward pass runs outside
autocast, in the dtypes the forward chose (PyTorch's recommendation). The wire formats are the
codec's: coordinates are decoded to the stage's dtype whatever the layers compute in.
"""

from __future__ import annotations

import contextlib

import torch

from swarm.core.config import PRECISIONS


def layer_autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a stage's layers run in: bf16 autocast on ``device``'s type, nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise ValueError(f"precision {precision!r} must be one of {PRECISIONS}")


def check_master_dtype(precision: str, dtype: torch.dtype) -> None:
    """Refuse a stage dtype that mixed precision does not apply to (autocast leaves float64 alone)."""
    if precision != "fp32" and dtype != torch.float32:
        raise ValueError(
            f"train.precision={precision!r} keeps float32 master weights; the stage dtype is {dtype} "
            "(exactness checks in float64 use precision 'fp32')"
        )


def basis_product(y: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``y U^T`` in the basis' dtype, also under autocast: its rows lie in ``col(U)`` to the rounding
    of that dtype, as in a full-precision run (a bf16 copy of ``U`` spans a slightly different subspace)."""
    if not torch.is_autocast_enabled(y.device.type):
        return y @ basis.T
    with torch.autocast(device_type=y.device.type, enabled=False):
        return y.to(basis.dtype) @ basis.T
