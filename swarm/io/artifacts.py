"""Content-addressed artifacts (the fixed token embedding): serialisation and the node's disk cache.

An artifact is addressed by the sha256 of its bytes. The coordinator serves it in
chunks; a node verifies the digest before use and keeps it in its data directory, so a
restart does not fetch it again. A cached file whose bytes no longer match its digest
is discarded and fetched anew.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch

from swarm.codecs.base import PayloadError

CHUNK_BYTES = 1 << 20


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def matrix_to_bytes(t: torch.Tensor) -> bytes:
    """A float32 matrix as ``<rows u32><cols u32>`` + little-endian values."""
    m = t.detach().cpu().float().contiguous()
    return struct.pack("<II", *m.shape) + m.numpy().astype("<f4").tobytes()


def matrix_from_bytes(data: bytes) -> torch.Tensor:
    if len(data) < 8:
        raise PayloadError("matrix artifact shorter than its header")
    rows, cols = struct.unpack_from("<II", data)
    if len(data) != 8 + 4 * rows * cols:
        raise PayloadError(
            f"matrix artifact {rows}x{cols} must be {8 + 4 * rows * cols} bytes, got {len(data)}"
        )
    return torch.from_numpy(np.frombuffer(data, dtype="<f4", offset=8).astype(np.float32).reshape(rows, cols))


class ArtifactCache:
    """Verified artifacts under ``root``, one file per digest."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.corrupt_discarded = 0

    def path(self, key: str) -> Path:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise PayloadError(f"not a sha256 digest: {key!r}")
        return self.root / f"{key}.bin"

    def get(self, key: str) -> bytes | None:
        """The artifact's bytes, or None if absent or corrupt (a corrupt file is removed)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if digest(data) != key:
            self.corrupt_discarded += 1
            path.unlink(missing_ok=True)
            return None
        return data

    def put(self, key: str, data: bytes) -> None:
        """Store verified bytes atomically; raises :class:`PayloadError` if they do not match ``key``."""
        if digest(data) != key:
            raise PayloadError(f"artifact bytes do not match digest {key[:12]}")
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, self.path(key))
