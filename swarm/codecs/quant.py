"""Symmetric absmax integer quantisation with fp16 scales.

Each group of values (a row, or a fixed-size block of the flattened matrix) is sent as
integers in ``[-qmax, qmax]`` and one fp16 scale ``s >= max|group| / qmax``; every value
decodes to within ``s / 2``. Scales are rounded *up* to fp16 and the integers are computed
with that stored scale, so the bound holds exactly as decoded. Groups whose absmax exceeds
``qmax * 65504`` saturate (the scale is clamped to fp16's maximum).
"""

from __future__ import annotations

import torch

from swarm.codecs.base import PayloadError, TensorFormat, check_size
from swarm.codecs.floats import pack, unpack

_FP16_MAX = torch.finfo(torch.float16).max
_FP32_TINY = torch.finfo(torch.float32).tiny


def fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """Round non-negative fp32 scales up to the next fp16 value, saturating at fp16's maximum.

    Rounding up (never down) keeps ``|x| / stored_scale`` within the integer grid; values
    below fp16's smallest subnormal become that subnormal rather than 0, so only exact zeros
    get a zero scale.
    """
    s = scale.to(torch.float16)
    s = torch.where(s.float() < scale, torch.nextafter(s, s.new_tensor(torch.inf)), s)
    return s.clamp(max=_FP16_MAX)


def divide_by_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` divided by its fp16 ``scale``; a zero scale (an all-zero row) gives zeros."""
    return x / scale.float().clamp_min(_FP32_TINY)[:, None]


def absmax_quantise(groups: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each row of ``groups`` to int8 values in ``[-qmax, qmax]``; returns (values, fp16 scales)."""
    x = groups.float()
    scale = fp16_scale(x.abs().amax(dim=1) / qmax)
    q = torch.round(divide_by_scale(x, scale)).clamp_(-qmax, qmax)
    return q.to(torch.int8), scale


def absmax_dequantise(q: torch.Tensor, scale: torch.Tensor, qmax: int, what: str) -> torch.Tensor:
    """Inverse of :func:`absmax_quantise`; rejects integers the encoder never produces."""
    if bool((q.to(torch.int16).abs() > qmax).any()):
        raise PayloadError(f"{what}: quantised value outside [-{qmax}, {qmax}]")
    return rescale(q, scale)


def rescale(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Integers times their row's scale: the values :func:`absmax_quantise` stands for."""
    return q.float() * scale.float()[:, None]


class RowInt8Format(TensorFormat):
    """Per-row (per-token) int8 with one fp16 scale per row: ``cols + 2`` bytes per row.

    Outlier tokens only cost their own precision, but one large value in a row coarsens the
    whole row: error <= scale / 2 ~= max|row| / 254.
    """

    name = "int8_row"
    _QMAX = 127

    def encoded_size(self, rows: int, cols: int) -> int:
        return rows * (cols + 2)

    def _encode(self, x: torch.Tensor) -> bytes:
        q, scale = absmax_quantise(x, self._QMAX)
        return pack(scale, torch.float16) + pack(q, torch.int8)

    def _roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = absmax_quantise(x, self._QMAX)
        return rescale(q, scale)

    def _decode(self, data: bytes, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
        check_size(data, self.encoded_size(rows, cols), self.name)
        scale, offset = unpack(data, torch.float16, (rows,), device=device)
        q, _ = unpack(data, torch.int8, (rows, cols), offset, device)
        return absmax_dequantise(q, scale, self._QMAX, self.name)


class BlockwiseFormat(TensorFormat):
    """Blocks of ``block`` consecutive values (row-major, zero-padded) with one fp16 scale each.

    Finer scales than :class:`RowInt8Format` (an outlier only coarsens its block) at
    ``2 / block`` bytes per value of overhead; ``bits=4`` halves the payload again (two values
    per byte) at 18x coarser steps: error <= scale / 2 ~= max|block| / (2 * qmax), qmax = 127 or 7.
    Bytes: ``nblocks * (2 + block * bits / 8)`` with ``nblocks = ceil(rows * cols / block)``.
    Both ends must agree on ``block``: it is not on the wire.
    """

    def __init__(self, bits: int = 8, block: int = 64) -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if block < 1 or (bits == 4 and block % 2):
            raise ValueError(f"block must be positive (and even for 4 bits), got {block}")
        self.bits, self.block = bits, block
        self.qmax = (1 << (bits - 1)) - 1
        self.name = f"int{bits}_block"

    def _nblocks(self, rows: int, cols: int) -> int:
        return -(-rows * cols // self.block)

    def encoded_size(self, rows: int, cols: int) -> int:
        return self._nblocks(rows, cols) * (2 + self.block * self.bits // 8)

    def _quantise(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks of ``x`` (zero-padded) as integers and their fp16 scales."""
        flat = x.reshape(-1)
        flat = torch.cat([flat, flat.new_zeros(-flat.numel() % self.block)])
        return absmax_quantise(flat.view(-1, self.block), self.qmax)

    def _roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = self._quantise(x)
        return rescale(q, scale).reshape(-1)[: x.numel()].view(x.shape)

    def _encode(self, x: torch.Tensor) -> bytes:
        q, scale = self._quantise(x)
        if self.bits == 4:
            u = (q + 8).to(torch.uint8).view(-1, 2)
            q = u[:, 0] | (u[:, 1] << 4)
        return pack(scale, torch.float16) + pack(q, torch.uint8 if self.bits == 4 else torch.int8)

    def _decode(self, data: bytes, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
        nblocks = self._nblocks(rows, cols)
        check_size(data, self.encoded_size(rows, cols), self.name)
        scale, offset = unpack(data, torch.float16, (nblocks,), device=device)
        if self.bits == 4:
            packed, _ = unpack(data, torch.uint8, (nblocks * self.block // 2,), offset, device)
            q = (torch.stack([packed & 0xF, packed >> 4], dim=1).to(torch.int8) - 8).view(nblocks, self.block)
        else:
            q, _ = unpack(data, torch.int8, (nblocks, self.block), offset, device)
        flat = absmax_dequantise(q, scale, self.qmax, self.name).reshape(-1)
        return flat[: rows * cols].view(rows, cols)
