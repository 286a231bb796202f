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

:func:`lost_stage` (its own section) runs the same model once undisturbed and once per
``checkpoint.lost_stage`` policy with a middle stage's host killed together with every standby, the
keepers of its snapshots, so no copy of that stage's snapshots is left: every stage rolls back to
an older cut that has all of them (or step 0), or the lost stage is rebuilt from its neighbours
(CheckFree); the final loss beside the undisturbed run's.
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
    # snapshot keepers per cut (the coordinator's --snapshot-keepers) compared with one host per
    # stage; the first is the one every other run uses (0: the snapshots go to the coordinator)
    keepers: tuple[int, ...] = (1,)
    lost_stage: tuple[str, ...] = ("rollback", "rebuild")  # checkpoint.lost_stage policies compared
    lost_stage_after_s: float = 60.0  # when a middle stage and its keepers are lost (lost_stage section)


def run(p: ChurnPlan) -> list[dict]:
    """Per replica count (and, with one host per stage, per keeper count): the run undisturbed,
    then under a kill every ``kill_every_s`` seconds."""
    rows = []
    label = f"kill -9 every {p.kill_every_s:.0f} s"
    for replicas in p.replicas:
        for keepers in p.keepers if replicas == 1 else p.keepers[:1]:
            calm = _run(p, replicas, "none", None, keepers=keepers)
            # the monkey's clock starts now, with the run it disturbs
            churned = _run(p, replicas, label, ChaosMonkey(p.kill_every_s), keepers=keepers)
            rows += _retained([calm, churned])
    return rows


def lost_stage(p: ChurnPlan) -> list[dict]:
    """One host per stage: the run undisturbed, then, once per ``lost_stage`` policy, with a middle
    stage's host and every standby killed together ``lost_stage_after_s`` seconds in."""
    label = f"a middle stage's host and every standby, after {p.lost_stage_after_s:.0f} s"
    rows = [_run(p, 1, "none", None)]
    for policy in p.lost_stage:
        chaos = ChaosMonkey(p.lost_stage_after_s, scope="stage", events=1)
        rows.append(_run(p, 1, label, chaos, policy=policy) | {"lost_stage": policy})
    return _retained(rows)


def _run(
    p: ChurnPlan,
    replicas: int,
    label: str,
    chaos: ChaosMonkey | None,
    policy: str = "rollback",
    keepers: int | None = None,
) -> dict:
    """One local swarm run of the plan's model under ``chaos`` (None: undisturbed), with ``keepers``
    snapshot keepers per cut (None: the plan's first)."""
    keepers = p.keepers[0] if keepers is None else keepers
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
            chaos=chaos,
            use_dht=replicas > 1,  # replicas average over the DHT's P2P (loopback, no port mapping)
            snapshot_keepers=keepers,
        )
    summary = s.chaos or {"kills": 0, "recovered": 0}
    return {
        "replicas": replicas,
        "keepers": keepers,
        "churn": label,
        "final_loss": s.losses[-1] if s.losses else None,
        "steps": s.steps,
        "seconds": s.seconds,
        "tokens_per_s": s.tokens / s.seconds,
        "epochs_restarted": s.epochs_restarted,
        "kills": summary["kills"],
        "recoveries": summary["recovered"],
        "mean_recovery_s": summary.get("mean_recovery_s"),
        "max_recovery_s": summary.get("max_recovery_s"),
        "mean_steps_redone": summary.get("mean_steps_redone"),
        "kills_detail": summary.get("kills_detail", []),
    }


def _retained(rows: list[dict]) -> list[dict]:
    """Each row's throughput and final loss against the first (undisturbed) row's."""
    for row in rows:
        row["retained"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        if row["final_loss"] is not None and rows[0]["final_loss"]:
            row["loss_vs_undisturbed"] = row["final_loss"] / rows[0]["final_loss"] - 1
    return rows
