"""Boundary frames: what one stage sends its neighbour per microbatch, and their byte-level checks.

An :class:`ActivationFrame` goes forward (coordinates + token ids), a
:class:`GradientFrame` backward (coordinates of the activation gradient). Both carry
the step, the microbatch and the subspace version the coordinates were encoded under;
the receiver rejects a version it is not at. Token ids are packed as uint16 whenever
the vocabulary fits. The optional zstd stage is bounded on decompression, so a small
hostile frame cannot expand into an arbitrarily large buffer. Stages in one process hand
over :class:`CarriedActivation` / :class:`CarriedGradient` instead: the same values and byte
counts, without the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from swarm.codecs.base import EncodedTensor, PayloadError

MAX_FRAME_BYTES = 256 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<i4")


def token_bytes(count: int, vocab_size: int) -> int:
    """Bytes of ``count`` token ids as :func:`pack_tokens` packs them."""
    return count * token_dtype(vocab_size).itemsize


def pack_tokens(tokens: torch.Tensor, vocab_size: int) -> bytes:
    """Token ids as little-endian uint16 (vocab <= 65536) or int32."""
    return tokens.detach().cpu().numpy().astype(token_dtype(vocab_size)).tobytes()


def unpack_tokens(data: bytes, shape: tuple[int, int], vocab_size: int) -> torch.Tensor:
    """Inverse of :func:`pack_tokens`; checks the byte count and that every id is in the vocabulary."""
    dtype = token_dtype(vocab_size)
    expected = shape[0] * shape[1] * dtype.itemsize
    if len(data) != expected:
        raise PayloadError(f"token ids for shape {shape}: expected {expected} bytes, got {len(data)}")
    ids = np.frombuffer(data, dtype=dtype).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise PayloadError(f"token id out of range [0, {vocab_size})")
    return torch.from_numpy(ids.reshape(shape))


def compress(data: bytes, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data)


def decompress(data: bytes, max_size: int = MAX_FRAME_BYTES) -> bytes:
    """zstd-decompress, refusing frames without a declared size or larger than ``max_size``."""
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise PayloadError(f"not a zstd frame: {e}") from None
    if params.content_size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        raise PayloadError("zstd frame does not declare its size")
    if params.content_size > max_size:
        raise PayloadError(f"zstd frame expands to {params.content_size} bytes (limit {max_size})")
    try:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=max_size)
    except zstandard.ZstdError as e:
        raise PayloadError(f"corrupt zstd frame: {e}") from None


@dataclass(frozen=True)
class ActivationFrame:
    """Forward traffic of one microbatch: encoded coordinates plus the ``B x (T+1)`` token ids.

    The ids hold inputs and, shifted by one, the targets the last stage needs.
    """

    step: int
    microbatch: int
    subspace_version: int
    batch: int
    seq_len: int
    payload: EncodedTensor
    token_ids: bytes
    zstd: bool = False
    cut: bool = False  # every stage snapshots after this step (a requested checkpoint cut)

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes + len(self.token_ids)


@dataclass(frozen=True)
class GradientFrame:
    """Backward traffic of one microbatch: encoded coordinates of the activation gradient."""

    step: int
    microbatch: int
    subspace_version: int
    payload: EncodedTensor
    zstd: bool = False

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes


@dataclass(frozen=True)
class CarriedActivation:
    """An :class:`ActivationFrame` handed over inside one process: the coordinates as the receiver
    would decode them (``B x T x w``, on the sender's device) and the token ids, with the byte
    count the frame would have had (from the formats, no serialisation)."""

    step: int
    microbatch: int
    subspace_version: int
    coordinates: torch.Tensor
    token_ids: torch.Tensor
    nbytes: int


@dataclass(frozen=True)
class CarriedGradient:
    """A :class:`GradientFrame` handed over inside one process (see :class:`CarriedActivation`)."""

    step: int
    microbatch: int
    subspace_version: int
    values: torch.Tensor
    nbytes: int


@dataclass(frozen=True)
class BoundarySync:
    """Per-step boundary state for the neighbour: a MAPL gradient share, an RVQ codebook delta, or
    a MAPL projection (the sender's PCA initialisation, once)."""

    step: int
    boundary: int
    mapl_gradients: bytes = b""
    codebook_delta: bytes = b""
    mapl_projection: bytes = b""

    @property
    def nbytes(self) -> int:
        return len(self.mapl_gradients) + len(self.codebook_delta) + len(self.mapl_projection)
