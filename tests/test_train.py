"""Training on the bundled corpus lowers the loss with every boundary codec."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

from swarm.cli import main
from swarm.core.config import MODEL_PRESETS, CodecConfig, RunConfig, TrainConfig
from swarm.io.data import load_dataset
from swarm.runtime.train import _same_run, train


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


class _Interrupted(Exception):
    pass


class _FailingDataset:
    """The bundled corpus, whose sampler fails on its ``fail_at``-th batch (a killed run)."""

    def __init__(self, dataset, fail_at: int):
        self.val, self._dataset, self._fail_at = dataset.val, dataset, fail_at

    def sampler(self, *args):
        inner, calls = self._dataset.sampler(*args), [0]
        fail_at = self._fail_at

        class Sampler:
            def next_batch(self):
                calls[0] += 1
                if calls[0] == fail_at:
                    raise _Interrupted
                return inner.next_batch()

            def state_dict(self):
                return inner.state_dict()

            def load_state_dict(self, state):
                inner.load_state_dict(state)

        return Sampler()


@pytest.mark.parametrize("kind", ["identity", "subspace"])
def test_an_interrupted_run_resumes_bit_for_bit(dataset, tmp_path, kind):
    model = dataclasses.replace(MODEL_PRESETS["tiny"], subspace_rank=8 if kind == "subspace" else 0)
    config = RunConfig(
        model=model,
        codec=CodecConfig(kind=kind),
        train=TrainConfig(steps=8, batch_size=4, seq_len=32, microbatches=2, lr=1e-2, eval_every=3),
        n_stages=2,
    )
    if kind == "subspace":  # a rotation pending across the saved step (interval 3: steps 3 and 6)
        config = dataclasses.replace(config, rotation=dataclasses.replace(config.rotation, interval=3))
    whole = train(config, device="cpu", dataset=dataset, progress=False, eval_batches=1)
    progress_file = tmp_path / "run.progress.pt"
    with pytest.raises(_Interrupted):  # fails in step 7, after the save at step 6
        train(config, "cpu", _FailingDataset(dataset, 8), False, eval_batches=1, resume=progress_file)
    assert progress_file.exists()
    if kind == "subspace":  # written by a version whose configuration had no [audit] section yet
        _as_written_before_the_audit_section(progress_file)
    resumed = train(config, "cpu", dataset, False, eval_batches=1, resume=progress_file)
    assert resumed.losses == whole.losses
    assert resumed.val_losses == whole.val_losses
    assert resumed.off_subspace == whole.off_subspace
    assert not progress_file.exists()


def _as_written_before_the_audit_section(progress_file) -> None:
    state = torch.load(progress_file, weights_only=True)
    saved = json.loads(state["config"])
    del saved["audit"]
    state["config"] = json.dumps(saved, sort_keys=True)
    for stage in state["stages"]:  # the hash of that older configuration
        stage["config_hash"] = hashlib.sha256(state["config"].encode()).hexdigest()
    torch.save(state, progress_file)


def test_a_progress_file_of_another_run_is_refused(dataset, tmp_path):
    config = RunConfig(
        model=MODEL_PRESETS["tiny"],
        codec=CodecConfig(kind="identity"),
        train=TrainConfig(steps=4, batch_size=4, seq_len=32, microbatches=1, eval_every=2),
        n_stages=2,
    )
    progress_file = tmp_path / "run.progress.pt"
    with pytest.raises(_Interrupted):
        train(config, "cpu", _FailingDataset(dataset, 4), False, eval_batches=1, resume=progress_file)
    other = dataclasses.replace(config, train=dataclasses.replace(config.train, lr=1e-4))
    with pytest.raises(ValueError, match="different run"):
        train(other, "cpu", dataset, False, eval_batches=1, resume=progress_file)


def test_a_progress_file_written_before_a_configuration_section_existed_still_matches():
    config = RunConfig(model=MODEL_PRESETS["tiny"], train=TrainConfig(seq_len=32), n_stages=2)
    saved = json.loads(json.dumps(config.to_dict(), default=str))
    del saved["audit"]  # a file written before the [audit] section was added
    assert _same_run(saved, config)
    audited = dataclasses.replace(config, audit=dataclasses.replace(config.audit, rate=0.5))
    assert not _same_run(saved, audited)  # a non-default value of the new section is another run
    saved["train"]["lr"] = 1.0
    assert not _same_run(saved, config)
    saved = json.loads(json.dumps(config.to_dict(), default=str))
    saved["retired"] = {"x": 1}  # a section this version does not know
    assert not _same_run(saved, config)
