"""Boundary codecs: which matrix crosses a stage boundary, and how it becomes a frame.

A boundary map has two differentiable halves: ``project(x, tokens)`` on the sending
stage (the residual stream, B x T x d, to coordinates, B x T x w) and
``lift(z, tokens)`` on the receiving stage (coordinates back to the residual stream).

* :class:`IdentityMap`: the full activation (w = d); with a lossy tensor format this is
  how the ablation baselines (top-k, blockwise int8/int4, low-rank) are run.
* :class:`SubspaceMap`: ``(X - E_fixed[tok]) U`` and ``E_fixed[tok] + Z U^T``; exact
  when the model is subspace-constrained.
* :class:`swarm.core.mapl.MaplBoundary`: learned per-boundary projection plus anchor.

Gradients travel as ``dL/dZ``: for the subspace map that is ``G U``, and the sender's
``Z.backward(dL/dZ)`` applies ``G U U^T`` to its residual stream, as the method wants.
"""

from __future__ import annotations

from typing import Protocol

import torch

from swarm.codecs.base import EncodedTensor, PayloadError, StaleVersionError, TensorFormat
from swarm.codecs.rvq import ResidualVQ
from swarm.runtime.wire import (
    ActivationFrame,
    CarriedActivation,
    CarriedGradient,
    GradientFrame,
    compress,
    decompress,
    pack_tokens,
    token_bytes,
    unpack_tokens,
)


class BoundaryMap(Protocol):
    @property
    def width(self) -> int: ...

    def project(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor: ...

    def lift(self, z: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor: ...


class IdentityMap:
    """Send the residual stream as it is."""

    def __init__(self, d_model: int):
        self.width = d_model

    def project(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return x

    def lift(self, z: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return z


class SubspaceMap:
    """Coordinates of ``X - E_fixed[tok]`` in the basis ``U`` (d x k).

    Holds the stage's own tensors; rotations update them in place, so it follows them.
    Exact only on a subspace-constrained model; on a dense one it is a fixed projection.
    """

    def __init__(self, fixed_embedding: torch.Tensor, basis: torch.Tensor):
        self.fixed_embedding, self.basis = fixed_embedding, basis

    @property
    def width(self) -> int:
        return self.basis.shape[1]

    def project(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return (x - self.fixed_embedding[tokens]) @ self.basis

    def lift(self, z: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.fixed_embedding[tokens] + z @ self.basis.T


class BoundaryCodec:
    """One side of one boundary: its map, the forward and backward formats, the zstd stage.

    ``zstd_level > 0`` compresses payload and token ids; it pays on ids, scales and
    quantised codes, hardly on raw floats (ratio ~1.1-1.3).

    ``in_process`` (both neighbours in one process, on one device and dtype): the encoders hand
    over :class:`CarriedActivation` / :class:`CarriedGradient`, the values the decoder would rebuild
    and the frame's byte count, without serialising; not with zstd, whose size depends on the data.
    The decoders take either kind.
    """

    def __init__(
        self,
        boundary_map: BoundaryMap,
        forward_format: TensorFormat,
        backward_format: TensorFormat,
        vocab_size: int,
        max_seq_len: int,
        zstd_level: int = 0,
        in_process: bool = False,
    ):
        self.map = boundary_map
        self.forward_format, self.backward_format = forward_format, backward_format
        self.vocab_size, self.max_seq_len, self.zstd_level = vocab_size, max_seq_len, zstd_level
        self.in_process = in_process and zstd_level == 0

    @property
    def codebooks(self) -> ResidualVQ | None:
        """The forward format's learned codebooks (RVQ), which the two sides keep in sync by deltas;
        None for a format without per-boundary state."""
        fmt = self.forward_format
        return fmt if isinstance(fmt, ResidualVQ) else None

    def _pack(self, data: bytes) -> bytes:
        return compress(data, self.zstd_level) if self.zstd_level > 0 else data

    def _unpack(self, data: bytes, zstd: bool) -> bytes:
        return decompress(data) if zstd else data

    def encode_activation(
        self, z: torch.Tensor, token_ids: torch.Tensor, step: int, microbatch: int, version: int
    ) -> ActivationFrame | CarriedActivation:
        """Serialise coordinates ``z`` (B x T x w) and the ``B x (T+1)`` token ids."""
        batch, seq_len, width = z.shape
        rows = z.reshape(batch * seq_len, width)
        if self.in_process:
            nbytes = self.forward_format.encoded_size(*rows.shape) + token_bytes(
                token_ids.numel(), self.vocab_size
            )
            values = self.forward_format.roundtrip(rows).view(batch, seq_len, width)
            return CarriedActivation(step, microbatch, version, values, token_ids, nbytes)
        enc = self.forward_format.encode(rows)
        payload = EncodedTensor(enc.format, enc.rows, enc.cols, self._pack(enc.data))
        ids = self._pack(pack_tokens(token_ids, self.vocab_size))
        return ActivationFrame(step, microbatch, version, batch, seq_len, payload, ids, self.zstd_level > 0)

    def decode_activation(
        self,
        frame: ActivationFrame | CarriedActivation,
        version: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate and decode a frame into (coordinates B x T x w, token ids B x (T+1))."""
        self._check_version(frame.subspace_version, version)
        if isinstance(frame, CarriedActivation):
            return frame.coordinates.to(device, dtype), frame.token_ids.to(device)
        if not (0 < frame.seq_len <= self.max_seq_len and 0 < frame.batch <= 1 << 16):
            raise PayloadError(f"frame shape batch={frame.batch} seq_len={frame.seq_len} out of range")
        self._check_payload(frame.payload, frame.batch * frame.seq_len)
        ids = unpack_tokens(
            self._unpack(frame.token_ids, frame.zstd), (frame.batch, frame.seq_len + 1), self.vocab_size
        )
        z = self._decode(self.forward_format, frame.payload, frame.zstd, device, dtype)
        return z.view(frame.batch, frame.seq_len, -1), ids.to(device)

    def encode_gradient(
        self, g: torch.Tensor, step: int, microbatch: int, version: int
    ) -> GradientFrame | CarriedGradient:
        batch, seq_len, width = g.shape
        rows = g.reshape(batch * seq_len, width)
        if self.in_process:
            values = self.backward_format.roundtrip(rows).view(batch, seq_len, width)
            return CarriedGradient(
                step, microbatch, version, values, self.backward_format.encoded_size(*rows.shape)
            )
        enc = self.backward_format.encode(rows)
        payload = EncodedTensor(enc.format, enc.rows, enc.cols, self._pack(enc.data))
        return GradientFrame(step, microbatch, version, payload, self.zstd_level > 0)

    def decode_gradient(
        self,
        frame: GradientFrame | CarriedGradient,
        version: int,
        shape: torch.Size,
        device: torch.device,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Decode the gradient of coordinates that were sent with shape ``shape`` (B x T x w)."""
        self._check_version(frame.subspace_version, version)
        if isinstance(frame, CarriedGradient):
            if frame.values.shape != shape:
                raise PayloadError(f"gradient shape {tuple(frame.values.shape)}, expected {tuple(shape)}")
            return frame.values.to(device, dtype)
        self._check_payload(frame.payload, shape[0] * shape[1])
        return self._decode(self.backward_format, frame.payload, frame.zstd, device, dtype).view(shape)

    def _decode(
        self, fmt: TensorFormat, payload: EncodedTensor, zstd: bool, device: torch.device, dtype: torch.dtype
    ) -> torch.Tensor:
        raw = EncodedTensor(payload.format, payload.rows, payload.cols, self._unpack(payload.data, zstd))
        return fmt.decode(raw, device=device, dtype=dtype)

    def _check_payload(self, payload: EncodedTensor, rows: int) -> None:
        if payload.rows != rows or payload.cols != self.map.width:
            raise PayloadError(
                f"payload shape {payload.rows}x{payload.cols}, expected {rows}x{self.map.width}"
            )

    @staticmethod
    def _check_version(got: int, expected: int) -> None:
        if got != expected:
            raise StaleVersionError(
                f"payload encoded under subspace version {got}, stage is at version {expected}"
            )
