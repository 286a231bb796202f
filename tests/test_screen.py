"""The screen on received activations: flags a sender that starts lying, never an honest one.

Unit: the moving statistics of honest frames of a trained pipeline stay within the screen's bounds,
and a sign flip or noise of the same norm is flagged on every frame. Live: real processes on
loopback, a three-stage swarm whose stage-0 host flips the sign of its activations (or, in the
slow suite, sends noise of the same norm) from a given microbatch on (the hidden ``--fault``
flag); the coordinator counts the flagged frames against that node alone, shows them in
``swarm status`` and lets the run finish (a screen never evicts).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.core.config import MODEL_PRESETS, CodecConfig, RunConfig, TrainConfig
from swarm.io.data import batch_ids, load_dataset
from swarm.ops.status import render
from swarm.runtime.faults import FaultSpec
from swarm.runtime.norm_guard import NormBound
from swarm.runtime.pipeline import LocalPipeline
from swarm.runtime.screen import ActivationScreen
from tests.procs import coordinator, node, processes, tiny_run, wait_for_nodes, wait_status

STEPS, MICROBATCHES, LIE_AFTER = 50, 2, 60  # the liar forwards 60 microbatches honestly, then 40 lies


def _received_frames(kind: str, rank: int, steps: int = 50) -> list[torch.Tensor]:
    """The activations stage 1 of a training 3-stage pipeline decodes, one per microbatch."""
    model = dataclasses.replace(MODEL_PRESETS["tiny"], subspace_rank=rank)
    config = RunConfig(
        model=model,
        codec=CodecConfig(kind=kind),
        train=TrainConfig(steps=steps, batch_size=4, seq_len=32, microbatches=2, lr=3e-3),
        n_stages=3,
    )
    pipe = LocalPipeline(config, norm_bound=NormBound())
    receiver, frames = pipe.workers[1], []
    decode = receiver.inbound.decode_activation

    def kept(frame, *args, **kwargs):
        z, ids = decode(frame, *args, **kwargs)
        frames.append(z.detach().clone())
        return z, ids

    receiver.inbound.decode_activation = kept
    sampler = load_dataset(config).sampler(4, 32, 0)
    for step in range(steps):
        pipe.train_step(step, batch_ids(*sampler.next_batch()))
    return frames


@pytest.mark.parametrize(("kind", "rank"), [("subspace", 8), ("identity", 0)])
def test_honest_frames_pass_and_a_sign_flip_or_same_norm_noise_is_flagged_every_time(kind, rank):
    frames = _received_frames(kind, rank)
    honest, flipped, noisy = ActivationScreen(), ActivationScreen(), ActivationScreen()
    warm = LIE_AFTER  # the first steps move the mean a lot: the screen waits for it to settle
    for z in frames[:warm]:
        assert honest.observe(z) is None and flipped.observe(z) is None and noisy.observe(z) is None
    assert honest.armed
    torch.manual_seed(0)
    for z in frames[warm:]:
        assert honest.observe(z) is None
        assert "cosine" in flipped.observe(-z)
        noise = torch.randn_like(z)
        assert noisy.observe(noise * (z.norm() / noise.norm())) is not None


def test_a_new_width_restarts_the_statistics():
    screen = ActivationScreen()
    for _ in range(30):
        assert screen.observe(torch.ones(2, 4, 8) + 0.01 * torch.randn(2, 4, 8)) is None
    assert screen.armed and screen.observe(-torch.ones(2, 4, 8)) is not None
    assert screen.observe(-torch.ones(2, 4, 12)) is None  # the rank grew: relearn, do not judge
    assert screen.frames == 1 and not screen.armed


def test_a_stream_that_never_settles_is_never_judged():
    screen = ActivationScreen()
    torch.manual_seed(0)
    assert all(screen.observe(torch.randn(2, 4, 8)) is None for _ in range(200))
    assert not screen.armed


def test_the_fault_flag_is_parsed_and_refused_when_malformed():
    assert FaultSpec.parse("sign") == FaultSpec("sign", 1.0, 0)
    assert FaultSpec.parse("noise:0.1@30") == FaultSpec("noise", 0.1, 30)
    assert FaultSpec.parse("stale:0.5") == FaultSpec("stale", 0.5, 0)
    assert FaultSpec.parse("accuse") == FaultSpec("accuse", 1.0, 0)
    for bad in ("flip", "sign:2", "sign:x", "sign@-1", ""):
        with pytest.raises(ValueError):
            FaultSpec.parse(bad)


@pytest.mark.parametrize("mode", ["sign", pytest.param("noise", marks=pytest.mark.slow)])
def test_a_node_that_starts_lying_is_flagged_to_the_coordinator_and_no_honest_one_is(tmp_path, mode):
    config = tiny_run(tmp_path, STEPS, n_stages=3, checkpoint_interval=100)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, microbatches=MICROBATCHES))
    with processes() as procs:
        address = coordinator(procs, tmp_path, config)
        started = {}
        for i, name in enumerate(["liar", "n1", "n2"]):  # joined in order: node i hosts stage i
            flags = ("--fault", f"{mode}@{LIE_AFTER}") if name == "liar" else ()
            started[name] = node(procs, tmp_path, name, address, *flags)
            wait_for_nodes(address, i + 1)
        final = wait_status(address, lambda r: r.run_complete, "the run to complete", 180)
        for proc in started.values():
            assert proc.wait(60) == 0, proc.output()
        coordinator_log = procs[0].stderr()
        receiver_log = started["n1"].stdout()
    drifted = {n.node_name: n.drifted_frames for n in final.nodes}
    stages = {n.node_name: list(n.last_stages) for n in final.nodes}
    assert stages["liar"] == [0]
    # every lie flagged (the liar's 40 frames after its 60 honest ones), nothing else
    assert drifted == {"liar": STEPS * MICROBATCHES - LIE_AFTER, "n1": 0, "n2": 0}
    assert "screen: step" in coordinator_log and "from stage 0" in coordinator_log
    if mode == "sign":  # the flipped stream reaches stage 2's screen too: attributed upstream, not to n1
        assert "flagged after it (its lie reached them)" in coordinator_log
    assert "the screen flagged" in receiver_log
    assert "screen: 40 activation frames from node" in render(final, address)
    assert [s.step for s in final.steps] == list(range(STEPS))  # the screen never stops the run
    # every crossing of the two boundaries, both directions, every step: what was sent was received
    # (a lie is committed to like any frame; commitments bind it, audits judge it)
    assert final.commitment_checks == STEPS * 2 * 2 and not final.commitment_mismatches
