"""Saving a cut's snapshots in the background: serialise, write, hash into a manifest, report.

Training hands over host-memory captures (:func:`swarm.io.checkpoint.capture`, the only pause) and
goes on. Each snapshot is written to the node's :class:`~swarm.io.checkpoint.SnapshotStore`, where
:class:`~swarm.node.snapshot_server.SnapshotServer` serves its chunks to keepers and newcomers; the
coordinator is told its manifest (:class:`~swarm.io.manifest.Manifest`). The bytes are uploaded to
the coordinator only when asked (``upload``): the plan says no other node could keep them, or it
is the run's final cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from swarm.node.coordinator_client import CoordinatorClient

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm.io import checkpoint
from swarm.io.manifest import CHUNK_BYTES, Manifest
from swarm.ops.logs import say
from swarm.ops.metrics import Metrics

log = logging.getLogger(__name__)


class Checkpointer:
    """Serialises, stores (and uploads when asked) snapshots in the background, one cut at a time.

    At most one cut waits behind the one being saved: when saving is slower than the cut
    interval, a newer cut replaces the waiting one (the run only ever needs the latest).
    """

    def __init__(
        self,
        store: checkpoint.SnapshotStore,
        client: CoordinatorClient,
        metrics: Metrics,
        chunk_bytes: int = CHUNK_BYTES,
        moments: str = "exact",
    ):
        self.store, self.client, self.metrics, self.chunk_bytes = store, client, metrics, chunk_bytes
        self.moments = moments  # checkpoint.moments: how Adam's moments are serialised
        self._queue: asyncio.Queue[tuple[int, list[dict], float, bool]] = asyncio.Queue(maxsize=1)
        self._task = asyncio.create_task(self._drain())

    def submit(self, epoch: int, states: list[dict], pause_s: float, upload: bool) -> None:
        """Save host-memory captures of one cut, taken while training stood still ``pause_s`` seconds;
        ``upload``: the coordinator gets the bytes too."""
        if self._queue.full():
            _, skipped, _, _ = self._queue.get_nowait()
            self._queue.task_done()
            log.warning(
                "snapshot cut after step %d skipped: the previous one is still being saved",
                skipped[0]["step"],
            )
        self._queue.put_nowait((epoch, states, pause_s, upload))

    async def flush(self) -> None:
        await self._queue.join()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _drain(self) -> None:
        while True:
            epoch, states, pause_s, upload = await self._queue.get()
            try:
                for state in states:
                    await self._save(epoch, state, pause_s, upload)
            except Exception as e:  # a failed save costs this cut only; the next cut tries again
                log.error("snapshot not saved: %s", e)
            finally:
                self._queue.task_done()

    async def _save(self, epoch: int, state: dict, pause_s: float, upload: bool) -> None:
        stage, step = state["stage"], state["step"]
        data = await asyncio.to_thread(checkpoint.to_bytes, state, self.moments)
        manifest = await asyncio.to_thread(Manifest.of, stage, step, data, self.chunk_bytes)
        saved = await asyncio.to_thread(self.store.write, stage, step, data, manifest.digest)
        where = "kept here"
        if upload:
            start = time.perf_counter()
            await self.client.upload(saved.digest, data)
            where = f"uploaded in {time.perf_counter() - start:.2f} s"
        self.metrics.checkpointed(step)
        ref = cpb.StageCheckpoint(
            stage=stage,
            step=step,
            digest=saved.digest,
            size=len(data),
            chunk_bytes=manifest.chunk_bytes,
            chunk_sha256=manifest.packed,
        )
        self.client.report(
            "ReportCheckpoint",
            cpb.CheckpointReport(node_id=self.client.node_id, plan_epoch=epoch, checkpoint=ref),
        )
        say(
            f"snapshot of stage {stage} after step {step}: {len(data)} bytes, training paused "
            f"{pause_s * 1000:.1f} ms for the copy, {where}"
        )
