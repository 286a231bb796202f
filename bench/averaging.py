"""What averaging one stage's gradients across its replicas costs: bytes per replica and wall time.

The stage is a middle stage of the benchmark model (its trainable parameters, random gradients);
2 and 3 replicas run :class:`swarm.runtime.averaging.ReplicaAverager` on their own P2P daemons on
loopback (NAT port mapping off), equal bandwidth shares, a few rounds each. Bytes are counted
from the tensor parts each replica sends (float64 on the wire); the time a link would add is
bytes / rate for the busiest replica, full duplex.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P

from swarm.core.config import ModelConfig, RunConfig, TrainConfig
from swarm.core.subspace import initial_artifacts
from swarm.runtime.averaging import ReplicaAverager, Round, shares
from swarm.runtime.worker import StageWorker

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


# A benchmark measures, it does not test failure detection: on a loaded 2-core machine a member may
# stall for seconds without being dead (the silent-member timeouts have their own tests).
PATIENT = {"sender_timeout": 60.0, "reducer_timeout": 120.0}


@dataclass(frozen=True)
class AveragingPlan:
    model: ModelConfig
    n_stages: int
    replicas: tuple[int, ...] = (2, 3)
    rounds: int = 3
    link_mbps: float = 100.0  # the link the "seconds at" column assumes


def stage_gradients(plan: AveragingPlan) -> list[torch.Tensor]:
    """Random gradients shaped like a middle stage's trainable parameters."""
    config = RunConfig(
        model=plan.model, train=TrainConfig(seq_len=plan.model.max_seq_len), n_stages=plan.n_stages
    )
    fixed, basis = initial_artifacts(config)
    worker = StageWorker(config, plan.n_stages // 2, fixed, basis)
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(p.shape, generator=gen) for p in worker.parameters() if p.requires_grad]


async def loopback_peers(n: int) -> list[P2P]:
    """``n`` P2P daemons on 127.0.0.1 that know each other (no NAT port mapping, no relays)."""
    first = await P2P.create(host_maddrs=LOOPBACK, nat_port_map=False, use_relay=False)
    maddrs = await first.get_visible_maddrs()
    rest = [
        await P2P.create(host_maddrs=LOOPBACK, initial_peers=maddrs, nat_port_map=False, use_relay=False)
        for _ in range(n - 1)
    ]
    return [first, *rest]


async def _measure(n: int, grads: list[torch.Tensor], rounds: int) -> dict:
    p2ps = await loopback_peers(n)
    try:
        members = [ReplicaAverager(p, "bench", **PATIENT) for p in p2ps]
        for m in members:
            await m.start()
        numel = sum(g.numel() for g in grads)
        fractions = shares(numel, [1.0] * n)
        seconds, sent = [], []
        for r in range(rounds):
            round_ = Round(f"bench/{n}/{r}", tuple(p.peer_id for p in p2ps), fractions, (1.0,) * n)
            tensors = [[g.clone() for g in grads] for _ in range(n)]
            start = time.perf_counter()
            stats = await asyncio.gather(
                *(m.average(round_, t) for m, t in zip(members, tensors, strict=True))
            )
            seconds.append(time.perf_counter() - start)
            sent.append(max(s.bytes_sent for s in stats))
        return {"parameters": numel, "busiest_bytes": max(sent), "seconds": statistics.median(seconds)}
    finally:
        for p in p2ps:
            await p.shutdown()
        gc.collect()


def run(plan: AveragingPlan) -> list[dict]:
    grads = stage_gradients(plan)
    rows = []
    for n in plan.replicas:
        measured = asyncio.run(_measure(n, grads, plan.rounds))
        rows.append(
            {
                "replicas": n,
                **measured,
                "busiest_mb": measured["busiest_bytes"] / 1e6,
                "bytes_per_parameter": measured["busiest_bytes"] / measured["parameters"],
                "link_mbps": plan.link_mbps,
                "seconds_at_link": measured["busiest_bytes"] * 8 / (plan.link_mbps * 1e6),
            }
        )
    return rows
