"""Muon for the layers' matrices: which parameters it takes, and pipeline = one process under it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.core.config import TrainConfig
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config


def test_muon_takes_the_layer_matrices_and_adamw_the_rest():
    worker = LocalPipeline(tiny_config(n_stages=1, optimizer="muon")).workers[0]
    names = {p: name for name, p in worker.stage.named_parameters()}
    muon = {names[p] for g in worker.optimizer.muon.param_groups for p in g["params"]}
    adamw = {names[p] for g in worker.optimizer.adamw.param_groups for p in g["params"]}
    assert muon == {n for n in names.values() if n.startswith("layers.") and not n.endswith("norm.weight")}
    assert adamw == set(names.values()) - muon
    assert "layers.0.attn.out.weight" in muon and "embed.low" in adamw and "head.weight" in adamw


@pytest.mark.parametrize("kind", ["subspace", "identity"])
def test_muon_pipeline_trains_like_one_process(kind):
    """Four stages over exact fp64 boundaries take the same Muon steps as the whole model in one stage."""
    config = tiny_config(
        kind,
        constrain=kind == "subspace",
        forward_format="fp64",
        backward_format="fp64",
        optimizer="muon",
        parametrisation="mup",
        warmup_steps=1,
    )
    split, whole = (
        LocalPipeline(config, dtype=torch.float64),
        LocalPipeline(dataclasses.replace(config, n_stages=1), dtype=torch.float64),
    )
    for step in range(3):
        ids = random_batch(config, seed=step)
        a, b = split.train_step(step, ids).loss, whole.train_step(step, ids).loss
        assert abs(a - b) < 1e-9 * abs(b)
    params = dict(whole.workers[0].stage.named_parameters())
    for worker in split.workers:
        for name, p in worker.stage.named_parameters():
            torch.testing.assert_close(p, params[name], rtol=1e-9, atol=1e-12)


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match=r"train\.optimizer"):
        TrainConfig(optimizer="lion")
