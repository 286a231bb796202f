"""Replicas of a stage on emulated 100 Mbit/s hosts: per-step averaging against outer steps.

The multi-host recipe's swarm (:mod:`bench.multihost`: one network namespace per host behind a
``tbf`` access link, the coordinator on its own host, TLS, the DHT) with 2 stages, stage 1
computing ``slowdown`` times as long as it would (a wait: a slower GPU, so a replica of it on
this machine adds capacity as a separate machine would). Once per mode, side by side: stage 1
alone, then with a second replica on a third host that averages with it every step (float64
gradients) or takes DiLoCo outer steps (int8 pseudo-gradients every ``H`` steps, optionally
overlapped with the next inner step). The averaging traffic crosses the hosts' access links
like the boundary frames do. Reported: steady-state tokens/s (the second half of the steps, and
none before the last plan epoch: the replica joins at a cut, by their completion times), its
ratio to one replica, and what averaging cost each replica
(bytes per step, seconds per round), from the nodes' end-of-run summaries.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from bench.multihost import MultiHostPlan, running
from bench.replica_sync import mode_name
from bench.replicas import SUMMARY
from swarm.core.config import EmulationConfig, ModelConfig, ReplicaSyncConfig, TrainConfig


@dataclasses.dataclass(frozen=True)
class WanReplicaPlan:
    model: ModelConfig
    train: TrainConfig  # microbatches: even (the replicas' halves)
    mbps: float = 100.0
    slowdown: float = 4.0
    syncs: tuple[ReplicaSyncConfig, ...] = (
        ReplicaSyncConfig(),
        ReplicaSyncConfig(mode="outer", every=10, format="int8"),
        ReplicaSyncConfig(mode="outer", every=10, format="int8", overlap=1),
    )


def mode(replicas: int, sync: ReplicaSyncConfig) -> str:
    return "1 replica" if replicas == 1 else f"{replicas} replicas, {mode_name(sync)}"


def run(p: WanReplicaPlan) -> list[dict]:
    """One row per mode, one replica first."""
    cases = [(1, ReplicaSyncConfig())] + [(2, sync) for sync in p.syncs]
    rows = [_row(p, replicas, sync) for replicas, sync in cases]
    for row in rows:
        row["tokens_vs_one_replica"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows


def _row(p: WanReplicaPlan, replicas: int, sync: ReplicaSyncConfig) -> dict:
    plan = MultiHostPlan(
        p.model,
        dataclasses.replace(p.train, replicas=replicas),
        mbps=p.mbps,
        roles=("inbound",) * (1 + replicas),
        n_stages=2,
        replica_sync=sync,
        emulation=EmulationConfig(slow_stage=1, slowdown=p.slowdown),
    )
    with tempfile.TemporaryDirectory(prefix="swarm-wan-replicas-") as tmp, running(plan, Path(tmp)) as swarm:
        steps = sorted(swarm.poller.steps, key=lambda s: s.step)
        logs = [swarm.log(f"node{i}") for i in range(len(plan.roles))]
        restarts, resumed = swarm.poller.epochs_restarted, swarm.poller.resume_step
    late = [s for s in steps if s.step >= max(resumed, len(steps) // 2)]  # replicas in place
    seconds = late[-1].completed_at - late[0].completed_at
    summaries = [m for log in logs for m in SUMMARY.finditer(log) if int(m[1]) == 1]
    hosts_of_stage_1 = sum(f"one of {replicas} replicas" in log for log in logs) if replicas > 1 else 1
    return {
        "mode": mode(replicas, sync),
        "replicas": replicas,
        "link_mbps": p.mbps,
        "steps": len(steps),
        "tokens_per_s": sum(s.tokens for s in late[1:]) / seconds if seconds > 0 else 0.0,
        "replicas_seen": hosts_of_stage_1,
        "epochs_restarted": restarts,
        "averaging_bytes_per_replica_step": max((int(m[3]) for m in summaries), default=0),
        "averaging_s_per_round": max((float(m[4]) for m in summaries), default=0.0),
    }
