"""The ``state`` bench's holders and newcomer: in this process on loopback, or as processes on
emulated hosts (``python -m bench.state_hosts serve|fetch``, each inside its network namespace).

``serve`` writes the snapshot into a holder's :class:`~swarm.io.checkpoint.SnapshotStore`, serves
it through a node's ``Stage`` gRPC service, prints ``READY <port>``, and on SIGTERM prints the bytes
it served and exits. ``fetch`` reads a ``StageCheckpoint`` (the coordinator's manifest of the cut,
holders included), fetches the snapshot from every holder at once, verifies it and prints a JSON
line: seconds, bytes, and the bytes that came through the coordinator (none: it holds no copy).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import signal
import time
from pathlib import Path

import grpc
from swarm.node.snapshot_fetch import SnapshotFetcher
from swarm.node.snapshot_server import SnapshotServer
from swarm.node.stage_service import StageService

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm._proto.swarm.v1 import stage_pb2_grpc
from swarm.io.checkpoint import SnapshotStore
from swarm.io.manifest import CHUNK_BYTES, Manifest
from swarm.ops.metrics import Metrics

STAGE, STEP = 1, 9  # the cut the bench's snapshot claims to be


def checkpoint_ref(data: bytes, holders: list[cpb.SnapshotHolder]) -> cpb.StageCheckpoint:
    """The coordinator's record of a cut of ``data`` held by ``holders``."""
    m = Manifest.of(STAGE, STEP, data, CHUNK_BYTES)
    ref = cpb.StageCheckpoint(
        stage=STAGE, step=STEP, digest=m.digest, size=m.size, chunk_bytes=m.chunk_bytes, chunk_sha256=m.packed
    )
    ref.holders.extend(holders)
    return ref


def holder_record(i: int, address: str) -> cpb.SnapshotHolder:
    """What the coordinator tells a fetcher of holder ``i`` (its name is its access secret here)."""
    return cpb.SnapshotHolder(node_id=f"holder{i}", address=address, access=f"holder{i}")


@contextlib.asynccontextmanager
async def holder(folder: Path, name: str, data: bytes, mbps: float, bind: str = "127.0.0.1"):
    """A node's snapshot server holding ``data`` (paced at ``mbps``; 0: the link paces it); yields
    its gRPC port and its metrics."""
    store = SnapshotStore(folder / name)
    await asyncio.to_thread(store.write, STAGE, STEP, data)
    service = StageService(Metrics("node"))
    service.snapshots = SnapshotServer(store, service.metrics, mbps)
    service.snapshots.access = name
    server = grpc.aio.server()
    stage_pb2_grpc.add_StageServicer_to_server(service, server)
    port = server.add_insecure_port(f"{bind}:0")
    await server.start()
    try:
        yield port, service.metrics
    finally:
        await server.stop(0)


def served_bytes(metrics: Metrics) -> int:
    return int(metrics.snapshot_served_bytes._value.get())


async def fetch(ref: cpb.StageCheckpoint, folder: Path) -> tuple[bytes, float, float]:
    """Fetch the snapshot ``ref`` names as a newcomer would: its bytes, seconds, and the bytes
    that came through the coordinator."""
    metrics = Metrics("node")

    async def no_coordinator_copy(key: str, size: int) -> bytes:
        raise RuntimeError("the bench's coordinator holds no snapshot bytes")

    fetcher = SnapshotFetcher(folder, lambda: "newcomer", metrics, print, no_coordinator_copy)
    start = time.perf_counter()
    restored = await fetcher.fetch(ref)
    seconds = time.perf_counter() - start
    return restored, seconds, metrics.snapshot_fetched_bytes.labels(source="coordinator")._value.get()


async def _serve(args: argparse.Namespace) -> None:
    data = Path(args.data).read_bytes()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with holder(Path(args.folder), args.name, data, args.mbps, args.bind) as (port, metrics):
        print(f"READY {port}", flush=True)
        await stop.wait()
        print(f"SERVED {served_bytes(metrics)}", flush=True)


async def _fetch(args: argparse.Namespace) -> None:
    ref = cpb.StageCheckpoint.FromString(Path(args.ref).read_bytes())
    restored, seconds, coordinator_bytes = await fetch(ref, Path(args.folder))
    ok = hashlib.sha256(restored).hexdigest() == ref.digest  # the bench's own check of the whole
    print(
        json.dumps(
            {
                "seconds": seconds,
                "bytes": len(restored),
                "verified": ok,
                "coordinator_bytes": coordinator_bytes,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="hold a snapshot and serve it until SIGTERM")
    p.add_argument("--data", required=True)
    p.add_argument("--folder", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--bind", required=True)
    p.add_argument("--mbps", type=float, default=0.0)
    p = sub.add_parser("fetch", help="fetch a snapshot from its holders; print a JSON line")
    p.add_argument("--ref", required=True)
    p.add_argument("--folder", required=True)
    args = parser.parse_args()
    asyncio.run(_serve(args) if args.command == "serve" else _fetch(args))


if __name__ == "__main__":
    main()
