"""CheckFree rebuild of a lost middle stage: the layers from its neighbours, the coordinator's choice."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from swarm.coordinator.export import artifact_store
from swarm.coordinator.ledger import Ledger
from swarm.coordinator.state import CheckpointRecord

from swarm.codecs.base import PayloadError
from swarm.core.config import CheckpointConfig
from swarm.io import checkpoint
from swarm.ops.metrics import Metrics
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config
from tests.test_keepers import keepers_of, roster_of, state  # noqa: F401 (the state fixture)


def trained(config, steps: int = 3) -> LocalPipeline:
    pipeline = LocalPipeline(config)
    for step in range(steps):
        pipeline.train_step(step, random_batch(config, step))
    return pipeline


def test_a_rebuilt_stage_takes_the_mean_of_its_neighbours_layers_and_a_fresh_optimizer():
    config = tiny_config(n_stages=4)  # one layer per stage
    first = trained(config)
    captures = [checkpoint.from_bytes(checkpoint.to_bytes(checkpoint.capture(w, 2))) for w in first.workers]
    fresh = LocalPipeline(config).workers[1]
    assert checkpoint.rebuild(fresh, [captures[0], captures[2]]) == 2
    rebuilt = fresh.stage.state_dict()
    layer_keys = [k for k in rebuilt if k.startswith("layers.1.")]
    assert layer_keys and all(
        torch.equal(
            rebuilt[k],
            (captures[0]["model"]["layers.0" + k[8:]] + captures[2]["model"]["layers.2" + k[8:]]) / 2,
        )
        for k in layer_keys
    )
    assert torch.equal(rebuilt["basis"], captures[0]["model"]["basis"])
    assert fresh.version == captures[0]["version"]
    assert all(not opt.state for opt in fresh.optimizer.optimizers)  # fresh moments
    # It trains on with the others restored exactly (a finite loss: a usable stage, not a copy).
    resumed = LocalPipeline(config)
    for i, worker in enumerate(resumed.workers):
        if i == 1:
            checkpoint.rebuild(worker, [captures[0], captures[2]])
        else:
            checkpoint.restore(worker, captures[i])
    loss = resumed.train_step(3, random_batch(config, 3)).loss
    assert torch.isfinite(torch.tensor(loss))


def test_a_rebuild_refuses_wrong_neighbours_and_mixed_steps():
    config = tiny_config(n_stages=4)
    first = trained(config, steps=2)
    at = [checkpoint.capture(w, 1) for w in first.workers]
    worker = LocalPipeline(config).workers[1]
    with pytest.raises(PayloadError, match="rebuilt from stages 0 and 2"):
        checkpoint.rebuild(worker, [at[0], at[3]])
    with pytest.raises(PayloadError, match="different steps"):
        checkpoint.rebuild(worker, [at[0], checkpoint.capture(first.workers[2], 5)])
    other = tiny_config(n_stages=4, lr=1.0)
    with pytest.raises(PayloadError, match="another run configuration"):
        checkpoint.rebuild(LocalPipeline(other).workers[1], [at[0], at[2]])


def test_rebuild_is_refused_with_learned_boundary_state():
    with pytest.raises(ValueError, match="lost_stage"):
        CheckpointConfig(lost_stage="guess")
    config = tiny_config("mapl", rank=0, n_stages=4)
    with pytest.raises(ValueError, match="boundaries without learned state"):
        dataclasses.replace(config, checkpoint=CheckpointConfig(lost_stage="rebuild"))


@pytest.mark.parametrize("lost_stage", ["rollback", "rebuild"])
def test_the_coordinator_rebuilds_a_lost_middle_stage_or_rolls_back(state, tmp_path, lost_stage):  # noqa: F811
    config = dataclasses.replace(tiny_config(n_stages=3), checkpoint=CheckpointConfig(lost_stage=lost_stage))
    run = state.open_run(None, config)
    roster = roster_of(state, ("n0", [0], True), ("n1", [1], True), ("n2", [2], True), ("keeper", [], True))
    keepers = keepers_of(state, roster)
    metrics = Metrics("coordinator")
    ledger = Ledger(config, run, state, artifact_store(tmp_path / "state.sqlite", 1 << 20), keepers, metrics)
    hosts = ("n0", "n1", "n2")
    for step in (4, 9):
        for s, host in enumerate(hosts):
            record = CheckpointRecord(step, s, f"{s}{step % 10}" * 32, 100, 64, b"\0" * 64)
            keepers.hold(record.digest, host)
            keepers.hold(record.digest, "keeper")
            ledger.add_checkpoint(record)
    assert ledger.latest_cut() == 9
    for dead in ("n1", "keeper"):  # stage 1's host and its keeper: no copy of stage 1 is left
        roster.nodes[dead].alive = False
    ledger.start_epoch("a node died", progressed=True)
    if lost_stage == "rollback":  # no older cut has stage 1 either: back to step 0
        assert ledger.resume_step == 0 and ledger.rebuilding([0, 1, 2]) == []
        return
    assert ledger.resume_step == 10 and ledger.rebuilding([1, 2]) == [1]
    assert sorted((r.stage, r.step) for r in ledger.restore([1])) == [(0, 9), (2, 9)]
    assert [(r.stage, r.step) for r in ledger.restore([2])] == [(2, 9)]
    assert metrics.stage_rebuilds._value.get() == 1
    assert ledger.rebuilt_lines() and "stage 1 rebuilt from stages 0 and 2" in ledger.rebuilt_lines()[0]
    # Another failure before the next cut resumes from the same cut, rebuilding again (counted once).
    ledger.start_epoch("another node died", progressed=True)
    assert ledger.resume_step == 10 and ledger.rebuilding([1]) == [1]
    assert metrics.stage_rebuilds._value.get() == 1
    # The first stage has one neighbour: losing it rolls back.
    roster.nodes["n0"].alive = False
    ledger.start_epoch("the first stage is gone too", progressed=True)
    assert ledger.resume_step == 0
