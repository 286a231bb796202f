"""Per-row top-k sparsification: only the ``k`` largest-magnitude entries of each row travel."""

from __future__ import annotations

import torch

from swarm.codecs.base import PayloadError, TensorFormat, check_size
from swarm.codecs.floats import pack, unpack


class TopKFormat(TensorFormat):
    """Keep the ``k`` largest ``|x|`` per row as (uint16 index, fp16 value): ``4 k`` bytes per row.

    Cheap when rows are dominated by a few large entries; everything else decodes to 0, so
    the error is the dropped tail. Kept values carry fp16 precision (relative error <= 2**-11;
    encode raises if one exceeds 65504). ``k = min(k_per_row, cols)``. Indices always fit
    uint16 because :data:`~swarm.codecs.base.MAX_COLS` is 65536. The encoder sends each row's
    indices in increasing order and the decoder insists on it, so duplicates are rejected.
    """

    name = "topk"

    def __init__(self, k_per_row: int) -> None:
        if k_per_row < 1:
            raise ValueError(f"k_per_row must be positive, got {k_per_row}")
        self.k_per_row = k_per_row

    def encoded_size(self, rows: int, cols: int) -> int:
        return rows * min(self.k_per_row, cols) * 4

    def _select(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's kept column indices, increasing."""
        k = min(self.k_per_row, x.shape[1])
        return x.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values

    def _encode(self, x: torch.Tensor) -> bytes:
        idx = self._select(x)
        return pack(idx, torch.uint16) + pack(x.gather(1, idx), torch.float16)

    def _roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        idx = self._select(x)
        values = x.gather(1, idx).to(torch.float16)
        return torch.zeros(x.shape, device=x.device).scatter_(1, idx, values.float())

    def _decode(self, data: bytes, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
        k = min(self.k_per_row, cols)
        check_size(data, self.encoded_size(rows, cols), self.name)
        idx, offset = unpack(data, torch.uint16, (rows, k), device=device)
        values, _ = unpack(data, torch.float16, (rows, k), offset, device)
        idx = idx.long()
        if bool((idx >= cols).any()):
            raise PayloadError(f"{self.name}: index >= {cols} columns")
        if bool((idx[:, 1:] <= idx[:, :-1]).any()):
            raise PayloadError(f"{self.name}: row indices not strictly increasing")
        return torch.zeros(rows, cols, device=device).scatter_(1, idx, values.float())
