"""Stiefel optimizers of the MAPL projections: the constraint, Adam against SGD, config, snapshots."""

from __future__ import annotations

import pytest
import torch

from swarm.core.config import TrainConfig
from swarm.core.optim import StiefelAdam, StiefelSGD, build_optimizer, qr_retraction
from swarm.io import checkpoint
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config

OPTIMIZERS = {"sgd": StiefelSGD, "adam": StiefelAdam}


def low_rank_task(d: int = 64, r: int = 8, n: int = 512, seed: int = 0):
    """Data near an ``r``-dimensional subspace of R^d, a random start and a minibatch loss."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, r, generator=gen) @ torch.randn(r, d, generator=gen)
    x = x + 0.05 * torch.randn(n, d, generator=gen)
    a = torch.nn.Parameter(qr_retraction(torch.randn(d, r, generator=gen)))

    def loss(rows: torch.Tensor | None = None) -> torch.Tensor:
        """Relative reconstruction error ``||X - X A A^T||^2 / ||X||^2`` on ``rows`` (all by default)."""
        xb = x if rows is None else x[rows]
        return (xb - xb @ a @ a.T).pow(2).sum() / xb.pow(2).sum()

    def minibatch() -> torch.Tensor:
        return torch.randint(0, n, (16,), generator=gen)

    return a, loss, minibatch


def train_on_task(name: str, steps: int, check=None) -> float:
    a, loss, minibatch = low_rank_task()
    opt = OPTIMIZERS[name]([a], lr=TrainConfig().stiefel_lr)
    for _ in range(steps):
        opt.zero_grad()
        loss(minibatch()).backward()
        opt.step()
        if check is not None:
            check(a.detach())
    with torch.no_grad():
        return loss().item()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_columns_stay_orthonormal_after_every_step(name):
    errors = []
    train_on_task(name, 50, lambda a: errors.append((a.T @ a - torch.eye(a.shape[1])).norm().item()))
    assert len(errors) == 50 and max(errors) < 1e-6


def test_adam_reaches_a_lower_reconstruction_loss_than_sgd_at_the_default_lr():
    sgd, adam = train_on_task("sgd", 200), train_on_task("adam", 200)
    assert adam < 0.2 * sgd, (adam, sgd)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_run_configuration_picks_the_stiefel_optimizer(name):
    boundary = torch.nn.Linear(8, 4)
    boundary.weight.stiefel = True
    assert type(build_optimizer([boundary], TrainConfig(stiefel_optimizer=name)).stiefel) is OPTIMIZERS[name]
    assert isinstance(build_optimizer([boundary], TrainConfig()).stiefel, StiefelSGD)


def test_unknown_stiefel_optimizer_is_refused():
    with pytest.raises(ValueError, match=r"train.stiefel_optimizer='lbfgs' must be one of \('sgd', 'adam'\)"):
        TrainConfig(stiefel_optimizer="lbfgs")


def test_adam_state_round_trips_through_a_snapshot_and_copies_stay_identical():
    config = tiny_config("mapl", rank=0, stiefel_optimizer="adam", warmup_steps=2)
    first = LocalPipeline(config)
    for step in range(3):
        first.train_step(step, random_batch(config, step))
    saved = [checkpoint.to_bytes(checkpoint.capture(w, 2)) for w in first.workers]
    resumed = LocalPipeline(config)
    for worker, data in zip(resumed.workers, saved, strict=True):
        checkpoint.restore(worker, checkpoint.from_bytes(data))
    for step in range(3, 6):
        assert (
            resumed.train_step(step, random_batch(config, step)).loss
            == first.train_step(step, random_batch(config, step)).loss
        )
    for sender, receiver in zip(resumed.workers, resumed.workers[1:], strict=False):
        a_out = sender.mapl["out"].projection
        assert torch.equal(a_out, receiver.mapl["in"].projection)
        assert torch.equal(a_out, first.workers[sender.index].mapl["out"].projection)
        assert isinstance(sender.optimizer.stiefel, StiefelAdam)
        assert sender.optimizer.stiefel.state[a_out]["step"] == 6
