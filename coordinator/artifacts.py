"""What nodes fetch from and upload to the coordinator, and the trained model it writes.

The embedding every node loads at Join is served from memory; stage snapshots live in the
:class:`~swarm.coordinator.store.ArtifactStore`. Once a run's final cut is stored the trained model
folder is written off the event loop (:func:`~swarm.coordinator.export.trained_model`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from swarm.coordinator.export import trained_model
from swarm.coordinator.state import CheckpointRecord
from swarm.coordinator.store import ArtifactStore

from swarm.codecs.base import PayloadError
from swarm.core.config import RunConfig
from swarm.io import model_io
from swarm.io.artifacts import digest

log = logging.getLogger("swarm.coordinator")


class Artifacts:
    """The ``embedding`` artifact, the snapshot ``store``, and the final model written to ``model_dir``
    (None: not written); a stopping coordinator waits ``export_wait_s`` for that write."""

    def __init__(self, embedding: bytes, store: ArtifactStore, model_dir: Path | None, export_wait_s: float):
        self.embedding, self.embedding_digest = embedding, digest(embedding)
        self.store, self.model_dir, self.export_wait_s = store, model_dir, export_wait_s
        self._export_task: asyncio.Task | None = None

    def read(self, key: str) -> bytes | None:
        """The artifact ``key`` (the embedding or a complete snapshot); None if absent or malformed."""
        if key == self.embedding_digest:
            return self.embedding
        with contextlib.suppress(PayloadError):  # a malformed digest is simply not found
            if self.store.complete(key):
                return self.store.read(key)
        return None

    def uploaded(self, key: str, size: int) -> bool:
        """Whether the snapshot ``key`` of ``size`` bytes is completely uploaded."""
        return self.store.complete(key) and self.store.held(key) == size

    def export(self, config: RunConfig, records: list[CheckpointRecord]) -> None:
        """The run's final cut is among ``records``: start writing the trained model folder."""
        if self.model_dir is not None:
            self._export_task = asyncio.create_task(self._export_final_model(config, records, self.model_dir))

    async def _export_final_model(
        self, config: RunConfig, records: list[CheckpointRecord], model_dir: Path
    ) -> None:
        try:
            model = await asyncio.to_thread(trained_model, config, records, self.store)
            manifest = await asyncio.to_thread(model_io.save, model, model_dir)
        except Exception as e:  # the snapshots stay in the store: `swarm-coordinator export` can retry
            log.error("could not export the trained model to %s: %s", model_dir, e)
            return
        log.info("trained model (step %d) written to %s", manifest["step"], model_dir)

    async def close(self) -> None:
        """Let a model export in progress finish (at most ``export_wait_s``)."""
        if self._export_task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._export_task), self.export_wait_s)
