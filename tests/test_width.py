"""The width parametrisation: muP's init and lr rules by hand, and muP = standard at the base width."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from swarm.core.config import ModelConfig, RunConfig, TrainConfig
from swarm.core.subspace import initial_artifacts
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config

LR = TrainConfig().lr


def _base_lrs(pipe: LocalPipeline) -> dict[str, float]:
    worker = pipe.workers[0]
    by_param = {p: g["base_lr"] for g in worker.optimizer.adamw.param_groups for p in g["params"]}
    return {name: by_param[p] for name, p in worker.stage.named_parameters()}


def test_mup_learning_rates_follow_the_rules():
    """d=32, base 16 (m=2), k=8 (sqrt(d/k)=2): hidden and head lr/2, W' lr, C 2 lr, norms lr."""
    lrs = _base_lrs(LocalPipeline(tiny_config(n_stages=1, parametrisation="mup")))
    expected = {
        "layers.0.attn.qkv.weight": LR / 2,
        "layers.0.mlp.gate_up.weight": LR / 2,
        "layers.0.attn.out.weight": LR,
        "layers.3.mlp.down.weight": LR,
        "head.weight": LR / 2,
        "embed.low": 2 * LR,
        "layers.1.attn_norm.weight": LR,
        "norm.weight": LR,
    }
    for name, lr in expected.items():
        assert lrs[name] == pytest.approx(lr, rel=1e-12), name


def test_mup_anchored_scales_constrained_writes_by_the_width_not_the_rank():
    """d=32, base 16, k=8: ``s = sqrt(d/base) = sqrt(2)`` for W' and C (``mup``: 2), the rest as muP."""
    lrs = _base_lrs(LocalPipeline(tiny_config(n_stages=1, parametrisation="mup-anchored")))
    expected = {
        "layers.0.attn.qkv.weight": LR / 2,
        "layers.0.attn.out.weight": LR / math.sqrt(2),
        "layers.3.mlp.down.weight": LR / math.sqrt(2),
        "head.weight": LR / 2,
        "embed.low": math.sqrt(2) * LR,
        "norm.weight": LR,
    }
    for name, lr in expected.items():
        assert lrs[name] == pytest.approx(lr, rel=1e-12), name


def test_mup_dense_writes_take_the_hidden_rule():
    lrs = _base_lrs(LocalPipeline(tiny_config(n_stages=1, constrain=False, parametrisation="mup")))
    assert lrs["layers.0.attn.out.weight"] == pytest.approx(LR / 2)
    assert lrs["embed.low"] == pytest.approx(LR)


def test_mup_init_scales_the_standard_draws():
    """The same draws, scaled: hidden 1/sqrt(m), W' sqrt(d/k)/sqrt(m), head 1/m; E_fixed 1/sqrt(base)."""
    standard = LocalPipeline(tiny_config(n_stages=1)).workers[0].stage
    mup = LocalPipeline(tiny_config(n_stages=1, parametrisation="mup")).workers[0].stage
    scales = {
        "layers.0.attn.qkv.weight": 1 / math.sqrt(2),
        "layers.2.mlp.down.weight": 2 / math.sqrt(2),
        "head.weight": 0.5,
        "layers.0.attn_norm.weight": 1.0,
    }
    params_std, params_mup = dict(standard.named_parameters()), dict(mup.named_parameters())
    for name, scale in scales.items():
        torch.testing.assert_close(params_mup[name], params_std[name] * scale, rtol=1e-6, atol=0), name
    fixed_std, _ = initial_artifacts(tiny_config())
    fixed_mup, _ = initial_artifacts(tiny_config(parametrisation="mup"))
    torch.testing.assert_close(fixed_mup, fixed_std * math.sqrt(2), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("parametrisation", "constrain"), [("mup", False), ("mup-anchored", False), ("mup-anchored", True)]
)
def test_mup_at_its_base_width_is_the_standard_model_bit_for_bit(parametrisation, constrain):
    """Dense under either muP, and the constrained model under ``mup-anchored`` (``mup``'s rank
    factor ``sqrt(base/k)`` makes its constrained model another one there)."""
    config = tiny_config(n_stages=2, kind="subspace" if constrain else "identity", constrain=constrain)
    base = config.model.d_model
    model = dataclasses.replace(config.model, parametrisation=parametrisation, base_width=base)
    at_base = dataclasses.replace(config, model=model)
    pipes = LocalPipeline(config), LocalPipeline(at_base)
    for step in range(3):
        batch = random_batch(config, seed=step)
        losses = [pipe.train_step(step, batch).loss for pipe in pipes]
        assert losses[0] == losses[1]
    for a, b in zip(pipes[0].workers, pipes[1].workers, strict=True):
        for (name, p), (_, q) in zip(a.stage.named_parameters(), b.stage.named_parameters(), strict=True):
            assert torch.equal(p, q), name


def test_unknown_parametrisation_is_refused():
    with pytest.raises(ValueError, match="parametrisation"):
        ModelConfig(parametrisation="ntk")
    with pytest.raises(ValueError, match="base_width"):
        ModelConfig(base_width=0)
    assert RunConfig().model.parametrisation == "mup-anchored"  # the scaling bench's winner
