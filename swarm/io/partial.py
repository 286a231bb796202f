"""The verified chunks of a snapshot fetch so far, on disk: a broken fetch resumes where it stopped.

Chunks live under ``root/.fetch-{digest}/`` as ``{index}.chunk``, each written atomically and only
after it matched its manifest hash, so what is there counts as fetched; :meth:`PartialSnapshot.assemble`
still checks the whole snapshot's sha256 and drops any chunk that went bad on disk.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from swarm.io.manifest import ChunkError, Manifest


class PartialSnapshot:
    """The chunks of ``manifest`` fetched so far, kept under ``root``."""

    def __init__(self, root: str | Path, manifest: Manifest):
        self.manifest = manifest
        self.folder = Path(root) / f".fetch-{manifest.digest}"
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, index: int) -> Path:
        return self.folder / f"{index:07d}.chunk"

    def missing(self) -> list[int]:
        """The chunks not fetched yet, ascending."""
        return [i for i in range(len(self.manifest.chunks)) if not self._path(i).exists()]

    def put(self, index: int, data: bytes) -> None:
        """Keep chunk ``index``; raises :class:`ChunkError` (and keeps nothing) if it does not match."""
        self.manifest.check(index, data)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, self._path(index))

    def assemble(self) -> bytes:
        """The whole snapshot, checked against its sha256; the folder is removed once it is.

        Raises :class:`ChunkError` when chunks are missing or went bad on disk (those are dropped, so
        :meth:`missing` names them for the next try)."""
        if missing := self.missing():
            raise ChunkError(f"{len(missing)} chunks of snapshot {self.manifest.digest[:12]} not fetched yet")
        data = b"".join(self._path(i).read_bytes() for i in range(len(self.manifest.chunks)))
        if hashlib.sha256(data).hexdigest() != self.manifest.digest:
            bad = [i for i in range(len(self.manifest.chunks)) if not self._verifies(i)]
            for i in bad:
                self._path(i).unlink(missing_ok=True)
            raise ChunkError(f"chunks {bad} of snapshot {self.manifest.digest[:12]} went bad on disk")
        self.discard()
        return data

    def _verifies(self, index: int) -> bool:
        try:
            self.manifest.check(index, self._path(index).read_bytes())
        except ChunkError:
            return False
        return True

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
