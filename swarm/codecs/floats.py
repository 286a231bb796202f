"""Raw IEEE float formats, plus the little-endian (de)serialisers every format builds on.

``fp64`` and ``fp32`` are lossless at 8 and 4 bytes/value (fp64 decodes to float64, for
exactness tests); ``fp16`` halves that with ~3 significant digits
(relative error <= 2**-11 above 6.1e-5, absolute <= 2**-25 below) but overflows above
65504; ``bf16`` keeps fp32's range with ~2 digits (relative error <= 2**-8).
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from swarm.codecs.base import TensorFormat, check_finite, check_size

# Float dtypes travel as the bits of a same-width integer: numpy has no bfloat16.
_BITS_AS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _wire_dtype(dtype: torch.dtype) -> np.dtype:
    """The little-endian numpy dtype whose bytes carry ``dtype`` on the wire."""
    return torch.empty(0, dtype=_BITS_AS.get(dtype, dtype), device="cpu").numpy().dtype.newbyteorder("<")


def pack(t: torch.Tensor, dtype: torch.dtype) -> bytes:
    """``t`` (on any device) cast to ``dtype`` as little-endian bytes.

    Integer casts wrap, so callers keep values in range; a float cast that overflows
    raises :class:`PayloadError` instead of sending Inf.
    """
    t = t.detach().to("cpu", dtype).contiguous()
    if dtype.is_floating_point:
        check_finite(t, f"input cast to {dtype}")
        t = t.view(_BITS_AS[dtype])
    return t.numpy().astype(_wire_dtype(dtype), copy=False).tobytes()


def unpack(
    data: bytes,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    offset: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, int]:
    """Read a ``shape`` tensor of little-endian ``dtype`` at ``offset`` onto ``device``; returns it and
    the next offset.

    The caller has checked the total payload size, so a short buffer here is a bug.
    """
    wire = _wire_dtype(dtype)
    count = math.prod(shape)
    arr = np.frombuffer(data, dtype=wire, count=count, offset=offset).astype(wire.newbyteorder("="))
    t = torch.from_numpy(arr).reshape(shape)
    t = t.view(dtype) if dtype.is_floating_point else t
    return t.to(device), offset + count * wire.itemsize


class _RawFloatFormat(TensorFormat):
    """Every value cast to ``dtype``: ``rows * cols * itemsize`` bytes, no header.

    Decodes to float32, or float64 for ``fp64``.
    """

    dtype: ClassVar[torch.dtype]

    def encoded_size(self, rows: int, cols: int) -> int:
        return rows * cols * self.dtype.itemsize

    def _encode(self, x: torch.Tensor) -> bytes:
        return pack(x, self.dtype)

    def _decode(self, data: bytes, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
        check_size(data, self.encoded_size(rows, cols), self.name)
        values, _ = unpack(data, self.dtype, (rows, cols), device=device)
        return self._widen(values)

    def _roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self._widen(x.to(self.dtype))

    def _widen(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(torch.promote_types(self.dtype, torch.float32))


class Float64Format(_RawFloatFormat):
    """Lossless for float64 tensors at twice fp32's bytes: for exactness tests, not for training traffic."""

    name = "fp64"
    dtype = torch.float64


class Float32Format(_RawFloatFormat):
    """Lossless; the reference every compressed format is measured against."""

    name = "fp32"
    dtype = torch.float32


class Float16Format(_RawFloatFormat):
    """Half the bytes of fp32, relative error <= 2**-11; encode raises if a value exceeds 65504."""

    name = "fp16"
    dtype = torch.float16


class BFloat16Format(_RawFloatFormat):
    """Half the bytes of fp32 with fp32's range, but coarser: relative error <= 2**-8."""

    name = "bf16"
    dtype = torch.bfloat16
