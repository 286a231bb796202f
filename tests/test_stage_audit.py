"""A sibling's recomputation from the frames its neighbours kept: exact on an honest stage (first,
middle, last; across a rotation), every lie flagged; the frame window nodes keep for auditors."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from swarm.node.auditor import Auditor

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm.core.config import AuditConfig
from swarm.core.subspace import SubspaceRotation, initial_artifacts, random_basis
from swarm.ops.metrics import Metrics
from swarm.runtime.audit import TOLERANCES, CommitmentTally, Evidence, StageAuditor, StageState
from swarm.runtime.faults import MODES, Fault
from swarm.runtime.worker import StageWorker
from tests.helpers import random_batch, tiny_config


def _pipeline(config):
    fixed, basis = initial_artifacts(config)
    workers = [StageWorker(config, i, fixed, basis) for i in range(config.n_stages)]
    return fixed, basis, workers


def _step(workers, step: int, ids: torch.Tensor):
    """One microbatch through real (serialised) frames: per stage, its Evidence."""
    for w in workers:
        w.begin_step(step)
    acts, grads = [None], []
    source = ids
    for w in workers[:-1]:
        source = w.forward(step, 0, source)
        acts.append(source)
    workers[-1].forward(step, 0, source)
    grad = None
    for w in reversed(workers):
        grad = w.backward(step, 0, grad)
        grads.insert(0, grad)
    acts.append(None)
    grads.append(None)  # (the last stage receives no gradient)
    return [
        Evidence(inputs=acts[i], output=acts[i + 1], grad_out=grads[i + 1], grad_in=grads[i])
        for i in range(len(workers))
    ]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_an_honest_stage_is_recomputed_exactly_forward_and_backward(stage):
    config = tiny_config(n_stages=3, microbatches=1, batch_size=2)
    fixed, basis, workers = _pipeline(config)
    states = [StageState.capture(w, 0) for w in workers]
    evidence = _step(workers, 0, random_batch(config)[:2])
    auditor = StageAuditor(config, stage, fixed, basis, "cpu", torch.float32, TOLERANCES[(False, "fp32")])
    verdict = auditor.check(states[stage], 0, evidence[stage])
    assert verdict.matches
    checked = [c for c in (verdict.forward, verdict.backward) if c is not None]
    assert len(checked) == (1 if stage in (0, 2) else 2)
    assert all(c.rel_l2 == 0.0 and c.cosine == pytest.approx(1.0) for c in checked)


def test_the_audit_follows_a_rotation_applied_at_the_audited_step():
    config = tiny_config(n_stages=3, microbatches=1, batch_size=2)
    fixed, basis, workers = _pipeline(config)
    _step(workers, 0, random_batch(config, 1)[:2])
    for w in workers:
        w.optimizer_step(0)
    new_basis = random_basis(config.model.d_model, config.model.subspace_rank, 7).double()
    for w in workers:
        w.schedule_rotation(SubspaceRotation(version=1, effective_step=1, basis=new_basis.clone()))
    state = StageState.capture(workers[1], 1)
    assert state.pending_rotation is not None
    evidence = _step(workers, 1, random_batch(config, 2)[:2])
    auditor = StageAuditor(config, 1, fixed, basis, "cpu", torch.float32, TOLERANCES[(False, "fp32")])
    verdict = auditor.check(state, 0, evidence[1])
    assert verdict.matches and verdict.forward.rel_l2 == 0.0 and verdict.backward.rel_l2 == 0.0


@pytest.mark.parametrize("mode", MODES)
def test_a_lying_stage_is_flagged_on_its_forward(mode):
    config = tiny_config(n_stages=3, microbatches=1, batch_size=2)
    fixed, basis, workers = _pipeline(config)
    fault = Fault(workers[1], mode)
    if mode == "stale":  # a step behind: train a step first, then lie with the old weights
        _step(workers, 0, random_batch(config, 3)[:2])
        for w in workers:
            w.optimizer_step(0)
        fault.stepped()
    step = 1 if mode == "stale" else 0
    state = StageState.capture(workers[1], step)
    evidence = _step(workers, step, random_batch(config, 4)[:2])
    auditor = StageAuditor(config, 1, fixed, basis, "cpu", torch.float32, TOLERANCES[(False, "fp32")])
    verdict = auditor.check(state, 0, evidence[1])
    assert not verdict.matches
    direction, comparison = verdict.deciding
    assert direction == "forward" and comparison.rel_l2 > 1e-3


def test_a_tampered_input_gradient_is_flagged_on_the_backward():
    config = tiny_config(n_stages=3, microbatches=1, batch_size=2)
    fixed, basis, workers = _pipeline(config)
    state = StageState.capture(workers[2], 0)
    evidence = _step(workers, 0, random_batch(config, 5)[:2])
    honest = evidence[2]
    # the same gradient frame from another microbatch's values: well-formed, wrong
    other = _step(_pipeline(config)[2], 0, random_batch(config, 6)[:2])[2].grad_in
    lying = Evidence(honest.inputs, None, None, other)
    auditor = StageAuditor(config, 2, fixed, basis, "cpu", torch.float32, TOLERANCES[(False, "fp32")])
    verdict = auditor.check(state, 0, lying)
    assert verdict.forward is None and not verdict.matches and verdict.deciding[0] == "backward"


def test_nodes_keep_each_frame_for_a_window_of_steps_and_forget_at_a_new_epoch():
    config = tiny_config(n_stages=2, microbatches=1, batch_size=2)
    _, _, workers = _pipeline(config)
    tally = CommitmentTally(window=2)
    frames = []
    for step in range(3):
        frame = _step(workers, step, random_batch(config, step)[:2])[0].output
        tally.record("sent", 0, frame)
        frames.append(frame)
    assert tally.kept(0, 0, "forward", 0, "sent") is None  # older than the window
    assert tally.kept(2, 0, "forward", 0, "sent") is frames[2]
    assert tally.kept(1, 0, "forward", 0, "sent") is frames[1]
    assert tally.kept(1, 0, "forward", 0, "received") is None
    tally.new_epoch()
    assert tally.kept(2, 0, "forward", 0, "sent") is None
    assert CommitmentTally().kept(0, 0, "forward", 0, "sent") is None  # window 0 keeps nothing


def test_a_replica_draws_only_its_siblings_microbatches_at_the_rate_and_keeps_weights_only_then():
    config = tiny_config(n_stages=2, microbatches=6, batch_size=6, replicas=3)
    config = dataclasses.replace(config, audit=AuditConfig(rate=0.1, suspect_rate=0.5))
    assert config.audits
    _, _, workers = _pipeline(config)
    owners = [
        dict.fromkeys(range(6), "up"),
        {0: "me", 1: "sibling", 2: "suspect"} | {3: "me", 4: "sibling", 5: "suspect"},
    ]
    suspects = {"suspect"}
    auditor = Auditor(
        config,
        cpb.Plan(epoch=1),
        "me",
        owners,
        {},
        CommitmentTally(),
        print,
        Metrics("node"),
        suspects=lambda: suspects,
    )
    drawn, kept = collections.Counter(), 0
    for step in range(400):
        auditor.step_begun(step, workers[1])
        due = auditor.due.pop(1, None)
        if due is not None:
            state, mbs, _ = due
            assert state.step == step and mbs
            drawn.update(owners[1][mb] for mb in mbs)
            kept += 1
    assert set(drawn) == {"sibling", "suspect"}  # never its own microbatches
    assert 50 <= drawn["sibling"] <= 110  # 800 microbatches at 10%: 80 expected, sd 8.5
    assert 340 <= drawn["suspect"] <= 460  # the screen's suspect at 50%: 400 expected, sd 14
    assert kept <= 400
