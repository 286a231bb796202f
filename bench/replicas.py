"""Replicas of the slowest stage: a local swarm's tokens/s with 1, 2 and 3 replicas of it.

One stage computes ``slowdown`` times as long as it would (``emulation.slow_stage``; the extra
time is a wait, so replicas on this one machine add capacity as separate machines would). The
same run goes once per replica count, side by side: ``replicas - 1`` extra nodes join as
standbys, the coordinator places them on the slowest stage once every host has measured its
capacity (each placement restarts the run from step 0: snapshots are off, so every reported
step ran with all replicas), and the stage's replicas average their gradients every step.
Reported: steady-state tokens/s, the speed-up over one replica, and what averaging cost each
replica per step (bytes it sent, seconds per round), from the nodes' end-of-run summaries.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from pathlib import Path

from swarm.core.config import (
    CheckpointConfig,
    DataConfig,
    EmulationConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
)
from swarm.launch.local_swarm import up

SUMMARY = re.compile(r"stage (\d+) averaging: (\d+) rounds, (\d+) bytes sent and ([\d.]+) s per round")


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
    model: ModelConfig
    train: TrainConfig  # microbatches >= the largest replica count
    n_stages: int = 2
    slowdown: float = 8.0
    counts: tuple[int, ...] = (1, 2, 3)


def run(p: ReplicaPlan) -> list[dict]:
    slow = p.n_stages - 1
    rows = []
    for count in p.counts:
        config = RunConfig(
            model=p.model,
            train=dataclasses.replace(p.train, replicas=count),
            data=DataConfig(tokenizer="byte"),
            checkpoint=CheckpointConfig(interval=0),
            emulation=EmulationConfig(slow_stage=slow, slowdown=p.slowdown),
            n_stages=p.n_stages,
        )
        with tempfile.TemporaryDirectory(prefix="swarm-replicas-") as tmp:
            s = up(config, Path(tmp) / "run", standbys=count - 1, progress=False)
            summaries = [m for log in s.node_logs for m in SUMMARY.finditer(log.read_text())]
        averaged = [m for m in summaries if int(m[1]) == slow]
        rows.append(
            {
                "replicas": count,
                "slow_stage": slow,
                "slowdown": p.slowdown,
                "tokens_per_s": s.tokens_per_second,
                "epochs_restarted": s.epochs_restarted,
                "averaging_bytes_per_replica_step": max((int(m[3]) for m in averaged), default=0),
                "averaging_s_per_round": max((float(m[4]) for m in averaged), default=0.0),
                "boundary_bytes_per_step": (s.wire_bytes_forward + s.wire_bytes_backward) / s.steps,
            }
        )
    for row in rows:
        row["speedup_vs_one"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows
