"""The single-process pipeline against a single-process model: reconstruction and gradient exactness."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swarm.core.model import Stage
from swarm.core.subspace import initial_artifacts
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config


def reference_gradients(
    config, ids: torch.Tensor, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and parameter gradients of the whole model in one process, no boundaries (ids on ``device``)."""
    fixed, basis = initial_artifacts(config)
    model = Stage(config.model, 0, config.model.n_layers, fixed, basis, config.train.seed)
    model = model.to(device=device, dtype=dtype)
    losses = []
    for chunk in ids.chunk(config.train.microbatches):
        logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        (loss / config.train.microbatches).backward()
        losses.append(loss.item())
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return sum(losses) / len(losses), grads


def pipeline_gradients(
    config, ids: torch.Tensor, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[float, dict[str, torch.Tensor]]:
    pipe = LocalPipeline(config, device=device, dtype=dtype)
    loss, _, _ = pipe.forward_backward(0, ids)
    grads = {}
    for w in pipe.workers:
        grads |= {name: p.grad.clone() for name, p in w.stage.named_parameters()}
    return loss, grads


def max_relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)).item() for n in a)


@pytest.mark.parametrize("parametrisation", ["standard", "mup", "mup-anchored"])
@pytest.mark.parametrize(
    ("dtype", "fmt", "tolerance"), [(torch.float32, "fp32", 1e-5), (torch.float64, "fp64", 1e-10)]
)
def test_compressed_pipeline_gradients_equal_single_process(dtype, fmt, tolerance, parametrisation):
    config = tiny_config(forward_format=fmt, backward_format=fmt, parametrisation=parametrisation)
    ids = random_batch(config)
    ref_loss, ref = reference_gradients(config, ids, dtype)
    loss, got = pipeline_gradients(config, ids, dtype)
    assert abs(loss - ref_loss) / ref_loss < tolerance
    assert max_relative_error(got, ref) < tolerance


def test_without_constraint_the_same_codec_changes_gradients():
    config = tiny_config(constrain=False, forward_format="fp64", backward_format="fp64")
    ids = random_batch(config)
    _, ref = reference_gradients(config, ids, torch.float64)
    _, got = pipeline_gradients(config, ids, torch.float64)
    assert max_relative_error(got, ref) > 1e-2


def test_forward_reconstruction_is_exact_at_every_boundary():
    config = tiny_config()
    pipe = LocalPipeline(config)
    ids = random_batch(config)[:2]
    x = None
    for w in pipe.workers[:-1]:
        x = w.stage(ids[:, :-1], x)
        frame = w.outbound.encode_activation(w.outbound.map.project(x, ids[:, :-1]), ids, 0, 0, 0)
        nxt = pipe.workers[w.index + 1]
        z, got_ids = nxt.inbound.decode_activation(frame, 0, torch.device("cpu"), torch.float32)
        rebuilt = nxt.inbound.map.lift(z, got_ids[:, :-1])
        assert torch.equal(got_ids, ids)
        assert ((rebuilt - x).norm() / x.norm()).item() < 1e-6


def test_identity_pipeline_matches_reference_exactly_in_fp32():
    config = tiny_config(kind="identity", rank=0)
    ids = random_batch(config)
    _, ref = reference_gradients(config, ids, torch.float32)
    _, got = pipeline_gradients(config, ids, torch.float32)
    assert max_relative_error(got, ref) < 1e-5


def test_wire_bytes_match_format_accounting():
    config = tiny_config(forward_format="bf16", backward_format="bf16")
    pipe = LocalPipeline(config)
    ids = random_batch(config)
    result = pipe.train_step(0, ids)
    tokens = config.train.batch_size * config.train.seq_len
    k = config.model.subspace_rank
    per_mb_ids = (config.train.batch_size // config.train.microbatches) * (config.train.seq_len + 1) * 2
    assert result.tokens == tokens
    assert result.bytes_forward == [tokens * k * 2 + config.train.microbatches * per_mb_ids] * 3
    assert result.bytes_backward == [tokens * k * 2] * 3


def _trained(config, frames: bool, steps: int = 3) -> tuple[list, list[torch.Tensor]]:
    """Each step's (loss, boundary bytes) and the final parameters of every stage."""
    pipe = LocalPipeline(config, frames=frames)
    results = []
    for step in range(steps):
        r = pipe.train_step(step, random_batch(config, seed=step))
        results.append((r.loss, r.bytes_forward, r.bytes_backward, r.bytes_sync))
    return results, [p.detach().clone() for w in pipe.workers for p in w.parameters()]


@pytest.mark.parametrize(
    ("kind", "forward", "backward", "rotation"),
    [
        ("subspace", "fp32", "fp32", 0),
        ("subspace", "int8_row", "bf16", 2),
        ("identity", "bf16", "fp16", 0),
        ("identity", "int4_block", "topk", 0),
        ("identity", "lowrank", "int8_block", 0),
        ("mapl", "rvq", "bf16", 0),
    ],
)
def test_carried_boundaries_equal_serialised_frames(kind, forward, backward, rotation):
    """Stages in one process hand the decoded values over without bytes: the run (losses, bytes
    counted on every boundary, weights after three steps, rotations and codebook deltas included)
    is bit for bit the one whose every crossing is serialised and decoded."""
    config = tiny_config(kind, forward_format=forward, backward_format=backward, constrain=kind == "subspace")
    config.rotation.interval = rotation
    carried, carried_params = _trained(config, frames=False)
    framed, framed_params = _trained(config, frames=True)
    assert carried == framed
    assert all(torch.equal(a, b) for a, b in zip(carried_params, framed_params, strict=True))


def test_zstd_boundaries_are_always_serialised():
    """zstd's size depends on the data: its crossings are encoded even in one process."""
    config = tiny_config(forward_format="bf16", backward_format="bf16")
    config.codec.zstd_level = 3
    pipe = LocalPipeline(config)
    assert not any(c.in_process for w in pipe.workers for c in (w.inbound, w.outbound) if c is not None)
    r = pipe.train_step(0, random_batch(config))
    assert r.loss > 0 and all(b > 0 for b in r.bytes_forward)
