"""Serving the chunks of the stage snapshots this node holds (``Stage.FetchSnapshot``).

A node holds the snapshots it took and those it keeps for others (keep orders) in its
:class:`~swarm.io.checkpoint.SnapshotStore`. The coordinator gives the node an access secret at
Join and names it only to the nodes it tells to fetch from this one; a request must carry it (compared
in constant time). Chunks are read
from the snapshot file as asked and sent, across all requests, at most at ``mbps`` when the
operator set it, else at ``share`` of the uplink this node measured on its boundary streams
(:class:`~swarm.net.uplink.UplinkMeter`; unpaced until it measured one), so serving a newcomer or
a keeper leaves room for the node's boundary traffic. The fetcher checks every chunk.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from swarm._proto.swarm.v1 import stage_pb2
from swarm.io.checkpoint import SnapshotStore
from swarm.io.manifest import MAX_CHUNK_BYTES
from swarm.net.uplink import UplinkMeter
from swarm.ops.metrics import Metrics

log = logging.getLogger(__name__)


class Pacer:
    """Spaces sends so their bytes leave at ``rate()`` Mbit/s at most (0: no pacing), the rate read
    at every send."""

    def __init__(self, rate: Callable[[], float]):
        self.rate, self._free_at = rate, 0.0

    async def send(self, nbytes: int) -> float:
        """Wait until ``nbytes`` may leave; returns the rate applied (0: unpaced)."""
        mbps = self.rate()
        if mbps <= 0:
            return 0.0
        now = time.monotonic()
        self._free_at = max(now, self._free_at) + 8 * nbytes / (mbps * 1e6)
        await asyncio.sleep(self._free_at - now)
        return mbps


def serving_cap(mbps: float, share: float, uplink: UplinkMeter | None) -> Callable[[], float]:
    """The serving rate in Mbit/s: ``mbps`` when set, else ``share`` of the measured uplink (0: none
    measured yet, or no share: unpaced)."""

    def rate() -> float:
        if mbps > 0:
            return mbps
        measured = uplink.mbps() if uplink is not None and share > 0 else None
        return share * measured if measured else 0.0

    return rate


def _read(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


class SnapshotServer:
    """The chunks of ``store``'s snapshots, to callers that name ``access`` (set at Join; "" refuses all)."""

    def __init__(
        self,
        store: SnapshotStore,
        metrics: Metrics,
        mbps: float = 0.0,
        share: float = 0.0,
        uplink: UplinkMeter | None = None,
    ):
        self.store, self.metrics = store, metrics
        self.pacer = Pacer(serving_cap(mbps, share, uplink))
        self.access = ""

    async def serve(
        self, request: stage_pb2.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.SnapshotChunk]:
        found = self.store.find(request.digest)
        if found is None:
            await self._refuse(
                context, grpc.StatusCode.NOT_FOUND, "snapshot_unknown", "no such snapshot here"
            )
        if not self.access or not hmac.compare_digest(self.access.encode(), request.access.encode()):
            await self._refuse(
                context, grpc.StatusCode.PERMISSION_DENIED, "snapshot_access", "wrong snapshot access secret"
            )
        size = found.path.stat().st_size
        if not 0 < request.chunk_bytes <= MAX_CHUNK_BYTES:
            why = f"chunk size {request.chunk_bytes} outside (0, {MAX_CHUNK_BYTES}]"
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "snapshot_request", why)
        count = -(-size // request.chunk_bytes)
        if any(i >= count for i in request.chunks):
            why = f"a chunk beyond the {count} of this snapshot"
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "snapshot_request", why)
        for index in request.chunks:
            offset = index * request.chunk_bytes
            try:
                data = await asyncio.to_thread(
                    _read, found.path, offset, min(request.chunk_bytes, size - offset)
                )
            except OSError:  # pruned meanwhile (a newer cut of that stage arrived)
                await self._refuse(context, grpc.StatusCode.NOT_FOUND, "snapshot_unknown", "snapshot pruned")
            self.metrics.snapshot_serving_mbps.set(await self.pacer.send(len(data)))
            self.metrics.snapshot_served_bytes.inc(len(data))
            yield stage_pb2.SnapshotChunk(index=index, data=data)

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, label: str, why: str):
        self.metrics.rejected.labels(reason=label).inc()
        log.warning("refused a snapshot fetch from %s: %s", context.peer(), why)
        await context.abort(code, why)
