"""Stage snapshots: a restored pipeline continues exactly; the on-disk store is atomic and verified."""

from __future__ import annotations

import pytest
import torch

from swarm.codecs.base import PayloadError
from swarm.io import checkpoint, compact
from swarm.io.data import BatchSampler
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config


def batches(config, n: int, start: int = 0) -> list[torch.Tensor]:
    return [random_batch(config, seed) for seed in range(start, start + n)]


@pytest.mark.parametrize(
    ("kind", "fwd", "rank", "extra"),
    [
        ("subspace", "bf16", 8, {}),
        ("subspace", "bf16", 8, {"optimizer": "muon", "parametrisation": "mup"}),
        ("mapl", "rvq", 0, {}),
        ("identity", "fp32", 0, {}),
    ],
    ids=["subspace", "subspace-muon-mup", "mapl-rvq", "identity"],
)
def test_restored_pipeline_continues_bit_for_bit(kind, fwd, rank, extra):
    config = tiny_config(kind, rank=rank, forward_format=fwd, backward_format="fp32", warmup_steps=2, **extra)
    first = LocalPipeline(config)
    for step, ids in enumerate(batches(config, 3)):
        first.train_step(step, ids)
    saved = [checkpoint.to_bytes(checkpoint.capture(w, 2)) for w in first.workers]
    later = batches(config, 3, start=3)
    expected = [first.train_step(3 + i, ids).loss for i, ids in enumerate(later)]

    resumed = LocalPipeline(config)
    for worker, data in zip(resumed.workers, saved, strict=True):
        assert checkpoint.restore(worker, checkpoint.from_bytes(data)) == 2
    got = [resumed.train_step(3 + i, ids).loss for i, ids in enumerate(later)]
    assert got == expected
    # A pipeline that was not restored does differ: the test can fail.
    fresh = LocalPipeline(config)
    assert [fresh.train_step(3 + i, ids).loss for i, ids in enumerate(later)] != expected


def test_sampler_position_is_part_of_stage_zero_snapshot():
    config = tiny_config()
    tokens = torch.arange(5000) % config.model.vocab_size
    sampler = BatchSampler(tokens, 4, 16, seed=3)
    for _ in range(5):
        sampler.next_batch()
    worker = LocalPipeline(config).workers[0]
    state = checkpoint.from_bytes(checkpoint.to_bytes(checkpoint.capture(worker, 4, sampler)))
    expected = sampler.next_batch()
    other = BatchSampler(tokens, 4, 16, seed=3)
    checkpoint.restore(LocalPipeline(config).workers[0], state, other)
    assert all(torch.equal(a, b) for a, b in zip(other.next_batch(), expected, strict=True))


def test_snapshot_of_another_stage_or_run_is_refused():
    config = tiny_config()
    workers = LocalPipeline(config).workers
    state = checkpoint.capture(workers[1], 0)
    with pytest.raises(PayloadError, match="cannot restore stage 2"):
        checkpoint.restore(workers[2], state)
    other = LocalPipeline(tiny_config(lr=1.0)).workers[1]
    with pytest.raises(PayloadError, match="cannot restore"):
        checkpoint.restore(other, state)
    with pytest.raises(PayloadError, match="unreadable stage snapshot"):
        checkpoint.from_bytes(b"not a snapshot")


def test_store_writes_atomically_verifies_and_keeps_the_last_few(tmp_path):
    store = checkpoint.SnapshotStore(tmp_path, keep=2)
    files = [store.write(1, step, f"state {step}".encode()) for step in (4, 9, 14)]
    assert [f.step for f in store.snapshots(1)] == [9, 14]  # the oldest was pruned
    assert store.read(1, 14, files[2].digest) == b"state 14"
    assert store.read(1, 4, files[0].digest) is None
    assert not list(tmp_path.glob(".tmp-*"))
    files[1].path.write_bytes(b"state 9 but corrupted")
    assert store.read(1, 9, files[1].digest) is None  # fails its checksum
    assert not files[1].path.exists()  # and is removed


def test_8bit_moments_stay_within_a_step_of_their_grid_and_never_zero_a_second_moment():
    torch.manual_seed(0)
    first = torch.randn(3, 1000) * torch.logspace(-6, 0, 1000)  # blocks spanning six decades
    second = first.square() * torch.rand(3, 1000)
    m = compact.decode(compact.encode(first, root=False))
    v = compact.decode(compact.encode(second, root=True))
    assert m.shape == first.shape and v.dtype == second.dtype
    blocks = compact._blocks(first).abs().amax(dim=1)  # each block's absmax: its grid is absmax / 127
    error = compact._blocks(m - first).abs().amax(dim=1)
    assert bool((error <= blocks / 254 + 1e-12).all())
    # The square root is rounded up: v never falls below the truth, so no update is inflated.
    assert bool((v >= second * (1 - 1e-5)).all()) and bool((v[second > 0] > 0).all())  # float rounding
    root_error = compact._blocks(v.sqrt() - second.sqrt()).amax(dim=1)
    assert bool((root_error <= compact._blocks(second.sqrt()).amax(dim=1) / 255 + 1e-6).all())


def test_a_snapshot_with_8bit_moments_is_half_the_bytes_and_continues_close_to_the_exact_one():
    config = tiny_config("subspace", rank=8, forward_format="fp32", backward_format="fp32", warmup_steps=2)
    first = LocalPipeline(config)
    for step, ids in enumerate(batches(config, 6)):
        first.train_step(step, ids)
    states = [checkpoint.capture(w, 5) for w in first.workers]
    exact = [checkpoint.to_bytes(s) for s in states]
    packed = [checkpoint.to_bytes(s, moments="int8") for s in states]
    assert sum(map(len, packed)) < 0.6 * sum(map(len, exact))
    later = batches(config, 4, start=6)
    expected = [first.train_step(6 + i, ids).loss for i, ids in enumerate(later)]
    resumed = LocalPipeline(config)
    for worker, data, state in zip(resumed.workers, packed, states, strict=True):
        restored = checkpoint.from_bytes(data)
        assert "moments" not in restored
        assert all(torch.equal(a, restored["model"][k]) for k, a in state["model"].items())  # weights exact
        checkpoint.restore(worker, restored)
    got = [resumed.train_step(6 + i, ids).loss for i, ids in enumerate(later)]
    assert got[0] == expected[0]  # the first step's loss comes from the (exact) weights
    assert got != expected and got == pytest.approx(expected, rel=1e-3)


def test_malformed_8bit_moments_are_refused():
    config = tiny_config()
    pipe = LocalPipeline(config)
    pipe.train_step(0, random_batch(config, 0))  # Adam's moments exist after a step
    state = compact.compact_moments(checkpoint.capture(pipe.workers[1], 0))
    for opt in state["optimizers"]:
        for param_state in opt["state"].values():
            for value in param_state.values():
                if isinstance(value, dict):
                    value["shape"] = "not a shape"
    with pytest.raises(PayloadError, match="malformed 8-bit moments"):
        checkpoint.from_bytes(checkpoint.to_bytes(state))
