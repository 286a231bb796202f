"""Training on the bundled corpus lowers the loss with every boundary codec."""

from __future__ import annotations

import dataclasses
import json

import pytest

from swarm.cli import main
from swarm.core.config import MODEL_PRESETS, CodecConfig, RunConfig, TrainConfig
from swarm.io.data import load_dataset
from swarm.runtime.train import train


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    config = RunConfig(
        model=MODEL_PRESETS["tiny"], codec=CodecConfig(kind="identity"), train=TrainConfig(seq_len=64)
    )
    return load_dataset(config, cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize(
    ("kind", "rank", "fmt"),
    [("identity", 0, "bf16"), ("subspace", 16, "bf16"), ("mapl", 0, "bf16"), ("mapl", 0, "rvq")],
)
def test_training_lowers_validation_loss(dataset, kind, rank, fmt):
    model = dataclasses.replace(MODEL_PRESETS["tiny"], subspace_rank=rank)
    config = RunConfig(
        model=model,
        codec=CodecConfig(kind=kind, forward_format=fmt, mapl_rank=16),
        train=TrainConfig(steps=40, batch_size=8, seq_len=64, microbatches=2, lr=1e-2, warmup_steps=5),
        n_stages=2,
    )
    summary = train(config, device="cpu", dataset=dataset, progress=False)
    assert summary.final_val_loss < summary.initial_val_loss - 0.5
    assert summary.losses[-1] < summary.losses[0]


def test_cli_train_writes_summary(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    code = main(
        [
            "train",
            "--preset",
            "tiny",
            "--rank",
            "16",
            "--steps",
            "3",
            "--batch-size",
            "4",
            "--seq-len",
            "32",
            "--precision",
            "bf16",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["train"]["precision"] == "bf16"
    assert "validation loss" in capsys.readouterr().out


def test_cli_rejects_bad_configuration(capsys):
    assert main(["train", "--codec", "subspace", "--rank", "0", "--steps", "1"]) == 2
    assert "subspace_rank" in capsys.readouterr().err


def test_a_sequence_longer_than_the_model_context_is_refused_at_configuration():
    with pytest.raises(ValueError, match=r"train\.seq_len=128 exceeds model\.max_seq_len=64"):
        RunConfig(model=MODEL_PRESETS["tiny"], train=TrainConfig(seq_len=128))
