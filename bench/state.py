"""Stage state: the training pause per snapshot, and restoring a stage from 1, 2 and 3 holders.

* **Pause per snapshot.** A stage of the benchmark model trains in a single-process pipeline; a
  snapshot's only blocking part, the copy of its state to host memory
  (:func:`swarm.io.checkpoint.capture`), is timed against the step time. The same copy of
  ``state_bytes`` of tensors says what it costs a large stage.
* **Restore from holders.** ``state_bytes`` of snapshot are held by 1, 2 or 3 holders, each a real
  ``Stage`` gRPC server on 127.0.0.1 serving its chunks at most at ``holder_mbps`` (the serving cap
  of ``swarm-node join --snapshot-mbps``: an emulated uplink, paced in the transport, no RTT); the
  node's fetcher takes them from all at once and verifies every chunk. Reported: seconds, the
  ratio to the ideal ``state_bytes / (holders x holder rate)``, and the bytes that went through the
  coordinator (none: it keeps manifests). Holders and fetcher share this machine's cores, so the
  hashing (sha256 of every chunk, and of the whole) is in the times.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import torch
from swarm.node.snapshot_fetch import SnapshotFetcher
from swarm.node.snapshot_server import SnapshotServer
from swarm.node.stage_service import StageService

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm._proto.swarm.v1 import stage_pb2_grpc
from swarm.core.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from swarm.io import checkpoint
from swarm.io.checkpoint import SnapshotStore
from swarm.io.data import BatchSampler, batch_ids, load_dataset
from swarm.io.manifest import CHUNK_BYTES, Manifest
from swarm.ops.metrics import Metrics
from swarm.runtime.pipeline import LocalPipeline


@dataclasses.dataclass(frozen=True)
class StatePlan:
    model: ModelConfig
    train: TrainConfig
    n_stages: int = 4
    steps: int = 6  # the first is a warm-up, not timed
    state_bytes: int = 1 << 30
    holder_mbps: float = 80.0
    holders: tuple[int, ...] = (1, 2, 3)


def run(p: StatePlan) -> dict:
    return {"pause": _pause(p), "restore": [asyncio.run(_restore(p, n)) for n in p.holders]}


def _pause(p: StatePlan) -> dict:
    config = RunConfig(model=p.model, train=p.train, data=DataConfig(tokenizer="byte"), n_stages=p.n_stages)
    t = config.train
    sampler = BatchSampler(load_dataset(config).train, t.batch_size, t.seq_len, t.seed)
    pipe = LocalPipeline(config)
    steps, pauses = [], []
    for step in range(p.steps):
        start = time.perf_counter()
        pipe.train_step(step, batch_ids(*sampler.next_batch()))
        steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        states = [checkpoint.capture(w, step) for w in pipe.workers]
        pauses.append((time.perf_counter() - start) / len(states))
    state_bytes = len(checkpoint.to_bytes(states[0]))
    step_s, pause_s = _median(steps[1:]), _median(pauses[1:])
    big = {f"t{i}": torch.randn(p.state_bytes // 4 // 16) for i in range(16)}  # 16 tensors, state_bytes
    start = time.perf_counter()
    checkpoint.copied(big)
    big_s = time.perf_counter() - start
    return {
        "stage_state_bytes": state_bytes,
        "step_seconds": step_s,
        "pause_seconds_per_stage": pause_s,
        "pause_share_of_step": pause_s / step_s,
        "copy_bytes": p.state_bytes,
        "copy_seconds": big_s,
        "device": "cpu",
    }


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


@contextlib.asynccontextmanager
async def _holder(
    folder: Path, name: str, data: bytes, mbps: float
) -> AsyncIterator[tuple[cpb.SnapshotHolder, Metrics]]:
    """A holder of ``data`` serving it over gRPC at ``mbps``; its address and its metrics."""
    store = SnapshotStore(folder / name)
    await asyncio.to_thread(store.write, 1, 9, data)
    service = StageService(Metrics("node"))
    service.snapshots = SnapshotServer(store, service.metrics, mbps)
    service.snapshots.access = name
    server = grpc.aio.server()
    stage_pb2_grpc.add_StageServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield cpb.SnapshotHolder(node_id=name, address=f"127.0.0.1:{port}", access=name), service.metrics
    finally:
        await server.stop(0)


async def _restore(p: StatePlan, holders: int) -> dict:
    data = os.urandom(p.state_bytes)
    m = Manifest.of(1, 9, data, CHUNK_BYTES)
    with tempfile.TemporaryDirectory(prefix="swarm-state-") as tmp:
        folder = Path(tmp)
        async with contextlib.AsyncExitStack() as stack:
            named, served = zip(
                *[
                    await stack.enter_async_context(_holder(folder, f"holder{i}", data, p.holder_mbps))
                    for i in range(holders)
                ],
                strict=True,
            )
            ref = cpb.StageCheckpoint(
                stage=1,
                step=9,
                digest=m.digest,
                size=m.size,
                chunk_bytes=m.chunk_bytes,
                chunk_sha256=m.packed,
            )
            ref.holders.extend(named)
            metrics = Metrics("node")

            async def no_coordinator_copy(key: str, size: int) -> bytes:
                raise RuntimeError("the bench's coordinator holds no snapshot bytes")

            fetcher = SnapshotFetcher(
                folder / "newcomer", lambda: "newcomer", metrics, print, no_coordinator_copy
            )
            start = time.perf_counter()
            restored = await fetcher.fetch(ref)
            seconds = time.perf_counter() - start
            served_bytes = [int(m.snapshot_served_bytes._value.get()) for m in served]
    if restored != data:
        raise RuntimeError("the restored snapshot differs from the one held")
    ideal = p.state_bytes * 8 / (holders * p.holder_mbps * 1e6)
    return {
        "holders": holders,
        "state_bytes": p.state_bytes,
        "holder_mbps": p.holder_mbps,
        "seconds": seconds,
        "ideal_seconds": ideal,
        "ratio_to_ideal": seconds / ideal,
        "served_bytes": served_bytes,  # per holder
        "coordinator_bytes": metrics.snapshot_fetched_bytes.labels(source="coordinator")._value.get(),
    }


def section(r: dict) -> list[str]:
    """The report's Markdown for :func:`run`'s result ``r``."""
    pause = r["pause"]
    lines = [
        "## Stage state: pause per snapshot, restore from holders",
        "",
        f"Pause per snapshot (the copy of a stage's state to host memory, {pause['device']}): "
        f"{pause['pause_seconds_per_stage'] * 1000:.2f} ms per stage of "
        f"{pause['stage_state_bytes'] / 1e6:.1f} MB against a {pause['step_seconds'] * 1000:.0f} ms step "
        f"({100 * pause['pause_share_of_step']:.2f}% of a step); copying "
        f"{pause['copy_bytes'] / 1e9:.2f} GB of tensors took {pause['copy_seconds']:.2f} s. Memory: one "
        "copy of the stage's state in host memory per cut in flight, plus its serialisation while "
        "it is saved.",
        "",
        "| holders | state | uplink per holder | restore (s) | ideal (s) | ratio | through the coordinator |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["restore"]:
        lines.append(
            f"| {row['holders']} | {row['state_bytes'] / 1e6:.0f} MB | {row['holder_mbps']:g} Mbit/s | "
            f"{row['seconds']:.1f} | {row['ideal_seconds']:.1f} | {row['ratio_to_ideal']:.2f} | "
            f"{row['coordinator_bytes']:.0f} bytes |"
        )
    lines += [
        "",
        "Holders are gRPC servers on loopback paced at their uplink in the transport (no RTT, no "
        "network namespaces); the newcomer's downlink is not limited, so the ideal is the holders' "
        "summed uplink.",
        "",
    ]
    return lines
