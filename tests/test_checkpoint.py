"""Stage snapshots: a restored pipeline continues exactly; the on-disk store is atomic and verified."""

from __future__ import annotations

import pytest
import torch

from swarm.codecs.base import PayloadError
from swarm.io import checkpoint
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
