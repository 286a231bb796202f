"""``train.compile``: each layer compiled with torch.compile computes what the eager layer does.

Compiled kernels may fuse and reorder floating-point work, so gradients are held to fp32 rounding
against the eager single-process model, not to bit equality.
"""

from __future__ import annotations

import pytest
import torch

from swarm.cli import build_parser, run_config_from_args
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config
from tests.test_pipeline import max_relative_error, pipeline_gradients, reference_gradients

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def compiled(pipe: LocalPipeline) -> list[bool]:
    return [b._compiled_call_impl is not None for w in pipe.workers for b in w.stage.layers.values()]


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_layers_give_the_eager_models_gradients(device):
    config = tiny_config(n_stages=2, compile=True)
    ids = random_batch(config)
    ref_loss, ref = reference_gradients(config, ids, torch.float32, device)
    loss, got = pipeline_gradients(config, ids, torch.float32, device)
    assert abs(loss - ref_loss) / ref_loss < 1e-5
    assert max_relative_error(got, ref) < 1e-5  # same parameter names: snapshots stay compatible


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_bf16_training_tracks_eager(device):
    losses = {}
    for compile_layers in (False, True):
        config = tiny_config(n_stages=2, compile=compile_layers, precision="bf16")
        pipe = LocalPipeline(config, device=device)
        assert compiled(pipe) == [compile_layers] * config.model.n_layers
        losses[compile_layers] = [pipe.train_step(s, random_batch(config, seed=s)).loss for s in range(3)]
        with torch.no_grad():  # evaluation compiles a graph of its own
            source = random_batch(config, seed=9)
            for w in pipe.workers:
                source = w.forward(-1, -1, source, train=False)
        losses[compile_layers].append(source)
    assert losses[True] == pytest.approx(losses[False], rel=1e-2)


def test_the_compile_flag_sets_the_run_configuration():
    args = build_parser().parse_args(["train", "--compile"])
    assert run_config_from_args(args).train.compile
    assert not run_config_from_args(build_parser().parse_args(["train"])).train.compile
