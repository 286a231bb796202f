"""A rank that grows: the basis gains columns at rotation steps and the pipeline stays exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.codecs.base import StaleVersionError
from swarm.core.config import RotationConfig
from swarm.core.model import Stage
from swarm.core.subspace import grow_basis, next_rotation, random_basis, rotate_stage
from swarm.io import checkpoint
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config
from tests.test_pipeline import max_relative_error

K0, K_MAX, GROW_EVERY = 8, 16, 2


def growing_config(fmt: str = "fp64", **kw):
    config = tiny_config(forward_format=fmt, backward_format=fmt, n_stages=3, lr=1e-2, **kw)
    return dataclasses.replace(
        config, rotation=RotationConfig(interval=GROW_EVERY, grow_by=4, max_rank=K_MAX)
    )


def grown_pipeline(config, steps: int, dtype: torch.dtype) -> LocalPipeline:
    pipe = LocalPipeline(config, dtype=dtype)
    for step in range(steps):
        pipe.train_step(step, random_batch(config, seed=step))
    for w in pipe.workers:
        w.optimizer.zero_grad()
    return pipe


def whole_model(pipe: LocalPipeline, dtype: torch.dtype) -> Stage:
    """One process holding every layer, with the pipeline's weights and (grown) basis."""
    config, first = pipe.config, pipe.workers[0].stage
    model = Stage(
        config.model, 0, config.model.n_layers, first.fixed_embedding, first.basis, config.train.seed
    )
    model = model.to(dtype)
    state = {}
    for w in pipe.workers:
        state |= w.stage.state_dict()
    model.load_state_dict(state)
    return model


def test_growth_appends_orthonormal_columns_and_keeps_the_old_ones():
    u = random_basis(32, 8, seed=0)
    m = torch.randn(32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grown = grow_basis(u, m @ m.T @ u, extra=4, seed=3)
    assert grown.shape == (32, 12) and torch.equal(grown[:, :8], u)
    assert (grown.T @ grown - torch.eye(12, dtype=torch.float64)).abs().max() < 1e-12
    # With no gradient energy at all the new columns still come, from the seed, identically.
    zero = grow_basis(u, torch.zeros(32, 8, dtype=torch.float64), extra=4, seed=3)
    assert torch.equal(zero, grow_basis(u, torch.zeros(32, 8, dtype=torch.float64), extra=4, seed=3))
    with pytest.raises(ValueError, match="cannot grow"):
        grow_basis(u, m @ u, extra=25, seed=3)


def test_growth_picks_the_off_subspace_directions_the_gradients_use():
    d, k = 32, 4
    u = random_basis(d, k, seed=0)
    target = torch.linalg.qr(torch.randn(d, 2, dtype=torch.float64))[0]
    target = target - u @ (u.T @ target)
    g = torch.randn(500, k, dtype=torch.float64) @ u.T + torch.randn(500, 2, dtype=torch.float64) @ target.T
    grown = grow_basis(u, g.T @ (g @ u), extra=2, seed=0)
    captured = torch.linalg.svdvals(grown.T @ torch.linalg.qr(target)[0])
    assert captured.min() > 0.99  # the two directions the gradients carried are now in the subspace


def test_schedule_grows_until_max_rank_then_turns():
    r = RotationConfig(interval=5, grow_by=3, max_rank=10)
    assert [r.grows(k) for k in (4, 7, 9, 10)] == [3, 3, 1, 0]
    u = random_basis(16, 9, seed=0)
    stat = torch.randn(16, 9, dtype=torch.float64)
    assert next_rotation(u, [stat], 0, 5, r).basis.shape == (16, 10)
    turned = next_rotation(random_basis(16, 10, seed=0), [torch.randn(16, 10, dtype=torch.float64)], 1, 10, r)
    assert turned.basis.shape == (16, 10)


@pytest.mark.parametrize("bad", [{"max_rank": 8}, {"max_rank": 40}, {"interval": 0}, {"grow_by": 0}])
def test_impossible_growth_is_refused(bad):
    with pytest.raises(ValueError, match="rotation"):
        config = tiny_config()
        dataclasses.replace(
            config, rotation=RotationConfig(**({"interval": 2, "grow_by": 4, "max_rank": 12} | bad))
        )


def test_growth_with_rvq_or_replicas_is_refused():
    with pytest.raises(ValueError, match="rvq"):
        growing_config(fmt="rvq")
    with pytest.raises(ValueError, match="replicas"):
        growing_config(fmt="fp32", replicas=2)


def test_growing_a_stage_changes_no_output():
    config = tiny_config(n_stages=1)
    pipe = LocalPipeline(config)
    for step in range(3):
        pipe.train_step(step, random_batch(config, seed=step))
    worker = pipe.workers[0]
    ids = random_batch(config, seed=9)[:, :-1]
    with torch.no_grad():
        before = worker.stage(ids)
        grown = grow_basis(worker.stage.basis.double(), torch.zeros(32, K0, dtype=torch.float64), 4, seed=1)
        rotate_stage(worker.stage, grown, worker.optimizer.adamw)
        # Zero rows change no output; a product over k + 4 columns may round differently (BLAS
        # blocking: 1.4e-7 relative on some CPUs), so equality is to fp32 rounding.
        torch.testing.assert_close(worker.stage(ids), before, rtol=1e-6, atol=1e-6)
    assert worker.stage.embed.low.shape == (config.model.vocab_size, K0 + 4)
    moments = worker.optimizer.adamw.state[worker.stage.embed.low]
    assert moments["exp_avg"].shape == worker.stage.embed.low.shape
    assert moments["exp_avg"][:, K0:].abs().max() == 0
    variance = moments["exp_avg_sq"]  # a new coordinate starts at the mean of the old ones, per token
    assert torch.equal(variance[:, K0:], variance[:, :K0].mean(1, keepdim=True).expand(-1, 4))
    assert variance[:, :K0].abs().max() > 0


@pytest.mark.parametrize(
    ("dtype", "fmt", "tolerance"), [(torch.float32, "fp32", 1e-5), (torch.float64, "fp64", 1e-10)]
)
def test_grown_pipeline_gradients_equal_the_single_process_model(dtype, fmt, tolerance):
    config = growing_config(fmt)
    pipe = grown_pipeline(config, steps=2 * GROW_EVERY + 1, dtype=dtype)  # two growths: 8 -> 12 -> 16
    assert [w.stage.basis.shape[1] for w in pipe.workers] == [K_MAX] * 3
    assert all(w.version == 2 for w in pipe.workers)
    ids = random_batch(config, seed=123)
    model = whole_model(pipe, dtype)
    losses = []
    for chunk in ids.chunk(config.train.microbatches):
        logits = model(chunk[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        (loss / config.train.microbatches).backward()
        losses.append(loss.item())
    ref = {n: p.grad for n, p in model.named_parameters()}
    loss, _, _ = pipe.forward_backward(2 * GROW_EVERY + 1, ids)
    got = {n: p.grad for w in pipe.workers for n, p in w.stage.named_parameters()}
    assert abs(loss - sum(losses) / len(losses)) < tolerance * loss
    assert max_relative_error(got, ref) < tolerance
    # The boundaries now carry K_MAX coordinates per token.
    assert pipe.workers[0].outbound.map.width == K_MAX


def test_frames_of_the_version_before_a_growth_are_refused():
    config = growing_config()
    pipe = grown_pipeline(config, steps=GROW_EVERY, dtype=torch.float64)
    behind = LocalPipeline(config, dtype=torch.float64).workers[0]  # a sender that missed the growth
    behind.begin_step(GROW_EVERY)
    ids = random_batch(config, seed=5)[: config.train.batch_size // config.train.microbatches]
    stale = behind.forward(GROW_EVERY, 0, ids)  # encoded under version 0: K0 coordinates
    assert stale.subspace_version == 0
    receiver = pipe.workers[1]
    receiver.begin_step(GROW_EVERY)
    assert receiver.version == 1 and receiver.stage.basis.shape[1] == K0 + 4
    with pytest.raises(StaleVersionError, match="version 0"):
        receiver.forward(GROW_EVERY, 0, stale)


def test_a_snapshot_after_growth_restores_into_stages_built_at_the_first_rank_and_trains_on():
    """Snapshots of every stage after the first growth load into stages built at K0 and then train
    bit for bit like the pipeline that never stopped, through the next growth."""
    config = growing_config()
    pipe = grown_pipeline(config, steps=GROW_EVERY + 1, dtype=torch.float64)
    states = [
        checkpoint.from_bytes(checkpoint.to_bytes(checkpoint.capture(w, GROW_EVERY))) for w in pipe.workers
    ]
    resumed = LocalPipeline(config, dtype=torch.float64)
    assert resumed.workers[1].stage.basis.shape[1] == K0
    for worker, state in zip(resumed.workers, states, strict=True):
        assert checkpoint.restore(worker, state) == GROW_EVERY
    resumed.version = pipe.version
    for w, saved in zip(resumed.workers, pipe.workers, strict=True):
        assert torch.equal(w.stage.basis, saved.stage.basis) and w.version == saved.version
    for step in range(GROW_EVERY + 1, 3 * GROW_EVERY):  # the second growth takes effect at 2 * GROW_EVERY
        batch = random_batch(config, seed=step)
        assert resumed.train_step(step, batch).loss == pipe.train_step(step, batch).loss
    for w, saved in zip(resumed.workers, pipe.workers, strict=True):
        assert w.stage.basis.shape[1] == K_MAX
        for a, b in zip(w.stage.parameters(), saved.stage.parameters(), strict=True):
            assert torch.equal(a, b)
