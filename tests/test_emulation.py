"""Compute emulation: real frames and codecs around calibrated waits, and what it refuses."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from bench.compute_profile import profile as measure_profile
from bench.paper_scale import gpipe_bound
from bench.throughput import Link
from swarm.codecs.boundary import IdentityMap
from swarm.core.config import (
    MODEL_PRESETS,
    CheckpointConfig,
    CodecConfig,
    EmulationConfig,
    ReplicaSyncConfig,
    RotationConfig,
    RunConfig,
    TrainConfig,
)
from swarm.core.profiles import ComputeProfile, load_profile
from swarm.runtime.pipeline import LocalPipeline


def _config(kind: str, fmt: str, **kw) -> RunConfig:
    return RunConfig(
        model=MODEL_PRESETS["tiny"],
        codec=CodecConfig(kind=kind, forward_format=fmt, backward_format=fmt),
        train=TrainConfig(batch_size=4, seq_len=32, microbatches=2),
        checkpoint=CheckpointConfig(interval=0),
        n_stages=4,
        **kw,
    )


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    ComputeProfile("test", "tiny", "none", "made up for the test", 100.0, 200.0, 32).save(path)
    return str(path)


@pytest.mark.parametrize(
    ("kind", "fmt"), [("subspace", "bf16"), ("identity", "bf16"), ("subspace", "int8_row")]
)
def test_emulated_stages_send_the_real_frames_and_take_the_profiles_time(kind, fmt, profile_path):
    ids = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    real = LocalPipeline(_config(kind, fmt))
    emulated = LocalPipeline(_config(kind, fmt, emulation=EmulationConfig(profile_path)))
    start = time.perf_counter()
    loss, fwd, bwd = emulated.forward_backward(0, ids)
    seconds = time.perf_counter() - start
    _, real_fwd, real_bwd = real.forward_backward(0, ids)
    assert (fwd, bwd) == (real_fwd, real_bwd)  # the same frames, byte for byte in size
    assert all(f > 0 for f in fwd + bwd)
    assert loss == pytest.approx(math.log(512), rel=1e-6)  # no LM head: the uniform prediction
    # 4 one-layer stages, 128 tokens, 300 us per token and layer: the waits alone take this long
    assert seconds >= 4 * 128 * 300e-6


def test_the_boundary_maps_are_charged_to_the_profile_and_never_run_on_this_cpu(tmp_path):
    """What a GPU would run for a subspace boundary (a d x k product per side) is a wait from the
    profile; the emulated stages hold k-wide coordinates only, never the d-wide residual stream."""
    path = tmp_path / "maps.json"
    ComputeProfile("maps", "tiny", "none", "made up", 0.0, 0.0, 32, boundary_us_per_token=2000.0).save(path)
    ids = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    seconds = {}
    for kind in ("subspace", "identity"):
        pipe = LocalPipeline(_config(kind, "bf16", emulation=EmulationConfig(str(path))))
        start = time.perf_counter()
        pipe.forward_backward(0, ids)
        seconds[kind] = time.perf_counter() - start
        widths = {w.inbound.map.width for w in pipe.workers[1:]} | {w.stage.width for w in pipe.workers}
        assert widths == ({16} if kind == "subspace" else {64})  # k = 16, d = 64
        assert all(isinstance(w.inbound.map, IdentityMap) for w in pipe.workers[1:])
    # 3 boundaries x 128 tokens x 2 ms: the subspace pipeline waits that long, the dense one does not
    assert seconds["subspace"] >= 3 * 128 * 2000e-6 > 4 * seconds["identity"]
    profile = load_profile(str(path))
    assert profile.tokens_per_second(1, boundary_sides=2) == pytest.approx(1 / 2000e-6)


def test_emulated_gradients_are_not_zero(profile_path):
    """The last stage's gradient is perturbed, so lossy codecs see a real tensor, not zeros."""
    pipe = LocalPipeline(_config("identity", "fp32", emulation=EmulationConfig(profile_path)))
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
    frame = ids
    for worker in pipe.workers[:-1]:
        frame = worker.forward(0, 0, frame)
    pipe.workers[-1].forward(0, 0, frame)
    sender = pipe.workers[-2]
    grad = sender.outbound.decode_gradient(
        pipe.workers[-1].backward(0, 0), 0, (2, 32, 64), "cpu", torch.float32
    )
    assert grad.shape == (2, 32, 64) and torch.isfinite(grad).all() and grad.abs().mean() > 1e-3


def test_emulation_refuses_what_needs_weights(profile_path):
    emulation = EmulationConfig(profile_path)
    with pytest.raises(ValueError, match="MAPL"):
        _config("mapl", "bf16", emulation=emulation)
    with pytest.raises(ValueError, match="rotate"):
        _config("subspace", "bf16", emulation=emulation, rotation=RotationConfig(interval=10))
    with pytest.raises(ValueError, match="snapshot"):
        dataclasses.replace(_config("subspace", "bf16"), checkpoint=CheckpointConfig(5), emulation=emulation)
    with pytest.raises(ValueError, match="outer steps"):
        dataclasses.replace(
            _config("subspace", "bf16"), replica_sync=ReplicaSyncConfig(mode="outer"), emulation=emulation
        )
    with pytest.raises(ValueError, match=r"no compute profile 'no-such-gpu'.*paper-2b-8layer"):
        _config("subspace", "bf16", emulation=EmulationConfig("no-such-gpu"))


def test_profiles_load_and_reject_bad_times(tmp_path):
    paper = load_profile("paper-2b-8layer")
    # The paper's compressed run, read as compute-bound: 592.41 tokens/s through 8 layers.
    assert 1 / (8 / paper.tokens_per_second(1)) == pytest.approx(592.41, rel=1e-3)
    assert paper.stage_seconds(2, 1000) == pytest.approx((2 * 1000 * 70.33e-6, 2 * 1000 * 140.67e-6))
    bad = tmp_path / "bad.json"
    bad.write_text(
        '{"name": "x", "model": "tiny", "device": "d", "source": "s", '
        '"forward_us_per_token_layer": -1, "backward_us_per_token_layer": 1, "seq_len": 8}'
    )
    with pytest.raises(ValueError, match="forward_us_per_token_layer=-1"):
        load_profile(str(bad))
    bad.write_text('{"name": "x"}')
    with pytest.raises(ValueError, match="compute profile"):
        load_profile(str(bad))


def test_measured_profile_is_usable(tmp_path):
    measured = measure_profile("tiny", "auto", seq_len=16, batch=2, repeats=2)
    assert measured.forward_us_per_token_layer > 0 and measured.backward_us_per_token_layer > 0
    assert measured.boundary_us_per_token > 0  # the preset is subspace-constrained: its maps are timed
    measured.save(tmp_path / "measured.json")
    assert load_profile(str(tmp_path / "measured.json")) == measured


def test_the_gpipe_bound_counts_phases_slots_and_the_round_trip():
    profile = ComputeProfile("p", "tiny", "none", "made up", 1.0, 2.0, 32)
    row = {"wire_forward_B_per_token": 100.0, "wire_backward_B_per_token": 50.0}
    slow = Link("8 Mbit/s, 20 ms RTT", 8, 10)  # 1 MB/s: a 100-token microbatch crosses in 10 ms (5 back)
    # 2 stages, 4 microbatches: (4 + 1) x (10 + 5) ms of link-bound slots and one 20 ms round trip
    assert gpipe_bound(profile, [1, 1], [0, 0], 4, 100, slow, row) == pytest.approx(400 / 0.095)
    # no link: the slots are the slowest stage's compute, 1 layer x 100 tokens x (1 + 2) us
    assert gpipe_bound(profile, [1, 1], [0, 0], 4, 100, Link("loopback", 0), row) == pytest.approx(
        400 / (5 * 300e-6)
    )
