"""Several nodes per stage: microbatches dealt by measured throughput, routes that keep every frame
on one pair of neighbouring replicas, and live swarms whose replicated stages average their
gradients over hivemind (loopback, NAT port mapping off) and train the single-process model."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
from swarm.node.schedule import StepCounts

from bench.replica_sync import connected_groups
from swarm.core.config import ReplicaSyncConfig, RotationConfig, RunConfig, TrainConfig
from swarm.core.subspace import initial_artifacts
from swarm.io.data import BatchSampler, batch_ids, load_dataset
from swarm.runtime.pipeline import LocalPipeline
from swarm.runtime.replicas import Routes, deal
from swarm.runtime.worker import StageWorker
from tests.helpers import random_batch, tiny_config
from tests.procs import Proc, coordinator, node, processes, tiny_run, wait_for_nodes, wait_status
from tests.test_averaging import averagers, p2p_group, run


def test_deal_gives_every_replica_a_share_by_throughput():
    assert deal(4, [1.0]) == [[0, 1, 2, 3]]
    assert deal(4, [0.0, 0.0]) == [[0, 2], [1, 3]]  # nothing measured: alternate
    assert deal(8, [300.0, 100.0]) == [[0, 2, 3, 4, 5, 6], [1, 7]]  # 3x as fast: 3x the microbatches
    assert deal(8, [300.0, 0.0]) == [[0, 2, 4, 6], [1, 3, 5, 7]]  # unmeasured: the measured mean
    for rates in ([5.0, 0.1, 0.1], [0.0, 7.0, 3.0], [1.0] * 4):
        dealt = deal(8, rates)  # every replica gets one at least; a partition: nothing twice, none lost
        assert all(dealt) and sorted(mb for share in dealt for mb in share) == list(range(8))
    with pytest.raises(ValueError, match="cannot share"):
        deal(2, [1.0, 1.0, 1.0])


def test_routes_follow_the_microbatch_owners_of_the_neighbouring_stages():
    owners = [dict.fromkeys(range(4), "a"), {0: "b", 1: "x", 2: "b", 3: "x"}, dict.fromkeys(range(4), "c")]
    assert Routes.of(1, "x", owners) == Routes((1, 3), {1: "a", 3: "a"}, {1: "c", 3: "c"})
    assert Routes.of(0, "a", owners) == Routes((0, 1, 2, 3), {}, {0: "b", 1: "x", 2: "b", 3: "x"})
    assert Routes.of(2, "c", owners).upstream == {0: "b", 1: "x", 2: "b", 3: "x"}
    assert Routes.alone(2, "u", "d") == Routes((0, 1), {0: "u", 1: "u"}, {0: "d", 1: "d"})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"replicas": 3}, "train.replicas=3 must lie in"),
        ({"replicas": 2, "kind": "mapl"}, "boundary codecs"),
        ({"replicas": 2, "forward_format": "rvq"}, "boundary codecs"),
    ],
)
def test_replicas_refuse_what_they_cannot_keep_identical(change: dict, message: str):
    base = RunConfig()
    train = dataclasses.replace(base.train, replicas=change.pop("replicas"))
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(base, train=train, codec=dataclasses.replace(base.codec, **change))


STEPS = 30


def replica_run(folder: Path, schedule: str) -> RunConfig:
    """Two stages, four microbatches a step, up to two replicas per stage, rotations on (so the
    replicas also sum their boundary statistics)."""
    config = tiny_run(folder, STEPS, n_stages=2, checkpoint_interval=10)
    config.train = TrainConfig(
        steps=STEPS,
        batch_size=8,
        seq_len=32,
        microbatches=4,
        warmup_steps=2,
        replicas=2,
        schedule=schedule,
        lr=3e-3,  # tiny_run's
    )
    config.rotation = RotationConfig(interval=5, max_angle=0.1)
    return RunConfig.from_dict(config.to_dict())  # validated


def single_process_losses(config: RunConfig, folder: Path) -> list[float]:
    t = config.train
    sampler = BatchSampler(load_dataset(config, folder / "cache").train, t.batch_size, t.seq_len, t.seed)
    pipe = LocalPipeline(config)
    return [pipe.train_step(step, batch_ids(*sampler.next_batch())).loss for step in range(t.steps)]


def replica_lines(proc: Proc) -> list[str]:
    return re.findall(r"one of \d+ replicas, \d+ of \d+ microbatches per step", proc.stdout())


def run_three_nodes(tmp_path, config: RunConfig):
    """A coordinator and three nodes joining one after another, run to completion: the final status
    and the node processes (each exited 0)."""
    with processes() as procs:
        address = coordinator(procs, tmp_path, config, dht=True)
        nodes = []
        for i in range(3):
            nodes.append(node(procs, tmp_path, f"n{i}", address, dht=True))
            wait_for_nodes(address, i + 1)
        final = wait_status(address, lambda r: r.run_complete, "completed run", 240)
        for proc in nodes:
            assert proc.wait(60) == 0, proc.output()
    return final, nodes


@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("1f1b", marks=pytest.mark.slow)])
def test_a_replicated_stage_trains_the_single_process_model(tmp_path, schedule):
    """Three nodes on two stages: the third becomes a replica of a stage, the stage's microbatches
    are dealt between its two replicas, which average their gradients every step; the losses are
    the single-process pipeline's (fp32, up to summation order) and every step counts each token
    of its batch once."""
    config = replica_run(tmp_path, schedule)
    final, nodes = run_three_nodes(tmp_path, config)
    hosts = {n.node_name: list(n.last_stages) for n in final.nodes}
    assert sorted(hosts.values()) in ([[0], [0], [1]], [[0], [1], [1]]), hosts
    replicas = [p for p in nodes if replica_lines(p)]
    assert len(replicas) == 2, [p.output() for p in nodes]
    for proc in nodes:  # every P2P (the replicas average over theirs) on loopback only
        (joined,) = re.findall(r"DHT joined at (.*)", proc.stdout())
        assert all(m.startswith("/ip4/127.0.0.1/") for m in joined.split(", ")), joined
    shares = [int(re.search(r"(\d+) of 4 microbatches", replica_lines(p)[-1])[1]) for p in replicas]
    assert sum(shares) == 4 and min(shares) >= 1, shares  # dealt by measured capacity
    t = config.train
    assert [s.step for s in final.steps] == list(range(STEPS))
    assert all(s.tokens == t.batch_size * t.seq_len for s in final.steps)  # every token once
    losses = [s.loss for s in final.steps]
    single = single_process_losses(config, tmp_path)
    rel = [abs(a - b) / b for a, b in zip(losses, single, strict=True)]
    assert max(rel) < 1e-4, rel


OUTER_SYNC = re.compile(r"stage (\d+) averaging: .*; (\d+) outer syncs, (\d+) bytes sent per sync")


# Slow suite (a live 3-node swarm with a P2P group; CI's default suite covers outer steps through
# tests/test_outer_step.py, against a deterministic reference). Its final loss is bounded on one
# side only: against the per-step single-process run it came out at 1.02x in some runs and 0.58x
# in others (the outer Nesterov step, lr 0.7 and momentum 0.9, trains faster than per-step
# averaging on this 20-step run, by how much depends on how the coordinator deals the microbatches
# between the replicas by their measured speed: 3+1 or 2+2).
@pytest.mark.slow
@pytest.mark.parametrize("overlap", [0, 1])
def test_replicas_taking_outer_steps_train_and_sync_in_int8(tmp_path, overlap: int):
    """The live swarm of the test above with ``replica_sync.mode = "outer"`` (no rotations: refused
    with outer steps): the two replicas of a stage step on their own microbatches and sync every 4
    steps and at each cut; the run completes every step with finite losses, each step counting
    each token once, and a sync sends about 1 byte per trainable parameter per replica (int8: its
    half of the pseudo-gradient out, the averaged other half back); so too with each sync's
    all-reduce overlapping the next step (``overlap = 1``)."""
    config = replica_run(tmp_path, "gpipe")
    config.rotation = RotationConfig()
    config.replica_sync = ReplicaSyncConfig(mode="outer", every=4, format="int8", overlap=overlap)
    config = RunConfig.from_dict(config.to_dict())
    final, nodes = run_three_nodes(tmp_path, config)
    syncs = [m for p in nodes for m in OUTER_SYNC.finditer(p.stdout())]
    assert len(syncs) == 2, [p.output() for p in nodes]  # one summary per replica
    stage = int(syncs[0][1])
    fixed, basis = initial_artifacts(config)
    parameters = sum(p.numel() for p in StageWorker(config, stage, fixed, basis).parameters())
    for m in syncs:
        assert int(m[2]) >= 3 and 1.0 <= int(m[3]) / parameters < 1.1, (m[0], parameters)
    t = config.train
    assert [s.step for s in final.steps] == list(range(STEPS))
    assert all(s.tokens == t.batch_size * t.seq_len for s in final.steps)
    losses = [s.loss for s in final.steps]
    single = single_process_losses(config, tmp_path)
    print(f"MEASURED outer-step losses / single-process at the end: {losses[-1] / single[-1]:.3f}")
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.9 * losses[0]  # it trains
    assert losses[-1] / single[-1] < 1.1  # and no worse than averaging every step


KILL_STEP = 15  # past the cut at step 9: the survivors go on from the step in flight, not from 10


@pytest.mark.parametrize("when", [pytest.param("forward", marks=pytest.mark.slow), "averaging"])
def test_a_replica_killed_mid_step_is_dropped_and_the_run_loses_nothing(tmp_path, when):
    """kill -9 (the whole process group: its P2P daemon dies too) of a stage replica while it
    computes a microbatch, or in the middle of the averaging round: the survivors' step fails, the
    coordinator finds the replica dead and starts an epoch without it right after the last completed
    step, every host resuming from its own state (no snapshot, nothing rolled back to the cut at
    step 9, no epoch restart counted), and the run finishes every step with the single-process
    losses, each step counting each token once."""
    config = replica_run(tmp_path, "gpipe")
    with processes() as procs:
        address = coordinator(procs, tmp_path, config, dht=True)
        for i in range(2):
            node(procs, tmp_path, f"n{i}", address, dht=True)
            wait_for_nodes(address, i + 1)
        dying = node(
            procs, tmp_path, "dying", address, dht=True, runner=("tests.dying_node", when, str(KILL_STEP))
        )
        final = wait_status(address, lambda r: r.run_complete, "completed run", 240)
        assert dying.wait(5) == -9, dying.output()
        assert replica_lines(dying), dying.output()
    (gone,) = [n for n in final.nodes if n.node_name == "dying"]
    assert not gone.alive and not gone.left and final.epochs_restarted == 0
    assert final.resume_step >= KILL_STEP  # at most the step in flight is redone
    coordinator_log = (tmp_path / "coordinator.err").read_text()
    assert "its siblings go on" in coordinator_log and "from the hosts' own states" in coordinator_log
    t = config.train
    assert [s.step for s in final.steps] == list(range(STEPS))
    assert all(s.tokens == t.batch_size * t.seq_len for s in final.steps)
    single = single_process_losses(config, tmp_path)
    rel = [abs(s.loss - b) / b for s, b in zip(final.steps, single, strict=True)]
    assert max(rel) < 1e-4, rel


def steady_rate(steps) -> float:
    """Tokens per second of step time over ``steps``, past their first three (start-up)."""
    steady = list(steps)[3:]
    return sum(s.tokens for s in steady) / sum(s.wall_seconds for s in steady)


# a minute of training to compare throughputs; the replicas suite keeps exactness by default
@pytest.mark.slow
def test_a_joining_node_becomes_a_replica_of_the_bottleneck_stage_and_throughput_rises(tmp_path):
    """Stage 1 computes 20x slower than it would (emulation.slowdown). A node joining the running
    two-node swarm becomes a replica of stage 1, not of the fast stage 0, and takes most of its
    microbatches (dealt by measured capacity): the swarm's tokens per second of step time rise."""
    config = replica_run(tmp_path, "gpipe")
    config.train = dataclasses.replace(config.train, steps=24)
    config.checkpoint = dataclasses.replace(config.checkpoint, interval=4)
    config.rotation = RotationConfig()
    config.emulation = dataclasses.replace(config.emulation, slow_stage=1, slowdown=20.0)
    with processes() as procs:
        address = coordinator(procs, tmp_path, config, dht=True)
        for i in range(2):
            node(procs, tmp_path, f"n{i}", address, dht=True)
            wait_for_nodes(address, i + 1)
        before = wait_status(address, lambda r: r.steps_completed >= 7, "7 steps", 120)
        joiner = node(procs, tmp_path, "joiner", address, dht=True)
        final = wait_status(address, lambda r: r.run_complete, "completed run", 240)
        assert joiner.wait(60) == 0, joiner.output()
    (joined,) = [n for n in final.nodes if n.node_name == "joiner"]
    assert list(joined.last_stages) == [1]
    assert re.search(r"one of 2 replicas, 3 of 4 microbatches", joiner.stdout()), joiner.output()
    with_replica = [s for s in final.steps if s.step >= final.resume_step]
    assert all(s.tokens == config.train.batch_size * config.train.seq_len for s in final.steps)
    rise = steady_rate(with_replica) / steady_rate(before.steps)
    print(f"MEASURED tokens/s with a replica of the slow stage / without: {rise:.2f}")
    assert rise > 1.3, rise


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_two_replicas_sum_to_one_replicas_step_on_the_global_batch(dtype, tolerance):
    """Two replicas of a stage, each running its dealt microbatches of a step, combine over hivemind
    (real P2P daemons on loopback): each ends with the gradient, tokens and loss of one worker that
    ran the whole step (fp64 1e-10, fp32 1e-5 relative)."""
    config = tiny_config(n_stages=1, microbatches=4, forward_format="fp64", backward_format="fp64")
    chunks = random_batch(config, seed=5).chunk(4)
    fixed, basis = initial_artifacts(config)

    def worker_on(microbatches: list[int]) -> StageWorker:
        worker = StageWorker(config, 0, fixed, basis, dtype=dtype)
        worker.begin_step(0)
        for mb in microbatches:
            worker.forward(0, mb, chunks[mb])
            worker.backward(0, mb)
        return worker

    whole, replicas = worker_on([0, 1, 2, 3]), [worker_on([0, 3]), worker_on([1, 2])]

    async def scenario() -> list[StepCounts]:
        p2ps = await p2p_group(2)
        try:
            group = await averagers(p2ps)
            groups = await connected_groups(p2ps, group, [2, 2], "run/1/0")
            counts = [
                StepCounts(w.stats.tokens, w.stats.loss_sum, w.stats.loss_count, 100 * (i + 1), 7, i == 1)
                for i, w in enumerate(replicas)
            ]
            return await asyncio.gather(
                *(g.combine(0, w, c) for g, w, c in zip(groups, replicas, counts, strict=True))
            )
        finally:
            for p in p2ps:
                await p.shutdown()

    combined = run(scenario())
    for worker in replicas:
        for mine, ref in zip(worker.parameters(), whole.parameters(), strict=True):
            scale = ref.grad.norm().clamp_min(1e-30)
            assert ((mine.grad - ref.grad).norm() / scale).item() < tolerance
    stats = whole.stats
    for c in combined:  # sums over the step; the cut mark of either replica
        assert (c.tokens, c.loss_count, c.wire_bytes_forward, c.wire_bytes_backward, c.cut) == (
            stats.tokens,
            stats.loss_count,
            300,
            14,
            True,
        )
        assert c.loss_sum == pytest.approx(stats.loss_sum, rel=tolerance)
