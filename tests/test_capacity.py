"""Capacity where it is free: the last stage's layers write at full rank, and the pipeline stays exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from swarm.core.model import Stage
from swarm.core.subspace import initial_artifacts
from tests.helpers import random_batch, tiny_config
from tests.test_pipeline import max_relative_error, pipeline_gradients, reference_gradients


def free_tail(config, layers: int = 1):
    return dataclasses.replace(config, model=dataclasses.replace(config.model, full_rank_layers=layers))


@pytest.mark.parametrize(
    ("dtype", "fmt", "tolerance"), [(torch.float32, "fp32", 1e-5), (torch.float64, "fp64", 1e-10)]
)
def test_full_rank_last_stage_keeps_pipeline_gradients_exact(dtype, fmt, tolerance):
    config = free_tail(tiny_config(forward_format=fmt, backward_format=fmt, n_stages=3), layers=1)
    ids = random_batch(config)
    ref_loss, ref = reference_gradients(config, ids, dtype)
    loss, got = pipeline_gradients(config, ids, dtype)
    assert abs(loss - ref_loss) / ref_loss < tolerance
    assert max_relative_error(got, ref) < tolerance


def test_only_the_tail_writes_outside_the_subspace():
    config = free_tail(tiny_config(n_stages=2), layers=2)
    fixed, basis = initial_artifacts(config)
    model = Stage(config.model, 0, 4, fixed, basis.float(), config.train.seed)
    k, d = config.model.subspace_rank, config.model.d_model
    shapes = {i: model.layers[str(i)].mlp.down.weight.shape[0] for i in range(4)}
    assert shapes == {0: k, 1: k, 2: d, 3: d}
    tokens = random_batch(config)[:, :-1]
    x = model.embed(tokens, model.fixed_embedding, model.basis)
    projector = torch.eye(d) - model.basis @ model.basis.T
    for i in range(4):
        x = model.layers[str(i)](x, model.rope_cos[:16], model.rope_sin[:16], model.basis)
        off = ((x - model.fixed_embedding[tokens]) @ projector).norm() / x.norm()
        assert (off < 1e-5) if i < 2 else (off > 1e-2), (i, off.item())


def test_a_free_layer_before_the_last_stage_is_refused():
    with pytest.raises(ValueError, match="last stage"):
        free_tail(tiny_config(n_stages=4), layers=2)  # the last of 4 stages holds 1 of the 4 layers
    with pytest.raises(ValueError, match="full_rank_layers"):
        free_tail(tiny_config(n_stages=1), layers=5)


def test_a_bottleneck_only_at_boundaries_is_exact_for_the_model_that_projects_there():
    """Unconstrained writes with the subspace codec: the pipeline trains exactly the model whose
    residual stream is projected onto ``E_fixed[tok] + col(U)`` at every stage boundary."""
    config = tiny_config(constrain=False, forward_format="fp64", backward_format="fp64", n_stages=3)
    ids = random_batch(config)
    fixed, basis = initial_artifacts(config)
    fixed, basis = fixed.double(), basis.double()
    bounds = [(0, 2), (2, 3), (3, 4)]
    stages = [Stage(config.model, a, b, fixed, None, config.train.seed).double() for a, b in bounds]
    losses = []
    for chunk in ids.chunk(config.train.microbatches):
        tokens, x = chunk[:, :-1], None
        for stage in stages:
            if x is not None:  # the boundary: keep the coordinates in U, re-add the fixed embedding
                x = fixed[tokens] + (x - fixed[tokens]) @ basis @ basis.T
            x = stage(tokens, x)
        loss = F.cross_entropy(x.float().flatten(0, 1), chunk[:, 1:].flatten())
        (loss / config.train.microbatches).backward()
        losses.append(loss.item())
    ref = {n: p.grad for s in stages for n, p in s.named_parameters()}
    loss, got = pipeline_gradients(config, ids, torch.float64)
    assert abs(loss - sum(losses) / len(losses)) < 1e-10 * loss
    assert max_relative_error(got, ref) < 1e-10
