"""How a replica's pseudo-gradient travels in an outer-step round: ``fp64``, ``fp32``, ``bf16`` or ``int8``.

Each format maps a float64 vector to bytes (:meth:`SyncFormat.encode`) and back
(:meth:`SyncFormat.decode`), deterministically, and is *idempotent*: what comes back re-encodes
to the same values bit for bit, even cut into pieces that start at multiples of
:attr:`SyncFormat.alignment`. A sender rounds its vector once (:meth:`SyncFormat.roundtrip`,
keeping the rounding error for error feedback); every such cut that hivemind's all-reduce makes
of it then travels losslessly.

``int8`` stores each block of :data:`BLOCK` values as codes in [-127, 127] times a power of two
(one exponent byte per block): re-quantising a rounded block, or a piece of one, finds a
power-of-two scale no larger, by which every code stays an integer. A block holding a
non-finite value is marked so and decodes to NaN, so a receiver's screening refuses it.
"""

from __future__ import annotations

import math

import torch

BLOCK = 256  # int8 values sharing one exponent
_NON_FINITE = -128  # the exponent byte of a block that held NaN or Inf
_MIN_EXP, _MAX_EXP = -127, 127


class SyncFormat:
    """A wire format for pseudo-gradients (``name``: as in ``replica_sync.format``)."""

    name = ""
    alignment = 1  # pieces starting at multiples of this many values re-encode losslessly

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The bytes (a uint8 tensor) of the float vector ``x``."""
        raise NotImplementedError

    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        """The ``numel`` float64 values of ``data``; ``ValueError`` if it does not hold that many."""
        raise NotImplementedError

    def wire_bytes(self, numel: int) -> int:
        """Bytes that ``numel`` values take on the wire."""
        raise NotImplementedError

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (any shape, on the CPU) as it arrives after one trip: float64, the shape of ``x``."""
        flat = x.detach().reshape(-1).to(torch.float64)
        return self.decode(self.encode(flat), flat.numel()).reshape(x.shape)


def _check_size(data: torch.Tensor, expected: int, what: str) -> None:
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != expected:
        raise ValueError(f"{what}: {data.numel()} {data.dtype} bytes, expected {expected} uint8")


class _Cast(SyncFormat):
    """A plain float dtype on the wire."""

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().reshape(-1).to(self.dtype).contiguous().view(torch.uint8)

    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        _check_size(data, self.wire_bytes(numel), self.name)
        return data.contiguous().view(self.dtype).to(torch.float64)

    def wire_bytes(self, numel: int) -> int:
        return numel * self.itemsize


class _Int8Blocks(SyncFormat):
    """int8 codes with one power-of-two scale per block (see the module docstring)."""

    name = "int8"
    alignment = BLOCK

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().reshape(-1).to(torch.float64)
        blocks = -(-x.numel() // BLOCK)
        padded = torch.zeros(blocks * BLOCK, dtype=torch.float64)
        padded[: x.numel()] = x
        rows = padded.view(blocks, BLOCK)
        finite = torch.isfinite(rows).all(dim=1)
        rows = torch.where(finite[:, None], rows, torch.zeros_like(rows))
        absmax = rows.abs().amax(dim=1)
        exponent = torch.where(absmax > 0, _block_exponents(absmax), _MIN_EXP)
        codes = torch.round(torch.ldexp(rows, -exponent[:, None].double())).clamp(-127, 127).to(torch.int8)
        exponent = torch.where(finite, exponent, torch.full_like(exponent, _NON_FINITE))
        return torch.cat([exponent.to(torch.int8), codes.reshape(-1)[: x.numel()]]).view(torch.uint8)

    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        _check_size(data, self.wire_bytes(numel), "int8")
        signed = data.view(torch.int8)
        blocks = -(-numel // BLOCK)
        exponent, codes = signed[:blocks].long(), signed[blocks:].double()
        per_value = exponent.repeat_interleave(BLOCK)[:numel]
        values = torch.ldexp(codes, per_value.double())
        return torch.where(per_value == _NON_FINITE, torch.full_like(values, math.nan), values)

    def wire_bytes(self, numel: int) -> int:
        return numel + -(-numel // BLOCK)


def _block_exponents(absmax: torch.Tensor) -> torch.Tensor:
    """Per block, the least ``e`` in [-127, 127] with ``absmax <= 127 * 2**e`` (int64; at most 127:
    larger values saturate)."""
    _, estimate = torch.frexp(absmax / 127)  # absmax / 127 < 2**estimate
    e = estimate.long().clamp(_MIN_EXP, _MAX_EXP)
    # frexp's estimate can be one too high (exact powers of two, the division's rounding): step
    # down while the bound still holds, exactly (ldexp by an integer is exact).
    lower = (e - 1).clamp_min(_MIN_EXP)
    fits_lower = absmax <= torch.ldexp(torch.full_like(absmax, 127.0), lower.double())
    e = torch.where(fits_lower & (e > _MIN_EXP), lower, e)
    too_small = absmax > torch.ldexp(torch.full_like(absmax, 127.0), e.double())
    return torch.where(too_small, (e + 1).clamp_max(_MAX_EXP), e)


FORMATS: dict[str, SyncFormat] = {
    "fp64": _Cast("fp64", torch.float64),
    "fp32": _Cast("fp32", torch.float32),
    "bf16": _Cast("bf16", torch.bfloat16),
    "int8": _Int8Blocks(),
}


def sync_format(name: str) -> SyncFormat:
    """The format ``name`` (one of :data:`FORMATS`)."""
    if name not in FORMATS:
        raise ValueError(f"unknown pseudo-gradient format {name!r}; choose from {sorted(FORMATS)}")
    return FORMATS[name]
