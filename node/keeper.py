"""Keeping other nodes' stage snapshots when the coordinator orders it (keep orders).

An order names a snapshot, its manifest and its holders (heartbeat replies carry them). The keeper
fetches it in verified chunks (:class:`~swarm.node.snapshot_fetch.SnapshotFetcher`), stores it with
its own snapshots, where :class:`~swarm.node.snapshot_server.SnapshotServer` serves it, and reports
that it holds it; the coordinator then names it as a holder. One fetch per snapshot at a time; an
order repeated while its fetch runs, or after it is held, costs nothing; a failed fetch is tried
again a few times, with the holders the order lists by then.
"""

from __future__ import annotations

import asyncio
import logging

from swarm.node.coordinator_client import CoordinatorClient
from swarm.node.snapshot_fetch import SnapshotFetcher

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm.codecs.base import PayloadError
from swarm.io.checkpoint import SnapshotStore
from swarm.ops.logs import say

log = logging.getLogger(__name__)
KEEP_TRIES = 3  # fetches of one ordered snapshot before waiting for the order to be listed anew
KEEP_RETRY_S = 2.0  # times the attempt number, between them


def _named(ref: cpb.StageCheckpoint) -> cpb.StageCheckpoint:
    return cpb.StageCheckpoint(stage=ref.stage, step=ref.step, digest=ref.digest, size=ref.size)


def held_report(node_id: str, ref: cpb.StageCheckpoint) -> cpb.CheckpointReport:
    """The report that ``node_id`` holds the snapshot ``ref`` (fetched and verified)."""
    return cpb.CheckpointReport(node_id=node_id, checkpoint=_named(ref), kept=True)


def bad_holder_report(node_id: str, ref: cpb.StageCheckpoint, holder: str) -> cpb.CheckpointReport:
    """The report that ``holder`` served ``node_id`` a chunk of ``ref`` that failed its check."""
    return cpb.CheckpointReport(node_id=node_id, checkpoint=_named(ref), bad_holder=holder)


class Keeper:
    """Carries out keep orders: fetch into ``store``, then report to the coordinator."""

    def __init__(self, fetcher: SnapshotFetcher, store: SnapshotStore, client: CoordinatorClient):
        self.fetcher, self.store, self.client = fetcher, store, client
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._held: set[str] = set()

    def take(self, orders: list[cpb.StageCheckpoint]) -> None:
        """Start keeping each ordered snapshot not already held or being fetched (a failed one again)."""
        for ref in orders:
            task = self._tasks.get(ref.digest)
            if task is None or (task.done() and ref.digest not in self._held):
                self._tasks[ref.digest] = asyncio.create_task(self._keep(ref))

    async def _keep(self, ref: cpb.StageCheckpoint) -> None:
        for attempt in range(1, KEEP_TRIES + 1):
            if self.store.find(ref.digest) is not None or await self._fetched(ref):
                self._held.add(ref.digest)
                self.client.report("ReportCheckpoint", held_report(self.client.node_id, ref))
                return
            await asyncio.sleep(KEEP_RETRY_S * attempt)
            # the order as last listed (its holders then), unless it was withdrawn meanwhile
            listed = {k.digest: k for k in self.client.keep}
            if ref.digest not in listed:
                return
            ref = listed[ref.digest]

    async def _fetched(self, ref: cpb.StageCheckpoint) -> bool:
        """Fetch ``ref`` into the store; whether it worked."""
        try:
            data = await self.fetcher.fetch(ref)
        except (RuntimeError, PayloadError) as e:  # FetchFailed, or the coordinator's copy failed
            log.warning("could not keep the snapshot of stage %d after step %d: %s", ref.stage, ref.step, e)
            return False
        await asyncio.to_thread(self.store.write, ref.stage, ref.step, data)
        say(f"keeping the snapshot of stage {ref.stage} after step {ref.step} ({ref.size} bytes)")
        return True

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
