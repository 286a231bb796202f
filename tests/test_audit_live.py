"""Audits in a live swarm: a replica that lies is recomputed by its two siblings, evicted, and the
run rolls back to before its first step, ending where a run without it ends."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from swarm.core.config import AuditConfig, EmulationConfig, RotationConfig, RunConfig, TrainConfig
from swarm.ops.status import render
from tests.procs import coordinator, node, processes, tiny_run, wait_for_nodes, wait_status
from tests.test_replicas import single_process_losses

STEPS = 40  # the last replica joins ~13 steps in: the rest is the window it must join in


def audited_run(folder: Path) -> RunConfig:
    """Two stages, six microbatches a step, up to three replicas per stage; stage 1 emulated slow so
    the replicas that join go to it; every sibling microbatch audited (rate 1); rotations on (an
    audit must recompute with the basis the step ran under)."""
    config = tiny_run(folder, STEPS, n_stages=2, checkpoint_interval=4)
    config.train = TrainConfig(
        steps=STEPS, batch_size=6, seq_len=32, microbatches=6, warmup_steps=2, replicas=3, lr=3e-3
    )
    config.emulation = EmulationConfig(slow_stage=1, slowdown=4.0)
    config.audit = AuditConfig(rate=1.0)
    config.rotation = RotationConfig(interval=3, max_angle=0.1)
    return RunConfig.from_dict(config.to_dict())  # validated


def run_four(tmp_path: Path, config: RunConfig, names: list[str], fault: str):
    """A coordinator and four nodes joined in order (``names[1]`` takes stage 1 first, the last two
    join it as replicas; ``names[2]`` or ``names[1]`` is the faulty one: the one named after its
    fault's role), run to completion: the final status, the coordinator's log, the faulty node's id."""
    faulty = next(n for n in names if n in ("liar", "accuser"))
    with processes() as procs:
        address = coordinator(procs, tmp_path, config, dht=True)
        started = {}
        for i, name in enumerate(names):
            flags = ("--fault", fault) if name == faulty else ()
            started[name] = node(procs, tmp_path, name, address, *flags, dht=True)
            wait_for_nodes(address, i + 1)
            if i == 2:  # the last joins once this replica hosts and measured its speed (the pick's)
                hosting = wait_status(address, lambda r, n=name: _hosts(r, n), f"{name} hosting", 120)
                done = hosting.steps_completed
                wait_status(address, lambda r, d=done: r.steps_completed >= d + 2, "two more steps", 120)
        last = names[-1]
        joined = wait_status(address, lambda r: _hosts(r, last) or r.run_complete, f"{last} hosting", 120)
        assert not joined.run_complete, (
            f"the run ended before {last} joined it: too slow a machine for {STEPS} steps"
        )
        final = wait_status(address, lambda r: r.run_complete, "the run to complete", 300)
        for name in set(names) - {faulty}:
            assert started[name].wait(60) == 0, started[name].output()
        coordinator_log = procs[0].stderr()
    hosts = {n.node_name: list(n.last_stages) for n in final.nodes if n.node_name != faulty}
    honest = [n for n in names if n != faulty]
    assert hosts == {honest[0]: [0], honest[1]: [1], honest[2]: [1]}, (hosts, coordinator_log[-4000:])
    (faulty_id,) = [n.node_id for n in final.nodes if n.node_name == faulty]
    # rolled back (or not) as it should, every step ends as the single-process model's: the
    # replicas' step-mode average is the global batch's, whoever hosts
    losses = [s.loss for s in final.steps]
    single = single_process_losses(config, tmp_path)
    rel = [abs(a - b) / b for a, b in zip(losses, single, strict=True)]
    assert max(rel) < 1e-4, rel
    return final, coordinator_log, faulty_id


def _hosts(reply, name: str) -> bool:
    return any(n.node_name == name and n.stages for n in reply.nodes)


@pytest.mark.parametrize(
    "mode", ["sign", *(pytest.param(m, marks=pytest.mark.slow) for m in ("noise", "stale", "skip"))]
)
def test_a_lying_replica_is_evicted_and_the_run_ends_as_if_it_never_joined(tmp_path, mode):
    # rotations on: those published after the cut were computed from statistics the liar's values
    # fed; the rollback withdraws them and the rerun computes them again without it
    config = audited_run(tmp_path)
    assert config.audits
    final, coordinator_log, liar_id = run_four(tmp_path, config, ["n0", "liar", "n2", "n3"], mode)
    assert not any(n.node_name == "liar" and n.alive for n in final.nodes)
    assert "(liar) evicted: 2 distinct auditors found it computing wrong" in coordinator_log
    # to before the liar's first step (step 0): every step redone without it
    assert "resume at step 0 (the newest cut before step 0)" in coordinator_log
    assert "rotation(s) effective after step 0: lineage" in coordinator_log  # and made again
    assert final.epochs_restarted >= 1
    assert final.audits_mismatched >= 2 and final.audits_matched >= 1
    # every mismatch was the liar's: the honest replicas audit each other all run long, unflagged
    accused = set(re.findall(r"found node (\w+) computing wrong", coordinator_log))
    assert accused == {liar_id[:8]}, accused
    assert any("liar" in line or "evicted" in line for line in final.audit_lines), final.audit_lines
    assert "audits:" in render(final, "here")


@pytest.mark.slow  # the rule itself runs in the default suite (tests/test_coordinator_audits.py)
def test_a_lying_auditor_is_evicted_and_the_honest_replicas_it_accused_stay(tmp_path):
    """A replica that computes honestly but reports every audit of its siblings as a mismatch: its
    accusations stay unconfirmed, the siblings' clean audits of each other contradict them, and it
    is evicted without a rollback; the run ends with the single-process losses."""
    config = audited_run(tmp_path)
    _, coordinator_log, accuser_id = run_four(tmp_path, config, ["n0", "n1", "accuser", "n3"], "accuse")
    assert f"node {accuser_id[:8]} (accuser) evicted: its" in coordinator_log, coordinator_log[-3000:]
    assert "distinct auditors found it computing wrong" not in coordinator_log  # no honest node evicted
