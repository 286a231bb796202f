"""Runs that survive churn, with real processes, ``kill -9``, SIGSTOP and a restarted coordinator.

Determinism is the witness: on one machine a recovered run must reproduce, step for
step, the losses of the same run without interruption (the same swarm, undisturbed),
because every stage resumes from the same cut with its exact parameters, optimizer
moments, subspace state (basis, version, the statistic toward the next rotation) and
data position. Rotations are on, so a rollback also replays boundary statistics and
re-applies rotations the coordinator had already published.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.core.config import CheckpointConfig, CodecConfig, RotationConfig, RunConfig
from swarm.io.data import BatchSampler, batch_ids, load_dataset
from swarm.launch.chaos import ChaosMonkey, Kill
from swarm.runtime.pipeline import LocalPipeline
from tests.procs import (
    Proc,
    coordinator,
    free_port,
    node,
    processes,
    status,
    tiny_run,
    wait_for_nodes,
    wait_status,
)

STEPS, INTERVAL, DEAD_AFTER = 80, 5, "4"
ROTATE_EVERY = 10  # rotations on: a rollback replays statistics and re-applies published rotations
LINK = ("--link-latency-ms", "15")  # slows each step to ~0.1 s, so a kill lands mid-run
CHUNKED = ("--snapshot-chunk-kb", "16")  # these stages' snapshots (0.5-1 MB) in many chunks


def churn_config(folder: Path) -> RunConfig:
    config = tiny_run(folder, STEPS, n_stages=3, checkpoint_interval=INTERVAL)
    config.rotation = RotationConfig(interval=ROTATE_EVERY, max_angle=0.1)
    return config


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """Per-step losses of the uninterrupted run: the same swarm, nobody killed."""
    folder = tmp_path_factory.mktemp("reference")
    config = churn_config(folder)
    with processes() as procs:
        address = coordinator(procs, folder, config, "--dead-after", DEAD_AFTER)
        nodes = start_nodes(procs, folder, address, 3)
        final = run_complete(address)
        for proc in nodes:
            assert proc.wait(60) == 0, proc.output()
    assert final.epochs_restarted == 0
    # It is the model the single-process pipeline trains (rotations: to float tolerance).
    t = config.train
    sampler = BatchSampler(load_dataset(config, folder / "cache").train, t.batch_size, t.seq_len, t.seed)
    pipe = LocalPipeline(config)
    single = [pipe.train_step(step, batch_ids(*sampler.next_batch())).loss for step in range(t.steps)]
    losses = [s.loss for s in final.steps]
    assert max(abs(a - b) / b for a, b in zip(losses, single, strict=True)) < 1e-3
    assert losses[:ROTATE_EVERY] == single[:ROTATE_EVERY]  # bit for bit until the first rotation
    return losses


def assert_reproduces(final: coordinator_pb2.StatusReply, reference: list[float]) -> None:
    losses = [s.loss for s in final.steps]
    assert [s.step for s in final.steps] == list(range(STEPS))
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True)]
    assert max(rel) < 1e-5, [(i, f"{r:.1e}") for i, r in enumerate(rel) if r > 0]


def start_nodes(procs: list[Proc], folder: Path, address: str, count: int, *flags: str) -> list[Proc]:
    """``count`` nodes joining one after another: node i hosts stage i, the rest are standbys."""
    nodes = []
    for i in range(count):
        nodes.append(node(procs, folder, f"n{i}", address, *LINK, *flags))
        wait_for_nodes(address, i + 1)
    return nodes


def host_of(address: str, stage: int) -> str:
    (name,) = [n.node_name for n in status(address).nodes if n.alive and stage in n.stages]
    return name


def resumed_from(proc: Proc, stage: int) -> list[int]:
    """The steps ``proc`` started its epochs from while hosting ``stage``."""
    return [int(m[1]) for m in re.finditer(rf"hosts stages \[{stage}\] .*from step (\d+)\)", proc.stdout())]


def past_a_cut(cut: int):
    """A Status predicate: a cut at or after ``cut`` is stored and training is 3 steps past it, so a
    node lost now makes the run redo steps."""
    return lambda r: r.latest_cut >= cut and r.steps_completed >= r.latest_cut + 3


def run_complete(address: str) -> coordinator_pb2.StatusReply:
    return wait_status(address, lambda r: r.run_complete, "completed run", 240)


class Witness:
    """Marks the moment a node is lost and reports (``pytest -s``) what it cost: the recovery time
    and the steps redone, read off the coordinator's step completion times as ``swarm up --chaos``
    does."""

    def __init__(self, scenario: str):
        self.scenario, self.monkey = scenario, ChaosMonkey(every_s=0)

    def lost(self, address: str, node: str) -> None:
        reply = status(address)
        self.monkey.killed(node, reply.steps_completed - 1, reply.latest_cut - 1)

    def report(self, final: coordinator_pb2.StatusReply) -> Kill:
        self.monkey.observe({s.step: s.completed_at for s in final.steps})
        (kill,) = self.monkey.kills
        print(f"MEASURED {self.scenario}: recovery {kill.recovery_s:.2f} s, {kill.steps_redone} steps redone")
        return kill


def test_standby_replaces_a_killed_node_and_the_run_reproduces_its_losses(tmp_path, reference):
    with processes() as procs:
        address = coordinator(procs, tmp_path, churn_config(tmp_path), "--dead-after", DEAD_AFTER)
        n0, n1, n2, standby = start_nodes(procs, tmp_path, address, 4)
        assert host_of(address, 1) == "n1"
        before = wait_status(address, past_a_cut(2 * INTERVAL), "two checkpoint cuts and 3 steps past", 120)
        witness = Witness("kill -9 with a standby")
        n1.p.kill()
        witness.lost(address, "n1")
        final = run_complete(address)
        for proc in (n0, n2, standby):
            assert proc.wait(60) == 0, proc.output()
    assert_reproduces(final, reference)
    assert final.epochs_restarted >= 1
    (resume,) = resumed_from(standby, 1)
    assert resume >= before.latest_cut and resume % INTERVAL == 0
    assert "finished 80 steps on stages [1]" in standby.stdout()
    assert witness.report(final).steps_redone < 2 * INTERVAL


@pytest.mark.slow  # the default suite replaces a killed node with a standby (the test above)
def test_a_fresh_node_joining_later_takes_the_dead_nodes_stage(tmp_path, reference):
    with processes() as procs:
        address = coordinator(procs, tmp_path, churn_config(tmp_path), "--dead-after", DEAD_AFTER)
        n0, n1, n2 = start_nodes(procs, tmp_path, address, 3)
        wait_status(address, past_a_cut(INTERVAL), "a checkpoint cut and 3 steps past it", 120)
        witness = Witness("kill -9, a fresh node joins 10 s later")
        n1.p.kill()
        witness.lost(address, "n1")
        time.sleep(10)
        waiting = status(address)
        assert not waiting.run_complete and [n.alive for n in waiting.nodes] == [True, False, True]
        fresh = node(procs, tmp_path, "fresh", address, *LINK)
        final = run_complete(address)
        for proc in (n0, n2, fresh):
            assert proc.wait(60) == 0, proc.output()
    assert_reproduces(final, reference)
    assert resumed_from(fresh, 1)[0] >= INTERVAL
    assert witness.report(final).recovery_s > 10


def test_a_killed_coordinator_restarted_on_its_state_file_resumes_the_run(tmp_path, reference):
    config, port = churn_config(tmp_path), free_port()
    with processes() as procs:
        address = coordinator(procs, tmp_path, config, "--dead-after", DEAD_AFTER, port=port)
        nodes = start_nodes(procs, tmp_path, address, 3)
        wait_status(address, past_a_cut(INTERVAL), "a checkpoint cut and 3 steps past it", 120)
        procs[0].p.kill()
        procs[0].p.wait(10)
        time.sleep(3)  # the nodes train on (their streams are peer to peer); reports queue up
        coordinator(procs, tmp_path, config, "--dead-after", DEAD_AFTER, port=port, name="coordinator2")
        final = run_complete(address)
        for proc in nodes:
            assert proc.wait(60) == 0, proc.output()
    assert_reproduces(final, reference)
    assert final.epochs_restarted == 0  # a pause, not a failure: nothing was rolled back


@pytest.mark.slow  # fencing itself: tests/test_coordinator.py
def test_a_frozen_node_is_replaced_and_fenced_when_it_wakes(tmp_path, reference):
    with processes() as procs:
        address = coordinator(procs, tmp_path, churn_config(tmp_path), "--dead-after", DEAD_AFTER)
        n0, n1, n2, standby = start_nodes(procs, tmp_path, address, 4)
        wait_status(address, past_a_cut(INTERVAL), "a checkpoint cut and 3 steps past it", 120)
        witness = Witness("SIGSTOP past the death timeout, standby takes over")
        n1.p.send_signal(signal.SIGSTOP)
        witness.lost(address, "n1")
        try:
            wait_status(
                address,
                lambda r: any(n.node_name == "n3" and 1 in n.stages for n in r.nodes),
                "the standby taking stage 1",
                60,
            )
        finally:
            n1.p.send_signal(signal.SIGCONT)
        assert n1.wait(60) == 3, n1.output()
        assert "node fenced" in n1.stdout() and "replaced" in n1.stdout()
        final = run_complete(address)
        for proc in (n0, n2, standby):
            assert proc.wait(60) == 0, proc.output()
    assert_reproduces(final, reference)
    witness.report(final)


@pytest.mark.slow  # the fallback itself: tests/test_coordinator.py
def test_a_corrupted_latest_snapshot_falls_back_to_the_previous_cut(tmp_path, reference):
    """Snapshots uploaded to the coordinator (no keepers): its copy fails its hash check."""
    with processes() as procs:
        address = coordinator(
            procs, tmp_path, churn_config(tmp_path), "--dead-after", DEAD_AFTER, "--snapshot-keepers", "0"
        )
        nodes = start_nodes(procs, tmp_path, address, 4)
        wait_status(address, past_a_cut(2 * INTERVAL), "two checkpoint cuts and 3 steps past", 120)
        for proc in nodes:  # freeze the swarm so that no newer cut completes meanwhile
            proc.p.send_signal(signal.SIGSTOP)
        latest = status(address).latest_cut
        with sqlite3.connect(tmp_path / "state.sqlite") as db:
            (digest,) = db.execute(
                "SELECT digest FROM checkpoints WHERE step = ? AND stage = 0", (latest - 1,)
            ).fetchone()
        stored = tmp_path / "state.sqlite.artifacts" / f"{digest}.bin"
        stored.write_bytes(stored.read_bytes()[: stored.stat().st_size // 2])  # truncated
        witness = Witness("kill -9 after the latest cut was corrupted")
        nodes[1].p.kill()
        witness.lost(address, "n1")
        for proc in nodes:
            proc.p.send_signal(signal.SIGCONT)
        final = run_complete(address)
        for proc in (nodes[0], nodes[2], nodes[3]):
            assert proc.wait(60) == 0, proc.output()
    assert_reproduces(final, reference)
    assert resumed_from(nodes[3], 1) == [latest - INTERVAL]
    assert "failed its hash check" in (tmp_path / "coordinator.err").read_text()
    assert witness.report(final).steps_redone >= INTERVAL


def replace_the_host_of_stage_1(
    tmp_path: Path, reference: list[float], before_join=lambda: None
) -> tuple[coordinator_pb2.StatusReply, Proc]:
    """Three nodes, each snapshot kept by the two others; the host of stage 1 is killed, declared dead,
    ``before_join()`` runs, and a fresh node restores stage 1 from its keepers. The final Status and
    the fresh node."""
    with processes() as procs:
        flags = ("--dead-after", DEAD_AFTER, "--snapshot-keepers", "2")
        address = coordinator(procs, tmp_path, churn_config(tmp_path), *flags)
        n0, n1, n2 = start_nodes(procs, tmp_path, address, 3, *CHUNKED)
        cut = wait_status(address, past_a_cut(2 * INTERVAL), "two checkpoint cuts and 3 steps past", 120)
        kept = [
            tmp_path / keeper / "snapshots" for keeper in ("n0", "n2")
        ]  # a cut at s: the state after s - 1
        wait_status(
            address,
            lambda _: all(any(k.glob(f"stage1-step{cut.latest_cut - 1:010d}-*.snap")) for k in kept),
            "both keepers holding stage 1 of the latest cut",
            60,
        )
        # while every node runs (at the end they leave, and the final cut goes to the coordinator)
        assert "stay with their hosts and 2 keeper(s)" in status(address).snapshot_holding
        n1.p.kill()
        wait_status(address, lambda r: not r.nodes[1].alive, "n1 declared dead", 30)
        before_join()
        fresh = node(procs, tmp_path, "fresh", address, *LINK, *CHUNKED)
        final = run_complete(address)
        for proc in (n0, n2, fresh):
            assert proc.wait(60) == 0, proc.output()
    assert_reproduces(final, reference)
    return final, fresh


def fetched_from(proc: Proc, stage: int, step: int) -> int:
    """From how many holders ``proc`` fetched the snapshot of ``stage`` after ``step``."""
    pattern = rf"snapshot of stage {stage} after step {step}: \d+ bytes verified from (\d+) holder"
    (holders,) = re.findall(pattern, proc.stdout())
    return int(holders)


def test_a_newcomer_fetches_its_stage_from_two_keepers_and_the_coordinator_keeps_only_the_final_cut(
    tmp_path, reference
):
    final, fresh = replace_the_host_of_stage_1(tmp_path, reference)
    resume = resumed_from(fresh, 1)[0]
    assert fetched_from(fresh, 1, resume - 1) == 2  # restored bit for bit: the run reproduces its losses
    assert not final.bad_holders
    with sqlite3.connect(tmp_path / "state.sqlite") as db:
        rows = db.execute("SELECT digest FROM checkpoints WHERE step = ?", (STEPS - 1,)).fetchall()
    on_disk = {path.stem for path in (tmp_path / "state.sqlite.artifacts").glob("*")}
    assert on_disk == {digest for (digest,) in rows}  # the final cut only (the trained model's)


@pytest.mark.slow
def test_a_keeper_serving_corrupt_chunks_is_refused_reported_and_the_restore_completes(tmp_path, reference):
    def corrupt_what_n0_keeps() -> None:
        for path in (tmp_path / "n0" / "snapshots").glob("stage1-step*.snap"):
            data = bytearray(path.read_bytes())
            for offset in range(100, len(data), 16 << 10):  # a byte in every chunk
                data[offset] ^= 0xFF
            path.write_bytes(bytes(data))

    final, fresh = replace_the_host_of_stage_1(tmp_path, reference, corrupt_what_n0_keeps)
    n0 = next(n.node_id for n in final.nodes if n.node_name == "n0")
    assert fetched_from(fresh, 1, resumed_from(fresh, 1)[0] - 1) == 1
    assert any(line.startswith(f"node {n0[:8]} served a bad chunk") for line in final.bad_holders)


@pytest.mark.slow  # a signalled stop: tests/test_node.py, tests/test_swarm.py
def test_sigterm_leaves_after_a_final_cut_and_the_replacement_loses_nothing(tmp_path, reference):
    with processes() as procs:
        address = coordinator(procs, tmp_path, churn_config(tmp_path), "--dead-after", DEAD_AFTER)
        n0, n1, n2, standby = start_nodes(procs, tmp_path, address, 4)
        wait_status(address, lambda r: r.steps_completed >= 12, "training progress", 120)
        witness = Witness("SIGTERM: graceful leave, standby takes over")
        n1.p.send_signal(signal.SIGTERM)
        witness.lost(address, "n1")
        assert n1.wait(60) == 0, n1.output()
        assert "left the run after a snapshot cut at step" in n1.stdout()
        last_snapshot = max(int(m[1]) for m in re.finditer(r"stage 1 after step (\d+)", n1.stdout()))
        final = run_complete(address)
        for proc in (n0, n2, standby):
            assert proc.wait(60) == 0, proc.output()
    assert_reproduces(final, reference)
    # The replacement starts right after the leaver's final snapshot: no step is redone.
    assert resumed_from(standby, 1) == [last_snapshot + 1]
    assert witness.report(final).steps_redone == 0


# 25 s with both cores hogged; the other churn tests keep the reaping paths in the default suite
@pytest.mark.slow
def test_readme_recipe_on_a_busy_cpu_reaps_nobody_during_setup(tmp_path):
    """Two processes keep both cores busy while the nodes set up (BPE tokenizer, model build)."""
    hogs = [
        Proc(["python3", "-c", "while True: pass"], tmp_path / f"hog{i}.err", start_new_session=True)
        for i in range(2)
    ]
    try:
        config = tiny_run(tmp_path, 6, n_stages=2)
        config.data.source, config.data.tokenizer = None, "bpe"  # the bundled corpus, as the README
        with processes() as procs:
            # 5 s, not the default 15: setup on the loaded cores takes longer than that, so a node
            # whose heartbeats waited for setup (as they once did) would be reaped here.
            address = coordinator(procs, tmp_path, config, "--dead-after", "5")
            nodes = [node(procs, tmp_path, f"n{i}", address) for i in range(2)]
            final = run_complete(address)
            for proc in nodes:
                assert proc.wait(60) == 0, proc.output()
    finally:
        for hog in hogs:
            os.killpg(hog.p.pid, signal.SIGKILL)
            hog.p.wait()
    assert final.epochs_restarted == 0 and all(n.alive or not n.stages for n in final.nodes)


@pytest.mark.slow
def test_a_mapl_rvq_run_resumes_exactly_after_a_kill(tmp_path):
    """MAPL boundary maps and RVQ codebooks are boundary state both neighbours hold: a cut must
    capture both sides at the same codebook version, and the sender's learning state."""

    def mapl_rvq(folder: Path) -> RunConfig:
        config = tiny_run(folder, 40, n_stages=3, checkpoint_interval=INTERVAL)
        config.model.subspace_rank = 0
        config.codec = CodecConfig(kind="mapl", forward_format="rvq", backward_format="bf16", mapl_rank=16)
        return config

    losses = []
    for run, kill in (("calm", False), ("churn", True)):
        folder = tmp_path / run
        folder.mkdir()
        with processes() as procs:
            address = coordinator(procs, folder, mapl_rvq(folder), "--dead-after", DEAD_AFTER)
            nodes = start_nodes(procs, folder, address, 4)
            if kill:
                wait_status(address, past_a_cut(INTERVAL), "a checkpoint cut and 3 steps past it", 120)
                nodes[1].p.kill()
            final = run_complete(address)
        assert (final.epochs_restarted > 0) == kill
        losses.append([s.loss for s in final.steps])
    assert losses[0] == losses[1]


def test_a_middle_stage_with_no_copy_left_is_rebuilt_from_its_neighbours(tmp_path, reference):
    """checkpoint.lost_stage = "rebuild": stage 1's host and its only keeper (the standby) die together;
    a fresh node rebuilds stage 1 from stages 0 and 2 at the newest cut instead of the run restarting
    from step 0 (no older cut has stage 1 either)."""
    config = churn_config(tmp_path)
    config.checkpoint = CheckpointConfig(interval=INTERVAL, lost_stage="rebuild")
    with processes() as procs:
        address = coordinator(procs, tmp_path, config, "--dead-after", DEAD_AFTER)
        n0, n1, n2, standby = start_nodes(procs, tmp_path, address, 4)
        cut = wait_status(address, past_a_cut(2 * INTERVAL), "two checkpoint cuts and 3 steps past", 120)
        n1.p.kill()
        standby.p.kill()  # the keeper of every snapshot: nobody holds stage 1 any more
        wait_status(
            address, lambda r: not r.nodes[1].alive and not r.nodes[3].alive, "both declared dead", 30
        )
        fresh = node(procs, tmp_path, "fresh", address, *LINK)
        final = run_complete(address)
        for proc in (n0, n2, fresh):
            assert proc.wait(60) == 0, proc.output()
        coordinator_log = procs[0].stderr()
    rebuilds = {
        int(m) for m in re.findall(r"stage 1: rebuilt from stages 0 and 2 after step (\d+)", fresh.stdout())
    }
    # (once seen failing on a loaded machine, not reproduced alone: the logs say which cut resumed)
    assert len(rebuilds) == 1, fresh.output() + coordinator_log
    (rebuilt_after,) = rebuilds
    assert rebuilt_after >= cut.latest_cut - 1 and (rebuilt_after + 1) % INTERVAL == 0
    assert final.rebuilt_stages and "stage 1 rebuilt" in final.rebuilt_stages[0]
    losses = [s.loss for s in final.steps]
    assert [s.step for s in final.steps] == list(range(STEPS))
    assert losses[: rebuilt_after + 1] == reference[: rebuilt_after + 1]  # nothing before the cut redone
    assert losses[rebuilt_after + 1] != reference[rebuilt_after + 1]  # a rebuilt stage is not the lost one
    print(f"MEASURED rebuild after step {rebuilt_after}: final loss {losses[-1]:.4f} ({reference[-1]:.4f})")
