"""The node daemon's path on a device: a 2-stage swarm over gRPC with rotations, rank growth and
snapshot cuts, generation from the model it exports, and snapshots restored across devices.

Each test runs on CUDA where it is present (``-m gpu``) and, in the slow suite, on the CPU (the
same code path; the CPU's own swarm tests cover it in the default suite).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.core.config import RotationConfig
from swarm.io import checkpoint, model_io
from swarm.launch.local_swarm import up
from swarm.runtime.pipeline import LocalPipeline
from swarm.serve.generate import Sampling, generate_ids
from tests.helpers import random_batch, tiny_config
from tests.test_swarm import log_text, reference_run, swarm_config

DEVICES = [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_two_stage_swarm_on_the_device_matches_one_process_and_its_model_generates(device, tmp_path):
    config = swarm_config(
        n_stages=2, steps=10, rotation=RotationConfig(interval=4, max_angle=0.1, grow_by=4, max_rank=20)
    )
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, interval=4))
    run = tmp_path / "run"
    summary = up(config, run, nodes=2, device=device, use_dht=False, progress=False, timeout=600)
    ref_losses, _, _ = reference_run(config, tmp_path / "cache", device)
    rel = [abs(a - b) / abs(b) for a, b in zip(summary.losses, ref_losses, strict=True)]
    assert max(rel) < 1e-4, rel
    for node in range(2):
        text = log_text(run, node)
        assert f"on {torch.device(device).type}" in text
        assert "rotation to subspace version 2 at step 8 (rank 20)" in text
        assert "after step 7" in text  # a snapshot cut, taken on the device and uploaded
    trained = model_io.load(run / "coordinator.sqlite.model")
    model = trained.build(device)
    assert next(model.parameters()).device.type == torch.device(device).type
    prompt = trained.tokenizer().encode("ROMEO:")
    greedy = Sampling(max_new_tokens=8, temperature=0.0)
    cached = generate_ids(model, prompt, greedy)
    assert len(cached) == 8 and cached == generate_ids(model, prompt, greedy, use_cache=False)


@pytest.mark.parametrize("device", DEVICES)
def test_a_snapshot_taken_on_the_device_restores_there_and_on_the_cpu(device):
    config = tiny_config(warmup_steps=2)
    first = LocalPipeline(config, device=device)
    for step in range(3):
        first.train_step(step, random_batch(config, seed=step))
    saved = [checkpoint.to_bytes(checkpoint.capture(w, 2)) for w in first.workers]
    later = [random_batch(config, seed=s) for s in range(3, 6)]
    expected = [first.train_step(3 + i, ids).loss for i, ids in enumerate(later)]
    for target in (device, "cpu"):
        resumed = LocalPipeline(config, device=target)
        for worker, data in zip(resumed.workers, saved, strict=True):
            assert checkpoint.restore(worker, checkpoint.from_bytes(data, target)) == 2
            assert {p.device.type for p in worker.parameters()} == {torch.device(target).type}
        got = [resumed.train_step(3 + i, ids).loss for i, ids in enumerate(later)]
        assert got == pytest.approx(expected, rel=1e-6 if target == device else 1e-4)
