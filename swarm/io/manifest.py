"""Chunked, content-addressed snapshot manifests: what a holder serves and a fetcher checks.

A stage snapshot of ``size`` bytes is cut into chunks of ``chunk_bytes`` (the last one shorter);
the manifest names the whole snapshot's sha256 and every chunk's. A fetcher takes each chunk from
whichever holder has it and keeps only the ones whose hash matches, so a lying holder costs a
refetch elsewhere, never a wrong byte. Torch-free.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from swarm.codecs.base import PayloadError

CHUNK_BYTES = 4 << 20
MAX_CHUNK_BYTES = 32 << 20  # what one gRPC message carries with room to spare
_SHA = 32


class ChunkError(PayloadError):
    """A chunk that does not match its manifest (wrong size, wrong hash, no such chunk)."""


@dataclass(frozen=True)
class Manifest:
    """The snapshot of ``stage`` after ``step``: ``digest`` (hex sha256) of ``size`` bytes, in chunks."""

    stage: int
    step: int
    digest: str
    size: int
    chunk_bytes: int
    chunks: tuple[bytes, ...]  # the raw sha256 of each chunk, in order

    @classmethod
    def of(cls, stage: int, step: int, data: bytes, chunk_bytes: int = CHUNK_BYTES) -> Manifest:
        """The manifest of ``data``, read once (no copies of its chunks)."""
        view, whole, chunks = memoryview(data), hashlib.sha256(), []
        for offset in range(0, len(data), chunk_bytes):
            part = view[offset : offset + chunk_bytes]
            whole.update(part)
            chunks.append(hashlib.sha256(part).digest())
        return cls(stage, step, whole.hexdigest(), len(data), chunk_bytes, tuple(chunks))

    @classmethod
    def parse(
        cls, stage: int, step: int, digest: str, size: int, chunk_bytes: int, packed: bytes
    ) -> Manifest:
        """A manifest from its fields as sent (``packed``: the chunk hashes, concatenated); checked."""
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ChunkError(f"chunk size {chunk_bytes} outside (0, {MAX_CHUNK_BYTES}]")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ChunkError(f"not a sha256 digest: {digest[:80]!r}")
        count = -(-size // chunk_bytes)
        if size <= 0 or len(packed) != count * _SHA:
            raise ChunkError(f"{len(packed)} bytes of chunk hashes for {count} chunks of {size} bytes")
        chunks = tuple(packed[i : i + _SHA] for i in range(0, len(packed), _SHA))
        return cls(stage, step, digest, size, chunk_bytes, chunks)

    @property
    def packed(self) -> bytes:
        return b"".join(self.chunks)

    def span(self, index: int) -> tuple[int, int]:
        """Offset and length of chunk ``index`` in the snapshot."""
        if not 0 <= index < len(self.chunks):
            raise ChunkError(f"no chunk {index} in a snapshot of {len(self.chunks)} chunks")
        offset = index * self.chunk_bytes
        return offset, min(self.chunk_bytes, self.size - offset)

    def check(self, index: int, data: bytes) -> None:
        """Raise :class:`ChunkError` unless ``data`` is chunk ``index`` exactly."""
        _, length = self.span(index)
        if len(data) != length:
            raise ChunkError(f"chunk {index} has {len(data)} bytes, the manifest says {length}")
        if hashlib.sha256(data).digest() != self.chunks[index]:
            raise ChunkError(f"chunk {index} does not match its sha256")
