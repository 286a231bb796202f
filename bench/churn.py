"""Churn: a local swarm with standbys where a random stage host is ``kill -9``ed every T seconds.

The same run (same configuration, links, standbys) goes twice, side by side in one
benchmark: once undisturbed and once under a :class:`~swarm.launch.chaos.ChaosMonkey` that kills
a random stage-hosting node every ``kill_every_s`` seconds (a fresh node joins in its
place, so a standby is always there); and so once per replica count (``replicas``: every stage
that many hosts, which average every step; the standbys that become them join first). Reported:
tokens/s over the whole run (wall clock, process start to end, so the time lost to recoveries
counts) and the fraction the churned run retains of the undisturbed one with as many replicas;
per failure the recovery time (kill to the first redone step completing again) and the steps
redone (progress at the kill minus the step the run resumed after).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from swarm.core.config import CheckpointConfig, DataConfig, ModelConfig, RunConfig, TrainConfig
from swarm.launch.local_swarm import up


@dataclasses.dataclass(frozen=True)
class ChurnPlan:
    model: ModelConfig
    train: TrainConfig
    n_stages: int
    kill_every_s: float
    checkpoint_interval: int
    standbys: int = 1
    dead_after_s: float = 4.0
    link_latency_ms: float = 10.0
    replicas: tuple[int, ...] = (1,)


def run(p: ChurnPlan) -> list[dict]:
    rows = []
    for replicas in p.replicas:
        rows += _runs(p, replicas)
    return rows


def _runs(p: ChurnPlan, replicas: int) -> list[dict]:
    """The run undisturbed, then under chaos, with ``replicas`` hosts per stage."""
    config = RunConfig(
        model=p.model,
        train=dataclasses.replace(p.train, replicas=replicas),
        data=DataConfig(tokenizer="byte"),
        checkpoint=CheckpointConfig(interval=p.checkpoint_interval),
        n_stages=p.n_stages,
    )
    rows = []
    for chaos_s in (0.0, p.kill_every_s):
        with tempfile.TemporaryDirectory(prefix="swarm-churn-") as tmp:
            s = up(
                config,
                Path(tmp) / "run",
                standbys=p.standbys + p.n_stages * (replicas - 1),
                link_latency_ms=p.link_latency_ms,
                dead_after=p.dead_after_s,
                progress=False,
                timeout=1800,
                chaos_s=chaos_s,
                use_dht=replicas > 1,  # replicas average over the DHT's P2P (loopback, no port mapping)
            )
        chaos = s.chaos or {"kills": 0, "recovered": 0}
        rows.append(
            {
                "replicas": replicas,
                "churn": f"kill -9 every {chaos_s:.0f} s" if chaos_s else "none",
                "steps": s.steps,
                "seconds": s.seconds,
                "tokens_per_s": s.tokens / s.seconds,
                "epochs_restarted": s.epochs_restarted,
                "kills": chaos["kills"],
                "recoveries": chaos["recovered"],
                "mean_recovery_s": chaos.get("mean_recovery_s"),
                "max_recovery_s": chaos.get("max_recovery_s"),
                "mean_steps_redone": chaos.get("mean_steps_redone"),
                "kills_detail": chaos.get("kills_detail", []),
            }
        )
    for row in rows:
        row["retained"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]  # of the undisturbed run
    return rows
