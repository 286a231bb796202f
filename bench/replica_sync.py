"""What keeping a stage's replicas identical costs: per-step gradient averaging against outer steps.

Two replicas of a one-stage model (the whole model, so each step has a loss) train on the same
batches in process, each on its half of every step's microbatches, through
:class:`~swarm.node.replica_averaging.ReplicaGroup` on real P2P daemons on loopback (NAT port
mapping off): once averaging float64 gradients every step (``replica_sync.mode = "step"``), then
with outer steps every ``H`` steps in each pseudo-gradient format, and in int8 with the sync's
all-reduce overlapping the next inner step (its outer step lands one step late; the loss shows
what that delay costs, the bytes are the same). Reported per mode: bytes each
replica sent per trainable parameter, per sync and per step (the per-step rounds' counts
included), what that takes per step at ``link_mbps``, and the loss at equal tokens (the mean
training loss of the last steps).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
from collections.abc import Callable, Sequence

import torch
from hivemind.p2p import P2P
from swarm.node.replica_averaging import ReplicaGroup, Sibling
from swarm.node.schedule import StepCounts

from bench.averaging import PATIENT, loopback_peers
from swarm.core.config import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    ReplicaSyncConfig,
    RunConfig,
    TrainConfig,
)
from swarm.core.subspace import initial_artifacts
from swarm.io.data import BatchSampler, batch_ids, load_dataset
from swarm.ops.metrics import Metrics
from swarm.runtime.averaging import ReplicaAverager
from swarm.runtime.worker import StageWorker

Hook = Callable[[int, list[StageWorker]], None]


async def connected_groups(
    p2ps: Sequence[P2P], members: Sequence[ReplicaAverager], microbatches: Sequence[int], key: str
) -> list[ReplicaGroup]:
    """One :class:`ReplicaGroup` per started averager (replica ``i`` named ``node{i}``, holding
    ``microbatches[i]`` of each step), connected to its siblings."""
    addresses = [str((await p.get_visible_maddrs())[0]) for p in p2ps]
    siblings = [Sibling(f"node{i}", addresses[i], n) for i, n in enumerate(microbatches)]
    groups = [
        ReplicaGroup(a, key, siblings, f"node{i}", lambda step: False, Metrics("node"))
        for i, a in enumerate(members)
    ]
    await asyncio.gather(*(g.connect() for g in groups))
    return groups


@dataclasses.dataclass(frozen=True)
class ReplicaSyncPlan:
    model: ModelConfig
    train: TrainConfig  # microbatches: a multiple of 2 (the replicas' halves)
    every: tuple[int, ...] = (10, 50)
    formats: tuple[str, ...] = ("fp32", "bf16", "int8")
    overlap: int = 1  # one more int8 row per H, its all-reduce behind this many inner steps
    link_mbps: float = 100.0
    tail: int = 10  # the loss at equal tokens: the mean over this many last steps


def train_replicas(
    workers: Sequence[StageWorker],
    dealt: Sequence[Sequence[int]],
    steps: int,
    batch_for_step: Callable[[int], torch.Tensor],
    after_inner: Hook | None = None,
    after_sync: Hook | None = None,
) -> tuple[list[ReplicaGroup], list[float]]:
    """Train one-stage ``workers`` as replicas, each on its ``dealt`` microbatches of every step's
    batch, for ``steps`` steps: combine, optimizer step, outer sync (as a node's stage runner
    does), with ``after_inner`` / ``after_sync`` called after each step's optimizer steps / syncs.
    Returns the replicas' groups and each step's loss over the whole batch."""
    losses: list[float] = []

    async def one(group: ReplicaGroup, worker: StageWorker, mbs: Sequence[int], step: int) -> StepCounts:
        chunks = batch_for_step(step).chunk(worker.config.train.microbatches)
        worker.begin_step(step)
        for mb in mbs:
            worker.forward(step, mb, chunks[mb])
            worker.backward(step, mb)
        s = worker.stats
        counts = await group.combine(
            step, worker, StepCounts(s.tokens, s.loss_sum, s.loss_count, 0, 0, False)
        )
        worker.optimizer_step(step)
        return counts

    async def scenario() -> list[ReplicaGroup]:
        p2ps = await loopback_peers(len(workers))
        try:
            members = [ReplicaAverager(p, "stage-0", **PATIENT) for p in p2ps]
            for m in members:
                await m.start()
            groups = await connected_groups(p2ps, members, [len(mbs) for mbs in dealt], "bench/1/0")
            for step in range(steps):
                counts = await asyncio.gather(
                    *(one(g, w, m, step) for g, w, m in zip(groups, workers, dealt, strict=True))
                )
                losses.append(counts[0].loss_sum / counts[0].loss_count)
                if after_inner is not None:
                    after_inner(step, list(workers))
                await asyncio.gather(
                    *(g.after_step(step, w, False) for g, w in zip(groups, workers, strict=True))
                )
                if after_sync is not None:
                    after_sync(step, list(workers))
            return groups
        finally:
            for p in p2ps:
                await p.shutdown()

    try:
        return asyncio.run(scenario()), losses
    finally:
        gc.collect()  # the daemons' sockets, now rather than at a random later moment


def _row(p: ReplicaSyncPlan, sync: ReplicaSyncConfig, batches: list[torch.Tensor]) -> dict:
    config = RunConfig(
        model=p.model,
        train=p.train,
        data=DataConfig(tokenizer="byte"),
        checkpoint=CheckpointConfig(interval=0),
        replica_sync=sync,
        n_stages=1,
    )
    fixed, basis = initial_artifacts(config)
    workers = [StageWorker(config, 0, fixed, basis) for _ in range(2)]
    parameters = sum(q.numel() for q in workers[0].parameters())
    half = p.train.microbatches // 2
    dealt = [list(range(half)), list(range(half, p.train.microbatches))]
    groups, losses = train_replicas(workers, dealt, p.train.steps, batches.__getitem__)
    g = groups[0]
    per_step = (g.bytes_sent + g.sync_bytes) / p.train.steps
    outer = sync.mode == "outer"
    return {
        "mode": mode_name(sync),
        "overlap": sync.overlap,
        "every": sync.every if outer else 1,
        "format": sync.format if outer else "fp64",
        "parameters": parameters,
        "syncs": g.syncs if outer else g.rounds,
        "bytes_per_parameter_per_sync": (g.sync_bytes / g.syncs if outer else g.bytes_sent / g.rounds)
        / parameters,
        "bytes_per_parameter_per_step": per_step / parameters,
        "seconds_per_step_at_link": per_step * 8 / (p.link_mbps * 1e6),
        "loss_at_equal_tokens": sum(losses[-p.tail :]) / len(losses[-p.tail :]),
    }


def mode_name(sync: ReplicaSyncConfig) -> str:
    """How the report names ``sync``: ``per-step fp64``, ``outer H=10 int8`` (``overlap 1``)."""
    if sync.mode != "outer":
        return "per-step fp64"
    return f"outer H={sync.every} {sync.format}" + (f" overlap {sync.overlap}" if sync.overlap else "")


def run(p: ReplicaSyncPlan) -> dict:
    """One row per mode, per-step averaging first; the same batches for every mode."""
    config = RunConfig(model=p.model, train=p.train, data=DataConfig(tokenizer="byte"), n_stages=1)
    sampler = BatchSampler(load_dataset(config).train, p.train.batch_size, p.train.seq_len, p.train.seed)
    batches = [batch_ids(*sampler.next_batch()) for _ in range(p.train.steps)]
    modes = [ReplicaSyncConfig()]
    for h in p.every:
        modes += [ReplicaSyncConfig(mode="outer", every=h, format=f) for f in p.formats]
        if p.overlap:
            modes.append(ReplicaSyncConfig(mode="outer", every=h, format="int8", overlap=p.overlap))
    rows = [_row(p, sync, batches) for sync in modes]
    base = rows[0]
    for row in rows:
        row["bytes_vs_per_step"] = base["bytes_per_parameter_per_step"] / row["bytes_per_parameter_per_step"]
        row["loss_vs_per_step"] = row["loss_at_equal_tokens"] / base["loss_at_equal_tokens"]
    return {"link_mbps": p.link_mbps, "replicas": 2, "steps": p.train.steps, "rows": rows}
