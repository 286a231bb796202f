"""The codec interface: tensor formats that turn a 2-D float tensor into bytes and back.

A boundary payload is always a matrix whose rows are tokens (``n x m``): the full
activation (``m = d``), subspace coordinates (``m = k``) or MAPL coordinates (``m = r``).
A :class:`TensorFormat` owns how such a matrix becomes bytes; the boundary codecs in
:mod:`swarm.codecs.boundary` decide *which* matrix crosses the wire.

Every decoder validates what it is given (sizes, shape limits, finiteness) and raises
:class:`PayloadError` with a message that says what was wrong; it never returns garbage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

MAX_ROWS = 1 << 20
MAX_COLS = 1 << 16


class PayloadError(ValueError):
    """A payload that cannot be decoded: wrong size, shape, version, or non-finite values."""


class StaleVersionError(PayloadError):
    """Coordinates encoded under a subspace version the receiver is not at."""


@dataclass(frozen=True)
class EncodedTensor:
    """A matrix serialised by a :class:`TensorFormat`: what travels on the wire."""

    format: str
    rows: int
    cols: int
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


def check_shape(rows: int, cols: int) -> None:
    """Reject shapes that are negative or larger than any boundary could need."""
    if not (0 <= rows <= MAX_ROWS and 0 < cols <= MAX_COLS):
        raise PayloadError(f"shape {rows}x{cols} outside [0, {MAX_ROWS}] x [1, {MAX_COLS}]")


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise :class:`PayloadError` if ``x`` holds NaN or Inf.

    One min/max reduction (NaN propagates into both, an infinity is one of them): several times
    cheaper than materialising ``isfinite(x)`` on every frame.
    """
    if x.numel() == 0:
        return
    low, high = torch.aminmax(x.detach())
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        raise PayloadError(f"{what} holds non-finite values")


def check_size(data: bytes, expected: int, what: str) -> None:
    """Raise :class:`PayloadError` unless ``len(data) == expected``."""
    if len(data) != expected:
        raise PayloadError(f"{what}: expected {expected} bytes, got {len(data)}")


class TensorFormat(ABC):
    """Serialises an ``n x m`` float tensor to bytes and back.

    Subclasses set ``name`` (the id that travels on the wire) and implement
    :meth:`_encode` / :meth:`_decode`; the base class checks shapes and finiteness on
    both sides so a subclass only deals with well-formed input. Encoding computes on the
    input's device and decoding on the requested one; the bytes do not depend on either.
    """

    name: ClassVar[str]

    def encode(self, x: torch.Tensor) -> EncodedTensor:
        """Serialise ``x`` (2-D, finite). Raises :class:`PayloadError` on NaN/Inf input."""
        self._check_input(x)
        return EncodedTensor(self.name, x.shape[0], x.shape[1], self._encode(x.detach()))

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What ``decode(encode(x))`` rebuilds, bit for bit, computed on ``x``'s device without bytes:
        the hand-over between two stages in one process. Checks its input as :meth:`encode` does;
        the result is a new tensor in the format's decoded dtype (float32, float64 for ``fp64``)."""
        self._check_input(x)
        out = self._roundtrip(x.detach())
        check_finite(out, f"decoded {self.name} payload")
        return out.clone() if out.data_ptr() == x.data_ptr() else out

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 2:
            raise PayloadError(f"{self.name}: expected a 2-D tensor, got shape {tuple(x.shape)}")
        check_shape(*x.shape)
        check_finite(x, f"{self.name} input")

    def decode(
        self, payload: EncodedTensor, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Rebuild the matrix; validates format, shape, byte count and finiteness."""
        if payload.format != self.name:
            raise PayloadError(f"payload format {payload.format!r} given to decoder {self.name!r}")
        check_shape(payload.rows, payload.cols)
        out = self._decode(payload.data, payload.rows, payload.cols, device).to(dtype=dtype)
        # checked after the cast: a finite fp64 value can overflow the dtype the stage computes in
        check_finite(out, f"decoded {self.name} payload")
        return out

    @abstractmethod
    def encoded_size(self, rows: int, cols: int) -> int:
        """Bytes :meth:`encode` produces for a ``rows x cols`` matrix (it depends on the shape only)."""

    def _roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``_decode(_encode(x))`` on ``x.device``; formats override it to skip the bytes."""
        return self._decode(self._encode(x), x.shape[0], x.shape[1], x.device)

    @abstractmethod
    def _encode(self, x: torch.Tensor) -> bytes:
        """The bytes of ``x``; every intermediate tensor lives on ``x.device``."""

    @abstractmethod
    def _decode(self, data: bytes, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
        """The ``rows x cols`` matrix in ``data``, built on ``device``."""
