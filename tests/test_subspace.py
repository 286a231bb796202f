"""The subspace constraint under training and rotation; Grassmann steps; rotation messages."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.codecs.base import PayloadError
from swarm.core.subspace import (
    BoundaryStatistic,
    SubspaceRotation,
    grassmann_step,
    off_subspace_energy,
    random_basis,
    rotate_stage,
)
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config


def residual_off_subspace(pipe: LocalPipeline, ids: torch.Tensor) -> float:
    """max over stage outputs of ||(X - E_fixed) (I - P)|| / ||X - E_fixed||."""
    worst, x = 0.0, None
    tokens = ids[:, :-1]
    for w in pipe.workers[:-1]:
        x = w.stage(tokens, x)
        rel = x - w.stage.fixed_embedding[tokens]
        u = w.stage.basis
        worst = max(worst, ((rel - rel @ u @ u.T).norm() / rel.norm()).item())
    return worst


def principal_angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.arccos(torch.linalg.svdvals(a.double().T @ b.double()).clamp(-1, 1))


@pytest.mark.parametrize(
    ("parametrisation", "optimizer"), [("standard", "adamw"), ("mup", "adamw"), ("mup", "muon")]
)
def test_constraint_holds_after_100_steps_and_rotations(parametrisation, optimizer):
    config = tiny_config(lr=1e-2, parametrisation=parametrisation, optimizer=optimizer)
    config.rotation.interval, config.rotation.max_angle = 25, 0.2
    pipe = LocalPipeline(config)
    rotations = 0
    for step in range(100):
        result = pipe.train_step(step, random_batch(config, seed=step))
        rotations += result.rotation is not None
    pipe.workers[0].begin_step(100)
    for w in pipe.workers[1:]:
        w.begin_step(100)
    assert rotations == 4 and all(w.version == 4 for w in pipe.workers)
    bases = [w.stage.basis for w in pipe.workers]
    assert all(torch.equal(bases[0], b) for b in bases[1:])
    with torch.no_grad():
        assert residual_off_subspace(pipe, random_batch(config, seed=999)) < 1e-5


def test_rotation_reprojects_parameters_without_changing_in_subspace_function():
    """Rotating to a basis spanning the same subspace must leave the model's outputs unchanged."""
    config = tiny_config(n_stages=1)
    pipe = LocalPipeline(config)
    for step in range(5):
        pipe.train_step(step, random_batch(config, seed=step))
    stage = pipe.workers[0].stage
    ids = random_batch(config, seed=7)[:, :-1]
    with torch.no_grad():
        before = stage(ids)
        q, _ = torch.linalg.qr(
            torch.randn(8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        )
        rotate_stage(stage, (stage.basis.double() @ q).float(), pipe.workers[0].optimizer.adamw)
        after = stage(ids)
    assert ((after - before).norm() / before.norm()).item() < 1e-5


def test_grassmann_steps_turn_basis_toward_gradient_energy_within_the_angle_cap():
    d, k = 48, 6
    basis = random_basis(d, k, seed=3)
    target = random_basis(d, k, seed=4)
    gen = torch.Generator().manual_seed(5)
    noise = torch.randn(512, d, generator=gen, dtype=torch.float64)
    grads = torch.randn(512, k, generator=gen, dtype=torch.float64) @ target.T + 0.01 * noise
    stat = BoundaryStatistic(basis)
    stat.add(grads)
    before = stat.off_fraction
    new = grassmann_step(basis, stat.gram_times_basis, max_angle=0.3)
    assert (new.T @ new - torch.eye(k, dtype=torch.float64)).abs().max() < 1e-12
    assert principal_angles(basis, new).max().item() == pytest.approx(0.3, abs=1e-4)
    off, total = off_subspace_energy(grads, new)
    assert math.sqrt(off / total) < before
    for _ in range(20):
        stat = BoundaryStatistic(new)
        stat.add(grads)
        new = grassmann_step(new, stat.gram_times_basis, max_angle=0.3)
    off, total = off_subspace_energy(grads, new)
    # The floor is the isotropic noise: 0.01 * sqrt(d - k) per row against sqrt(k) of signal.
    assert math.sqrt(off / total) < 0.03


def test_rotation_message_round_trip_and_rejection():
    rot = SubspaceRotation(3, 500, random_basis(64, 8, seed=0))
    back = SubspaceRotation.from_bytes(rot.to_bytes())
    assert (back.version, back.effective_step) == (3, 500)
    assert torch.equal(back.basis, rot.basis) and back.digest == rot.digest
    with pytest.raises(PayloadError, match="bytes"):
        SubspaceRotation.from_bytes(rot.to_bytes()[:-4])
    not_orthonormal = SubspaceRotation(3, 500, rot.basis * 2)
    with pytest.raises(PayloadError, match="orthonormal"):
        SubspaceRotation.from_bytes(not_orthonormal.to_bytes())


def test_stale_subspace_version_is_rejected():
    config = tiny_config(n_stages=2)
    pipe = LocalPipeline(config)
    sender, receiver = pipe.workers
    ids = random_batch(config)[:2]
    frame = sender.forward(0, 0, ids)
    receiver.version = 1
    with pytest.raises(PayloadError, match="subspace version 0"):
        receiver.forward(0, 0, frame)


def test_off_subspace_fraction_is_reported_per_boundary():
    config = tiny_config()
    pipe = LocalPipeline(config)
    result = pipe.train_step(0, random_batch(config))
    assert len(result.off_subspace_fraction) == 3
    assert all(0.0 < f < 1.0 for f in result.off_subspace_fraction)
