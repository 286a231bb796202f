"""MAPL: a learned projection per stage boundary, with a factorised anchor embedding.

At boundary ``p`` both neighbouring stages hold a copy of :class:`MaplBoundary`:
``A_p`` (d x r, orthonormal columns: a point of the Stiefel manifold) and an anchor
``offset(tok) = E_fixed[tok] + E_small_p[tok] P_p`` (``E_small_p``: V x a, ``P_p``:
a x d). The sender transmits ``Z = (X - offset) A_p`` (r numbers per token); the
receiver rebuilds ``X_hat = Z A_p^T + offset``. This is lossy: the model learns to live
in the space the boundary keeps. Autograd through both maps is exact for the compressed
model, and each side's copy gets its own share of the gradient of ``A_p`` and of the
anchor; :func:`boundary_gradients` / :func:`set_boundary_gradients` let the runtime sum
them so both copies take the identical step (see :class:`swarm.core.optim.StiefelSGD`).
"""

from __future__ import annotations

import struct

import torch
from torch import nn

from swarm.codecs.base import PayloadError, check_finite
from swarm.core.model import name_seed
from swarm.core.subspace import random_basis


class MaplBoundary(nn.Module):
    """The learned map of one boundary: projection ``A`` on the Stiefel manifold plus anchor."""

    def __init__(self, fixed_embedding: torch.Tensor, rank: int, anchor_rank: int, seed: int, index: int):
        super().__init__()
        vocab, d = fixed_embedding.shape
        if not 0 < rank <= d:
            raise ValueError(f"MAPL rank {rank} must lie in (0, d={d}]")
        self.register_buffer("fixed_embedding", fixed_embedding, persistent=False)
        self.projection = nn.Parameter(random_basis(d, rank, name_seed(seed, f"mapl.{index}.projection")))
        self.projection.stiefel = True
        gen = torch.Generator().manual_seed(name_seed(seed, f"mapl.{index}.anchor"))
        self.anchor_tokens = nn.Parameter(torch.randn(vocab, anchor_rank, generator=gen) * 0.02)
        self.anchor_map = nn.Parameter(torch.zeros(anchor_rank, d))

    @property
    def width(self) -> int:
        return self.projection.shape[1]

    def offset(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fixed_embedding[tokens] + self.anchor_tokens[tokens] @ self.anchor_map

    def project(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Sender side: ``(X - offset) A`` (B x T x r)."""
        return (x - self.offset(tokens)) @ self.projection

    def lift(self, z: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Receiver side: ``Z A^T + offset`` (B x T x d)."""
        return z @ self.projection.T + self.offset(tokens)


def boundary_gradients(boundary: MaplBoundary) -> dict[str, torch.Tensor]:
    """This copy's share of the boundary's parameter gradients (zeros where it has none)."""
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in boundary.named_parameters()
    }


def set_boundary_gradients(boundary: MaplBoundary, grads: dict[str, torch.Tensor]) -> None:
    """Install the summed gradients so both copies of a boundary step identically (in the parameter's
    memory layout, whatever layout the sum came in: the optimizer's matmuls round by layout)."""
    for name, p in boundary.named_parameters():
        p.grad = torch.empty_like(p).copy_(grads[name])


def sum_gradients(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: a[name] + b[name].to(a[name].device) for name in a}


SPARSE_ROWS = "anchor_tokens"  # its gradient has rows only for the tokens a step saw


def pack_gradients(grads: dict[str, torch.Tensor]) -> bytes:
    """A gradient share as little-endian bytes, in the boundary's parameter order: float32 tensors,
    except the anchor table, sent as its touched rows (``uint32`` count, ``uint32`` row indices,
    float32 rows): a step touches a few hundred of the vocabulary's rows."""
    parts = []
    for name, g in grads.items():
        g = g.detach().cpu().float().contiguous()
        if name == SPARSE_ROWS:
            rows = (g != 0).any(dim=1).nonzero().flatten()
            parts += [struct.pack("<I", len(rows)), rows.numpy().astype("<u4").tobytes()]
            g = g[rows]
        parts.append(g.numpy().astype("<f4").tobytes())
    return b"".join(parts)


def unpack_gradients(data: bytes, boundary: MaplBoundary) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack_gradients` for ``boundary``'s parameters; checks every size, every row
    index (in range, strictly increasing) and finiteness."""
    reader = _Reader(data)
    out = {}
    for name, p in boundary.named_parameters():
        if name == SPARSE_ROWS:
            n_rows, cols = p.shape
            (count,) = struct.unpack("<I", reader.take(4, "row count"))
            if count > n_rows:
                raise PayloadError(f"MAPL gradient share: {count} rows for a {n_rows}-row anchor table")
            raw = reader.take(4 * count, "row indices")
            rows = torch.tensor(struct.unpack(f"<{count}I", raw), dtype=torch.long)
            if count and (rows[-1] >= n_rows or bool((rows[1:] <= rows[:-1]).any())):
                raise PayloadError("MAPL gradient share: row indices out of range or not increasing")
            values = _floats(reader.take(4 * count * cols, "anchor rows")).view(count, cols)
            grad = torch.zeros(n_rows, cols)
            grad[rows] = values
        else:
            grad = _floats(reader.take(4 * p.numel(), name)).view(p.shape)
        out[name] = grad.to(device=p.device, dtype=p.dtype)
    if reader.offset != len(data):
        raise PayloadError(f"MAPL gradient share has {len(data) - reader.offset} trailing bytes")
    return out


def _floats(data: bytes) -> torch.Tensor:
    if not data:
        return torch.zeros(0)
    flat = torch.frombuffer(bytearray(data), dtype=torch.float32)
    check_finite(flat, "MAPL gradient share")
    return flat


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.offset = data, 0

    def take(self, n: int, what: str) -> bytes:
        if self.offset + n > len(self.data):
            raise PayloadError(f"MAPL gradient share ends inside its {what} ({len(self.data)} bytes)")
        chunk = self.data[self.offset : self.offset + n]
        self.offset += n
        return chunk
