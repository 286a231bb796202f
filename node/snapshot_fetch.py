"""Fetching a stage snapshot from every holder at once, chunk by verified chunk.

The coordinator names a snapshot's manifest (every chunk's sha256) and its alive holders with
their access secrets (:class:`~swarm._proto.swarm.v1.coordinator_pb2.StageCheckpoint`). Each holder is
asked for a few chunks at a time from one shared queue, so a fast holder serves more of them; every
chunk is checked against the manifest and kept on disk (:class:`~swarm.io.partial.PartialSnapshot`),
so a fetch broken off (a holder gone, the node restarted, the epoch abandoned) resumes with the
chunks still missing. A holder that serves a chunk of the wrong size or hash is dropped for this
fetch and reported (``report_bad``); its chunks are taken from the others. A holder that fails to
answer is tried again a few times. When no holder can complete it, the coordinator's copy is used
if it has one (``at_coordinator``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm._proto.swarm.v1 import stage_pb2, stage_pb2_grpc
from swarm.io.manifest import ChunkError, Manifest
from swarm.io.partial import PartialSnapshot
from swarm.net.channel import DEFAULT_KEEPALIVE, KeepAlive, open_channel
from swarm.net.tls import INSECURE, NODE_SERVER_NAME, Security
from swarm.ops.logs import say
from swarm.ops.metrics import Metrics

log = logging.getLogger(__name__)

CHUNKS_PER_CALL = 4  # chunks one request asks a holder for: enough to keep its link busy
CALL_S = 600.0  # one request's deadline (a dead holder is noticed sooner, by keepalive)
TRIES = 3  # failed calls after which a holder is given up on for this fetch
RETRY_S = 0.5
# A holder's answers that mean it will not serve this snapshot at all: not tried again.
_FINAL = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT}


class FetchFailed(RuntimeError):
    """No holder (nor the coordinator) could deliver the whole snapshot."""


@dataclass
class _Fetch:
    """One fetch in progress: the chunks left to ask for, each holder's tries left, bytes per holder."""

    ref: cpb.StageCheckpoint
    partial: PartialSnapshot
    tries: dict[str, int]
    queue: collections.deque[int] = field(default_factory=collections.deque)
    served: collections.Counter[str] = field(default_factory=collections.Counter)
    drainers: int = 1  # holders drawing from the queue at once

    def take(self) -> list[int]:
        """The chunks of one request: up to :data:`CHUNKS_PER_CALL`, and no more than an even share
        of the queue, so a small snapshot still comes from every holder."""
        n = min(CHUNKS_PER_CALL, -(-len(self.queue) // self.drainers))
        return [self.queue.popleft() for _ in range(n)]


def manifest_of(ref: cpb.StageCheckpoint) -> Manifest:
    return Manifest.parse(ref.stage, ref.step, ref.digest, ref.size, ref.chunk_bytes, ref.chunk_sha256)


class SnapshotFetcher:
    """Fetches snapshots into ``root`` (its partial fetches live there) for node ``node_id``.

    ``report_bad(ref, holder_id)`` tells the coordinator of a lying holder; ``from_coordinator(digest,
    size)`` downloads the coordinator's copy.
    """

    def __init__(
        self,
        root: Path,
        node_id: Callable[[], str],
        metrics: Metrics,
        report_bad: Callable[[cpb.StageCheckpoint, str], None],
        from_coordinator: Callable[[str, int], Awaitable[bytes]],
        security: Security = INSECURE,
        keepalive: KeepAlive = DEFAULT_KEEPALIVE,
    ):
        self.root, self.node_id, self.metrics = root, node_id, metrics
        self.report_bad, self.from_coordinator = report_bad, from_coordinator
        self.security, self.keepalive = security, keepalive
        self._running: dict[str, asyncio.Task[bytes]] = {}  # digest -> its fetch in progress

    async def fetch(self, ref: cpb.StageCheckpoint) -> bytes:
        """The snapshot ``ref`` names, every byte verified; raises :class:`FetchFailed`. A snapshot
        asked for again while it is being fetched (a restore and a keep order) is fetched once; a
        caller cancelled leaves the fetch running for the others (and for the next try)."""
        task = self._running.get(ref.digest)
        if task is None:
            task = self._running[ref.digest] = asyncio.create_task(self._fetch(ref))
            task.add_done_callback(self._finished)
        return await asyncio.shield(task)

    async def close(self) -> None:
        """Stop the fetches in progress (what they verified stays on disk for a later try)."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _finished(self, task: asyncio.Task[bytes]) -> None:
        self._running = {key: t for key, t in self._running.items() if t is not task}
        if not task.cancelled():
            task.exception()  # retrieved: every caller that still waits gets it from the shield

    async def _fetch(self, ref: cpb.StageCheckpoint) -> bytes:
        if any(h.node_id == self.node_id() for h in ref.holders):  # its own copy is lost or corrupt
            self.report_bad(ref, self.node_id())
        holders = [h for h in ref.holders if h.node_id != self.node_id() and h.address]
        if holders:
            try:
                data = await self._from_holders(ref, holders)
            except (FetchFailed, ChunkError) as e:
                if not ref.at_coordinator:
                    raise FetchFailed(str(e)) from None
                log.warning("%s; fetching it from the coordinator", e)
            else:
                return data
        if not ref.at_coordinator:
            raise FetchFailed(f"snapshot of stage {ref.stage} after step {ref.step}: no holder to fetch from")
        data = await self.from_coordinator(ref.digest, ref.size)
        self.metrics.snapshot_fetched_bytes.labels(source="coordinator").inc(len(data))
        return data

    async def _from_holders(self, ref: cpb.StageCheckpoint, holders: list[cpb.SnapshotHolder]) -> bytes:
        started = time.perf_counter()
        fetch = _Fetch(ref, PartialSnapshot(self.root, manifest_of(ref)), {h.node_id: TRIES for h in holders})
        while missing := fetch.partial.missing():
            live = [h for h in holders if fetch.tries[h.node_id] > 0]
            if not live:
                raise FetchFailed(
                    f"snapshot of stage {ref.stage} after step {ref.step}: {len(missing)} chunks left "
                    "and no holder left to fetch them from"
                )
            fetch.queue.extend(missing)
            fetch.drainers = len(live)
            await asyncio.gather(*(self._drain(fetch, h) for h in live))
        data = await asyncio.to_thread(fetch.partial.assemble)
        shares = ", ".join(f"{n[:8]} {b / 1e6:.1f} MB" for n, b in fetch.served.items())
        say(
            f"snapshot of stage {ref.stage} after step {ref.step}: {len(data)} bytes verified from "
            f"{len(fetch.served)} holder(s) in {time.perf_counter() - started:.2f} s ({shares})"
        )
        return data

    async def _drain(self, fetch: _Fetch, holder: cpb.SnapshotHolder) -> None:
        """Fetch chunks off the queue from ``holder`` until it is empty or the holder is given up on."""
        async with open_channel(
            holder.address, self.security, self.keepalive, holder.certificate or NODE_SERVER_NAME
        ) as channel:
            stub = stage_pb2_grpc.StageStub(channel)
            while fetch.queue and fetch.tries[holder.node_id] > 0:
                asked = fetch.take()
                try:
                    await self._call(stub, fetch, holder, asked)
                except ChunkError as e:
                    fetch.tries[holder.node_id] = 0
                    self.metrics.snapshot_bad_chunks.inc()
                    log.warning(
                        "holder %s of snapshot %s refused: %s", holder.node_id[:8], fetch.ref.digest[:12], e
                    )
                    self.report_bad(fetch.ref, holder.node_id)
                except grpc.aio.AioRpcError as e:
                    fetch.tries[holder.node_id] = 0 if e.code() in _FINAL else fetch.tries[holder.node_id] - 1
                    log.info(
                        "holder %s of snapshot %s: %s", holder.node_id[:8], fetch.ref.digest[:12], e.details()
                    )
                    await asyncio.sleep(RETRY_S)
                finally:  # what this holder did not deliver goes back to the others
                    fetch.queue.extend(sorted(set(asked) & set(fetch.partial.missing())))

    async def _call(
        self, stub: stage_pb2_grpc.StageStub, fetch: _Fetch, holder: cpb.SnapshotHolder, asked: list[int]
    ) -> None:
        """Ask ``holder`` for the chunks ``asked`` and keep each that verifies; :class:`ChunkError` on a
        bad one."""
        ref = fetch.ref
        request = stage_pb2.SnapshotRequest(
            digest=ref.digest, chunk_bytes=ref.chunk_bytes, chunks=asked, access=holder.access
        )
        left = set(asked)
        async for chunk in stub.FetchSnapshot(request, timeout=CALL_S):
            if chunk.index not in left:
                raise ChunkError(f"chunk {chunk.index} was not asked for")
            await asyncio.to_thread(fetch.partial.put, chunk.index, chunk.data)
            left.discard(chunk.index)
            fetch.served[holder.node_id] += len(chunk.data)
            self.metrics.snapshot_fetched_bytes.labels(source="peer").inc(len(chunk.data))
        if left:
            raise ChunkError(f"the stream ended without chunks {sorted(left)}")
