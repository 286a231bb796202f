"""The coordinator's content-addressed artifact store: stage snapshots uploaded by nodes.

An upload goes to ``{digest}.part`` and is appended to strictly in order, so an
interrupted upload resumes where the stored part ends (:meth:`held`). When the part
reaches its declared size its sha256 is checked: a match renames it to the verified
``{digest}.bin`` of an :class:`~swarm.io.artifacts.ArtifactCache` (which checks the hash
again on every read), a mismatch deletes it.
"""

from __future__ import annotations

from pathlib import Path

from swarm.codecs.base import PayloadError
from swarm.io.artifacts import ArtifactCache, digest


class UploadError(PayloadError):
    """An upload chunk that cannot be stored (wrong offset, too large, digest mismatch)."""


class ArtifactStore:
    """Verified artifacts under ``root`` plus the partial uploads that will become them."""

    def __init__(self, root: str | Path, max_bytes: int):
        self.cache = ArtifactCache(root)
        self.max_bytes = max_bytes

    def _part(self, key: str) -> Path:
        return self.cache.path(key).with_suffix(".part")

    def complete(self, key: str) -> bool:
        return self.cache.path(key).exists()

    def held(self, key: str) -> int:
        """Bytes stored of ``key`` (its full size once complete)."""
        done = self.cache.path(key)
        if done.exists():
            return done.stat().st_size
        part = self._part(key)
        return part.stat().st_size if part.exists() else 0

    def append(self, key: str, offset: int, data: bytes, total: int) -> bool:
        """Append one chunk at ``offset`` of an artifact of ``total`` bytes; True once it is complete."""
        if self.complete(key):
            return True
        if not 0 < total <= self.max_bytes:
            raise UploadError(f"artifact size {total} outside (0, {self.max_bytes}]")
        held = self.held(key)
        if offset != held:
            raise UploadError(f"chunk at offset {offset}, the stored part ends at {held}")
        if held + len(data) > total:
            raise UploadError(f"chunk runs past the declared size {total}")
        part = self._part(key)
        with open(part, "ab") as f:
            f.write(data)
        if held + len(data) < total:
            return False
        blob = part.read_bytes()
        part.unlink()
        if digest(blob) != key:
            raise UploadError(f"uploaded bytes do not match digest {key[:12]}; upload discarded")
        self.cache.put(key, blob)
        return True

    def read(self, key: str) -> bytes | None:
        """The verified artifact, or None if absent or corrupt (a corrupt copy is deleted)."""
        return self.cache.get(key)

    def remove(self, key: str) -> None:
        self.cache.path(key).unlink(missing_ok=True)
        self._part(key).unlink(missing_ok=True)
