"""Truncated-SVD format: the matrix as two thin fp16 factors."""

from __future__ import annotations

import struct

import torch

from swarm.codecs.base import PayloadError, TensorFormat, check_size
from swarm.codecs.floats import pack, unpack

_HEADER = struct.Struct("<H")


class LowRankFormat(TensorFormat):
    """Best rank-``r`` approximation ``A @ B`` (Eckart-Young), ``r = min(rank, rows, cols)``.

    Bytes: ``2 + 2 r (rows + cols)`` (a uint16 ``r`` header, then ``A`` (rows x r) and ``B``
    (r x cols) in fp16), so it pays off when ``r << min(rows, cols)``; encoding costs a full SVD.
    The Frobenius error is ``sqrt(sum of the dropped singular values squared)`` plus fp16
    rounding (~1e-3 relative). The singular values are split evenly, ``A = U sqrt(S)`` and
    ``B = sqrt(S) V^T``, so each factor spans only the square root of the matrix's dynamic
    range and fp16 overflows only when the top singular value exceeds ~4e9.
    """

    name = "lowrank"

    def __init__(self, rank: int) -> None:
        if not 1 <= rank <= 0xFFFF:
            raise ValueError(f"rank must be in [1, 65535], got {rank}")
        self.rank = rank

    def encoded_size(self, rows: int, cols: int) -> int:
        return _HEADER.size + 2 * min(self.rank, rows, cols) * (rows + cols)

    def _factors(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``A`` (rows x r) and ``B`` (r x cols) in fp32, before their cast to fp16."""
        r = min(self.rank, *x.shape)
        if r == 0:
            return x.new_zeros(x.shape[0], 0, dtype=torch.float32), x.new_zeros(
                0, x.shape[1], dtype=torch.float32
            )
        u, s, vh = torch.linalg.svd(x.float(), full_matrices=False)
        root = s[:r].sqrt()
        return u[:, :r] * root, root[:, None] * vh[:r]

    def _encode(self, x: torch.Tensor) -> bytes:
        a, b = self._factors(x)
        return _HEADER.pack(a.shape[1]) + pack(a, torch.float16) + pack(b, torch.float16)

    def _roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self._factors(x)
        a, b = a.to(torch.float16), b.to(torch.float16)
        return a.float() @ b.float()

    def _decode(self, data: bytes, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
        if len(data) < _HEADER.size:
            raise PayloadError(f"{self.name}: {len(data)} bytes is shorter than the header")
        (r,) = _HEADER.unpack_from(data)
        if r > min(rows, cols):
            raise PayloadError(f"{self.name}: rank {r} exceeds a {rows}x{cols} matrix")
        check_size(data, _HEADER.size + 2 * r * (rows + cols), self.name)
        a, offset = unpack(data, torch.float16, (rows, r), _HEADER.size, device)
        b, _ = unpack(data, torch.float16, (r, cols), offset, device)
        return a.float() @ b.float()
