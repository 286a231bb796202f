"""The step engine: microbatch orders per schedule, their merge into one process, the end-of-step syncs."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from swarm.node.schedule import StageRunner
from swarm.node.stage_host import connect_local

from swarm.core.config import RunConfig
from swarm.ops.metrics import Metrics
from swarm.runtime.pipeline import LocalPipeline
from swarm.runtime.steps import (
    BACKWARD,
    FORWARD,
    Action,
    Receive,
    Send,
    pipeline_order,
    run_in_process,
    stage_order,
)
from swarm.runtime.wire import BoundarySync
from tests.helpers import random_batch, tiny_config

SHAPES = [(p, m) for p in range(1, 6) for m in range(1, 7)]


def peak_in_flight(order: list[Action]) -> int:
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def backwards(order: list[Action]) -> list[int]:
    return [position for kind, position in order if kind == BACKWARD]


def test_gpipe_runs_every_forward_then_every_backward_in_reverse():
    for n_stages, n in SHAPES:
        for stage in range(n_stages):
            order = stage_order("gpipe", n_stages, stage, n)
            backward = [Action(BACKWARD, i) for i in reversed(range(n))]
            assert order == [Action(FORWARD, i) for i in range(n)] + backward


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_every_microbatch_is_forwarded_then_backpropagated_once(schedule):
    for n_stages, n in SHAPES:
        for stage in range(n_stages):
            order = stage_order(schedule, n_stages, stage, n)
            assert sorted(order) == sorted(Action(kind, i) for kind in (FORWARD, BACKWARD) for i in range(n))
            assert all(order.index(Action(FORWARD, i)) < order.index(Action(BACKWARD, i)) for i in range(n))
            assert [p for kind, p in order if kind == FORWARD] == list(range(n))


def test_1f1b_holds_at_most_p_minus_s_microbatches_and_backpropagates_in_order():
    for n_stages, n in SHAPES:
        for stage in range(n_stages):
            order = stage_order("1f1b", n_stages, stage, n)
            assert peak_in_flight(order) == min(n_stages - stage, n)
            assert backwards(order) == list(range(n))
        last = "".join(kind for kind, _ in stage_order("1f1b", n_stages, n_stages - 1, n))
        assert last == "FB" * n


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_stage_backpropagates_in_its_downstream_neighbours_order(schedule):
    """So the gradients a stage receives arrive in the order its schedule expects them."""
    for n_stages, n in SHAPES:
        orders = [backwards(stage_order(schedule, n_stages, s, n)) for s in range(n_stages)]
        assert all(order == orders[-1] for order in orders)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_merged_order_keeps_each_stage_order_and_the_data_flow(schedule):
    for n_stages, n in SHAPES:
        merged = pipeline_order(schedule, n_stages, n)
        for s in range(n_stages):
            assert [a for stage, a in merged if stage == s] == stage_order(schedule, n_stages, s, n)
        when = {item: t for t, item in enumerate(merged)}
        for (stage, action), t in when.items():
            source = stage - 1 if action.kind == FORWARD else stage + 1
            if 0 <= source < n_stages:
                assert when[source, action] < t


def test_the_merged_gpipe_order_is_the_classic_one():
    """Each microbatch forward through all stages, then each backward through all, newest first."""
    n_stages, n = 3, 4
    forward = [(s, Action(FORWARD, i)) for i in range(n) for s in range(n_stages)]
    backward = [(s, Action(BACKWARD, i)) for i in reversed(range(n)) for s in reversed(range(n_stages))]
    assert pipeline_order("gpipe", n_stages, n) == forward + backward


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        stage_order("interleaved", 4, 0, 4)


def test_in_process_programs_exchange_messages_and_count_their_bytes():
    def program(index: int, n: int):
        """Send a token both ways, then add up what the neighbours sent."""
        if index + 1 < n:
            yield Send(True, BoundarySync(0, index, mapl_gradients=bytes([index])))
        if index > 0:
            yield Send(False, BoundarySync(0, index - 1, codebook_delta=bytes([index, index])))
        got = []
        if index > 0:
            got += (yield Receive(False, "from upstream")).mapl_gradients
        if index + 1 < n:
            got += (yield Receive(True, "from downstream")).codebook_delta
        return got

    results, moved = run_in_process([program(i, 3) for i in range(3)])
    assert results == [[1, 1], [0, 2, 2], [1]]
    assert moved == 2 * 1 + 2 * 2


def test_in_process_programs_waiting_for_nothing_fail():
    def waits():
        yield Receive(False, "a delta nobody sends")

    def idle():
        return None
        yield

    with pytest.raises(RuntimeError, match="nobody sends"):
        run_in_process([idle(), waits()])


@pytest.mark.parametrize(
    ("schedule", "settings"),
    [
        ("gpipe", {}),
        ("1f1b", {}),
        ("gpipe", {"kind": "mapl", "rank": 0, "forward_format": "rvq"}),
        ("1f1b", {"precision": "bf16"}),
    ],
)
def test_stage_runners_and_the_single_process_pipeline_are_one_engine(schedule, settings):
    """Runners over in-memory links train bit for bit what the single-process pipeline trains on the
    same schedule: the same order per stage, the same MAPL sums and RVQ deltas, the same bf16 layers."""
    assert_runners_match_the_pipeline(
        tiny_config(batch_size=8, microbatches=4, schedule=schedule, **settings)
    )


def assert_runners_match_the_pipeline(config: RunConfig, steps: int = 3) -> None:
    """Stage runners over in-memory links and ``LocalPipeline`` on the config's schedule: the same
    losses and, after ``steps`` steps, bit-identical parameters."""
    schedule = config.train.schedule
    reference = LocalPipeline(config, schedule=schedule)
    expected = [reference.train_step(step, random_batch(config, seed=step)).loss for step in range(steps)]
    workers = LocalPipeline(config, frames=True).workers
    batches = lambda step: random_batch(config, seed=step)  # noqa: E731
    runners = [StageRunner(w, Metrics("node"), batches if w.is_first else None) for w in workers]
    for up, down in itertools.pairwise(runners):
        connect_local(up, down, "")

    async def main() -> list[float]:
        losses = []
        for step in range(steps):
            *_, last = await asyncio.gather(*(r.run_step(step) for r in runners))
            losses.append(last.stats.loss_sum / last.stats.loss_count)
        return losses

    assert asyncio.run(asyncio.wait_for(main(), 60)) == pytest.approx(expected, rel=1e-12, abs=0)
    for mine, theirs in zip(workers, reference.workers, strict=True):
        for a, b in zip(mine.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b)
