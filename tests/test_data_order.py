"""The run's global sample order over a prepared corpus: keyed permutations, resume and re-plan give the
same samples token for token, bytes fetched ~ bytes trained on, and swarm train on a prepared corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from swarm.cli import main
from swarm.core.config import MODEL_PRESETS, DataConfig, RunConfig, TrainConfig
from swarm.io.data import batch_ids, load_dataset, run_tokenizer
from swarm.io.data_server import DataServer
from swarm.io.fetch import CorpusReader, FetchError
from swarm.io.order import SampleOrder, _round_keys, permute
from swarm.io.prepare import PrepareOptions, prepare
from swarm.io.prepared import CorpusSampler, PreparedDataset
from swarm.io.shards import HEADER, Manifest
from swarm.io.tokenizer import ByteTokenizer
from swarm.launch.local_swarm import up
from swarm.runtime.pipeline import LocalPipeline

SEQ = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    root = tmp_path_factory.mktemp("order")
    raw = root / "raw.jsonl"
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    raw.write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(words, 40 + i % 50))}) + "\n" for i in range(300))
    )
    options = PrepareOptions(shard_tokens=8192, block_tokens=1024, val_every=10, workers=1)
    return root / "corpus", prepare(raw, root / "corpus", ByteTokenizer(), options)


def train_tokens(folder: Path, manifest: Manifest) -> np.ndarray:
    """Per training block, its tokens (what a window must be a slice of)."""
    return [
        np.fromfile(folder / s.name, dtype=manifest.dtype, offset=HEADER.size)[
            k * manifest.block_tokens : (k + 1) * manifest.block_tokens
        ]
        for s in manifest.split("train")
        for k in range(len(s.blocks))
    ]


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 1000])
def test_keyed_permutation_is_a_bijection(n: int) -> None:
    keys = _round_keys(b"k")
    image = [permute(i, n, keys) for i in range(n)]
    assert sorted(image) == list(range(n))
    if n >= 17:
        assert image != list(range(n)) and image != [permute(i, n, _round_keys(b"other")) for i in range(n)]


def test_an_epoch_visits_every_window_once_a_few_blocks_at_a_time() -> None:
    windows = [5, 0, 7, 7, 3, 7, 7, 1, 7]
    order = SampleOrder(windows, seed=1, group=3)
    epoch = [order.locate(i) for i in range(order.per_epoch)]
    assert sorted(epoch) == sorted((b, w) for b, n in enumerate(windows) for w in range(n))
    blocks_in_turn = [b for b, _ in epoch]
    firsts = {b: blocks_in_turn.index(b) for b in set(blocks_in_turn)}
    lasts = {b: len(blocks_in_turn) - 1 - blocks_in_turn[::-1].index(b) for b in set(blocks_in_turn)}
    live = max(sum(firsts[b] <= i <= lasts[b] for b in firsts) for i in range(len(blocks_in_turn)))
    assert live <= 3  # never more than a group's blocks needed at once
    second = [order.locate(order.per_epoch + i) for i in range(order.per_epoch)]
    assert sorted(second) == sorted(epoch) and second != epoch  # the next epoch is another shuffle
    assert [SampleOrder(windows, seed=2, group=3).locate(i) for i in range(order.per_epoch)] != epoch


def test_windows_are_slices_of_one_block(corpus: tuple[Path, Manifest], tmp_path: Path) -> None:
    folder, manifest = corpus
    blocks = train_tokens(folder, manifest)
    sampler = CorpusSampler(CorpusReader(str(folder), manifest.corpus_id, tmp_path), 4, SEQ, seed=3)
    for step in range(20):
        ids = sampler.ids(step)
        assert ids.shape == (4, SEQ + 1) and ids.dtype == torch.int64
        for i, row in zip(range(step * 4, step * 4 + 4), ids, strict=True):
            b, w = sampler.order.locate(i)
            assert row.tolist() == blocks[b][w * SEQ : w * SEQ + SEQ + 1].tolist()
    sampler.reader.close()


def draw(sampler: CorpusSampler, n: int) -> list[torch.Tensor]:
    return [torch.cat([x, y[:, -1:]], dim=1) for x, y in (sampler.next_batch() for _ in range(n))]


def test_resume_and_replan_read_the_same_samples(corpus: tuple[Path, Manifest], tmp_path: Path) -> None:
    folder, manifest = corpus
    reader = CorpusReader(str(folder), manifest.corpus_id, tmp_path)
    steps = 3 * len(train_tokens(folder, manifest)) * (manifest.block_tokens // SEQ) // 8  # ~3 epochs
    uninterrupted = draw(CorpusSampler(reader, 8, SEQ, seed=5), steps)
    killed = CorpusSampler(reader, 8, SEQ, seed=5)
    before = draw(killed, 37)
    resumed = CorpusSampler(
        CorpusReader(str(folder), manifest.corpus_id, tmp_path / "elsewhere"), 8, SEQ, seed=5
    )
    resumed.load_state_dict(killed.state_dict())
    after = draw(resumed, steps - 37)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, before + after, strict=True))
    replanned = CorpusSampler(reader, 8, SEQ, seed=5)  # a new node drawing step s directly
    assert all(torch.equal(replanned.ids(s), uninterrupted[s]) for s in (steps - 1, 0, 111, 5))
    with pytest.raises(ValueError, match="seed=5"):
        CorpusSampler(reader, 8, SEQ, seed=6).load_state_dict(killed.state_dict())
    with pytest.raises(ValueError, match="seq_len"):
        CorpusSampler(reader, 8, SEQ * 2, seed=5).load_state_dict(killed.state_dict())


def test_an_epoch_fetches_about_the_bytes_it_trains_on(corpus: tuple[Path, Manifest], tmp_path: Path) -> None:
    folder, manifest = corpus
    reader = CorpusReader(str(folder), manifest.corpus_id, tmp_path)
    sampler = CorpusSampler(reader, 4, SEQ, seed=0, group=2)
    steps = sampler.order.per_epoch // 4
    for _ in range(steps):
        sampler.next_batch()
        assert len(sampler._decoded) <= 4  # memory: two groups of decoded blocks at most
    reader.close()
    used = steps * 4 * (SEQ + 1) * manifest.itemsize
    fetched = reader.counters.bytes_fetched - (folder / "manifest.json").stat().st_size
    assert reader.counters.requests - 1 == len(sampler.blocks)  # every block fetched once (+ manifest)
    assert fetched <= 1.2 * used


def tiny_run(folder: Path, corpus_id: str | None, **train: int) -> RunConfig:
    return RunConfig(
        model=MODEL_PRESETS["tiny"],
        train=TrainConfig(**{"steps": 4, "batch_size": 4, "seq_len": SEQ, "microbatches": 2, **train}),
        data=DataConfig(source=str(folder), corpus=corpus_id),
        n_stages=2,
    )


def test_swarm_train_on_a_prepared_corpus(corpus: tuple[Path, Manifest], tmp_path: Path, monkeypatch) -> None:
    folder, manifest = corpus
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    dataset = load_dataset(tiny_run(folder, manifest.corpus_id))
    assert isinstance(dataset, PreparedDataset) and dataset.vocab_size == 258
    assert len(dataset.val) == manifest.counts("val")["tokens"]
    assert isinstance(run_tokenizer(tiny_run(folder, None)), ByteTokenizer)
    argv = ["train", "--preset", "tiny", "--steps", "3", "--batch-size", "4", "--seq-len", str(SEQ)]
    argv += ["--corpus", str(folder), "--corpus-id", manifest.corpus_id, "--stages", "2"]
    assert main(argv) == 0
    with pytest.raises(FetchError, match="the run names corpus"):
        load_dataset(tiny_run(folder, "f" * 32))


def test_a_swarm_trains_on_a_prepared_corpus_from_a_mirror_as_one_process_does(
    corpus: tuple[Path, Manifest], tmp_path: Path, monkeypatch
) -> None:
    """Stage 0 of a real swarm (coordinator and two node processes on loopback) reads its batches
    from an HTTP mirror of the prepared corpus: the run's losses are the single-process pipeline's
    on the same corpus and seed, step for step."""
    folder, manifest = corpus
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    with DataServer(folder) as server:
        config = tiny_run(folder, manifest.corpus_id, steps=6)
        config.data.source = server.url
        summary = up(config, tmp_path / "run", nodes=2, use_dht=False, progress=False, timeout=240)
        t = config.train
        sampler = load_dataset(config, tmp_path / "reference").sampler(t.batch_size, t.seq_len, t.seed)
        pipe = LocalPipeline(config)
        reference = [pipe.train_step(s, batch_ids(*sampler.next_batch())).loss for s in range(t.steps)]
    assert summary.steps == t.steps
    assert max(abs(a - b) / b for a, b in zip(summary.losses, reference, strict=True)) < 1e-4
