"""Churn: a local swarm with standbys where a random stage host is ``kill -9``ed every T seconds.

The same run (same configuration, links, standbys) goes twice, side by side in one
benchmark: once undisturbed and once under a :class:`~swarm.launch.chaos.ChaosMonkey` that kills
a random stage-hosting node every ``kill_every_s`` seconds (a fresh node joins in its
place, so a standby is always there); and so once per replica count (``replicas``: every stage
that many hosts, which average every step; the standbys that become them join first). Reported:
tokens/s over the whole run (wall clock, process start to end, so the time lost to recoveries
counts) and the fraction the churned run retains of the undisturbed one with as many replicas;
per failure the recovery time (kill to the first redone step completing again) and the steps
redone (progress at the kill minus the step the run resumed after). With ``lost_stage`` the run
also goes (one host per stage) under a monkey that kills a middle stage's host together with every
standby, the keepers of its snapshots, so no copy of that stage is left: once per policy
(``checkpoint.lost_stage``: roll every stage back, or rebuild the lost one from its neighbours),
with the final loss beside the undisturbed run's.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from swarm.core.config import CheckpointConfig, DataConfig, ModelConfig, RunConfig, TrainConfig
from swarm.launch.chaos import ChaosMonkey
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
    lost_stage: tuple[str, ...] = ()  # checkpoint.lost_stage policies run under whole-stage losses
    lost_stage_events: int = 1  # whole-stage losses per run (each may roll the run back to step 0)


def run(p: ChurnPlan) -> list[dict]:
    rows = []
    for replicas in p.replicas:
        rows += _runs(p, replicas)
    return rows


def _runs(p: ChurnPlan, replicas: int) -> list[dict]:
    """The run undisturbed, then under chaos, with ``replicas`` hosts per stage (and with one, under
    whole-stage losses per ``lost_stage`` policy)."""
    scenarios = [(0.0, "node", "rollback"), (p.kill_every_s, "node", "rollback")]
    if replicas == 1:
        scenarios += [(p.kill_every_s, "stage", policy) for policy in p.lost_stage]
    rows = []
    for chaos_s, scope, policy in scenarios:
        config = RunConfig(
            model=p.model,
            train=dataclasses.replace(p.train, replicas=replicas),
            data=DataConfig(tokenizer="byte"),
            checkpoint=CheckpointConfig(interval=p.checkpoint_interval, lost_stage=policy),
            n_stages=p.n_stages,
        )
        with tempfile.TemporaryDirectory(prefix="swarm-churn-") as tmp:
            s = up(
                config,
                Path(tmp) / "run",
                standbys=p.standbys + p.n_stages * (replicas - 1),
                link_latency_ms=p.link_latency_ms,
                dead_after=p.dead_after_s,
                progress=False,
                timeout=1800,
                chaos=ChaosMonkey(chaos_s, scope=scope, events=p.lost_stage_events if scope == "stage" else 0)
                if chaos_s
                else None,
                use_dht=replicas > 1,  # replicas average over the DHT's P2P (loopback, no port mapping)
            )
        chaos = s.chaos or {"kills": 0, "recovered": 0}
        if scope == "stage":
            churn = f"a middle stage's host and every standby, {p.lost_stage_events}x after {chaos_s:.0f} s"
        else:
            churn = f"kill -9 every {chaos_s:.0f} s" if chaos_s else "none"
        rows.append(
            {
                "replicas": replicas,
                "churn": churn,
                "lost_stage": policy if scope == "stage" else None,
                "final_loss": s.losses[-1] if s.losses else None,
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
        if row["final_loss"] is not None and rows[0]["final_loss"]:
            row["loss_vs_undisturbed"] = row["final_loss"] / rows[0]["final_loss"] - 1
    return rows
