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

*PCA initialisation* (``codec.mapl_pca_steps = N``): during the first ``N`` steps the sender
accumulates the second moment of its centred inputs ``X - offset`` (float64, d x d); after step
``N`` it replaces ``A_p`` by the top-``r`` eigenvectors and ships them (:func:`pack_projection`)
to the receiver, which validates (:func:`unpack_projection`) and installs them, so both copies
switch at the same step, bit for bit.
"""

from __future__ import annotations

import struct

import torch
from torch import nn

from swarm.codecs.base import PayloadError, check_finite
from swarm.core.model import name_seed
from swarm.core.subspace import random_basis

TRAINING_ONLY = frozenset({"input_moment"})  # state snapshots keep, trained models leave out


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

    def track_input_moment(self) -> None:
        """Sender side, for the PCA initialisation: start the float64 second moment of the centred
        inputs on the projection's device (a buffer, so a stage snapshot keeps it)."""
        d = self.projection.shape[0]
        self.register_buffer("input_moment", self.projection.new_zeros(d, d, dtype=torch.float64))

    def resize_input_moment(self, shape: torch.Size) -> None:
        """Give the input moment ``shape``: d x d during the warm-up, empty once it has been used
        (it is not needed after the switch, and is d*d*8 bytes in every snapshot)."""
        self.input_moment = self.input_moment.new_zeros(shape)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add one microbatch's centred inputs ``X - offset`` (B x T x d) to the input moment."""
        centred = (x - self.offset(tokens)).reshape(-1, x.shape[-1]).double()
        self.input_moment.addmm_(centred.T, centred)

    def principal_directions(self) -> torch.Tensor:
        """The top-``r`` eigenvectors of the input moment (float64, d x r, by falling eigenvalue),
        each signed so that its entry of largest magnitude is positive."""
        _, vectors = torch.linalg.eigh(self.input_moment)
        top = vectors[:, -self.width :].flip(1)
        largest = top.abs().argmax(dim=0)
        return top * torch.sign(top[largest, torch.arange(self.width, device=top.device)])

    @torch.no_grad()
    def replace_projection(self, a: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> None:
        """Install ``a`` as the projection and drop its optimizer state (momentum, moments): they
        belong to the old point of the manifold."""
        self.projection.copy_(a)
        if optimizer is not None:
            optimizer.state.pop(self.projection, None)

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


PROJECTION_TOLERANCE = 1e-4  # largest |A^T A - I| entry a shipped projection may have


def pack_projection(a: torch.Tensor) -> bytes:
    """A projection as little-endian bytes: ``uint32`` rows and columns, then float64 entries
    (exact for every working dtype: both copies install the same values)."""
    rows, cols = a.shape
    entries = a.detach().cpu().double().contiguous().numpy().astype("<f8")
    return struct.pack("<II", rows, cols) + entries.tobytes()


def unpack_projection(data: bytes, boundary: MaplBoundary) -> torch.Tensor:
    """Inverse of :func:`pack_projection` (float64, on the host); checks that the matrix has the
    boundary's shape, is finite and has orthonormal columns (to :data:`PROJECTION_TOLERANCE`)."""
    expected = tuple(boundary.projection.shape)
    if len(data) < 8:
        raise PayloadError(f"MAPL projection of {len(data)} bytes has no shape header")
    shape = struct.unpack("<II", data[:8])
    if shape != expected:
        raise PayloadError(
            f"MAPL projection of shape {shape[0]}x{shape[1]} for a boundary of {expected[0]}x{expected[1]}"
        )
    if len(data) != 8 + 8 * shape[0] * shape[1]:
        raise PayloadError(f"MAPL projection of shape {shape[0]}x{shape[1]} in {len(data)} bytes")
    a = torch.frombuffer(bytearray(data[8:]), dtype=torch.float64).view(shape)
    check_finite(a, "MAPL projection")
    error = (a.T @ a - torch.eye(shape[1], dtype=torch.float64)).abs().max().item()
    if error > PROJECTION_TOLERANCE:
        raise PayloadError(
            f"MAPL projection is not orthonormal: max |A^T A - I| = {error:.2e} > {PROJECTION_TOLERANCE:g}"
        )
    return a


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
