"""swarm data prepare: deterministic shards that match direct tokenisation, and verification that refuses
tampered, truncated or mismatched data."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zstandard
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import models, pre_tokenizers

from swarm import cli
from swarm.io import shards
from swarm.io.documents import iter_documents
from swarm.io.prepare import SPECIALS, PrepareOptions, prepare
from swarm.io.shards import HEADER, IntegrityError, Manifest, verify_folder
from swarm.io.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer

SMALL = PrepareOptions(shard_tokens=1024, block_tokens=256, val_every=4, workers=1)


def write_corpus(root: Path) -> Path:
    """A folder mixing text files and JSONL (plain, gzip, zstd), with unusual text."""
    src = root / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("naïve café — 日本語 🎭\r\nline two\n" * 20, encoding="utf-8")
    (src / "sub" / "b.md").write_text("# heading\n\n" + "words and more words " * 50)
    records = [{"text": f"record {i}: " + "lorem ipsum " * (i % 7 + 1)} for i in range(40)]
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    (src / "c.jsonl").write_bytes(lines)
    (src / "d.jsonl.gz").write_bytes(gzip.compress(lines))
    (src / "e.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    return src


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("raw"))


@pytest.fixture(scope="module")
def bpe(src: Path) -> BpeTokenizer:
    return BpeTokenizer.train(list(iter_documents(src)), 400, SPECIALS)


def read_split(folder: Path, manifest: Manifest, split: str) -> np.ndarray:
    parts = [
        np.fromfile(folder / s.name, dtype=manifest.dtype, offset=HEADER.size) for s in manifest.split(split)
    ]
    return np.concatenate(parts)


def expected_split(src: Path, tok: Tokenizer, val_every: int, split: str) -> list[int]:
    bos, eos = tok.framing()
    out: list[int] = []
    for i, doc in enumerate(iter_documents(src)):
        if ("val" if val_every and i % val_every == val_every - 1 else "train") == split:
            out += [bos, *tok.encode(doc), eos]
    return out


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_folder_of_text_and_jsonl_streams_every_document(src: Path) -> None:
    docs = list(iter_documents(src))
    assert len(docs) == 2 + 3 * 40  # a.txt, c, d, e (40 records each), sub/b.md
    assert docs[0].startswith("naïve") and "\r" not in docs[0]
    assert docs[1:41] == docs[41:81] == docs[81:121]  # the same records, plain, gzip and zstd


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_prepare_matches_direct_tokenisation(src: Path, bpe: BpeTokenizer, tmp_path: Path, kind: str) -> None:
    tok = ByteTokenizer() if kind == "byte" else bpe
    manifest = prepare(src, tmp_path / "out", tok, SMALL)
    assert (manifest.tokenizer["bos"], manifest.tokenizer["eos"]) == tok.framing()
    if kind == "bpe":
        assert tok.framing() == (0, 1)  # the framing tokens the trained BPE holds
    else:
        assert tok.framing() == (256, 257) and manifest.n_ids == 258
    for split in shards.SPLITS:
        got = read_split(tmp_path / "out", manifest, split)
        assert got.tolist() == expected_split(src, tok, SMALL.val_every, split)
    assert len(manifest.split("train")) >= 2  # rolled over into several shards
    assert all(s.tokens <= SMALL.shard_tokens for s in manifest.shards)
    assert manifest.counts("val")["docs"] == 122 // 4
    assert sum(s.docs for s in manifest.split("train")) == 122 - 122 // 4
    assert verify_folder(tmp_path / "out", manifest.corpus_id) == manifest


def test_prepare_is_deterministic_with_any_number_of_workers(
    src: Path, bpe: BpeTokenizer, tmp_path: Path
) -> None:
    one = prepare(src, tmp_path / "one", bpe, SMALL)
    two = prepare(src, tmp_path / "two", bpe, PrepareOptions(**{**SMALL.__dict__, "workers": 2}))
    assert one.corpus_id == two.corpus_id
    assert folder_bytes(tmp_path / "one") == folder_bytes(tmp_path / "two")
    again = prepare(src, tmp_path / "one", bpe, SMALL)  # replaces the earlier folder
    assert again.corpus_id == one.corpus_id and folder_bytes(tmp_path / "one") == folder_bytes(
        tmp_path / "two"
    )


def test_a_large_vocabulary_writes_uint32_and_any_tokenizer_json(tmp_path: Path) -> None:
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}
    hf = HfTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tokenizer.json").write_text(hf.to_str())
    (tmp_path / "raw.txt").write_text("w1 w69999 w5 nope")
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "data",
                "prepare",
                str(tmp_path / "raw.txt"),
                "--out",
                str(out),
                "--tokenizer",
                str(tmp_path / "tokenizer.json"),
                "--val-every",
                "0",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    manifest = verify_folder(out)
    assert manifest.dtype == "uint32" and manifest.n_ids == 70_003
    assert read_split(out, manifest, "train").tolist() == [70_001, 1, 69_999, 5, 70_000, 70_002]


def prepared(src: Path, tmp_path: Path) -> tuple[Path, Manifest]:
    out = tmp_path / "corpus"
    return out, prepare(src, out, BpeTokenizer.train(["tiny text"] * 3, 300, SPECIALS), SMALL)


def test_verify_refuses_a_tampered_or_truncated_shard(src: Path, tmp_path: Path) -> None:
    out, manifest = prepared(src, tmp_path)
    shard = out / manifest.shards[0].name
    good = shard.read_bytes()
    shard.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    with pytest.raises(IntegrityError, match=r"train-00000\.bin: sha256 mismatch"):
        verify_folder(out)
    assert cli.main(["data", "verify", str(out)]) == 2
    shard.write_bytes(good[:-2])
    with pytest.raises(IntegrityError, match="truncated"):
        verify_folder(out)
    shard.write_bytes(good)
    block = good[HEADER.size : HEADER.size + manifest.block_tokens * manifest.itemsize]
    shards.check_block(manifest, manifest.shards[0], 0, block)
    with pytest.raises(IntegrityError, match=r"block 0: .*truncated"):
        shards.check_block(manifest, manifest.shards[0], 0, block[:-1])
    with pytest.raises(IntegrityError, match="block 1: sha256 mismatch"):
        shards.check_block(manifest, manifest.shards[0], 1, block)
    shard.unlink()
    with pytest.raises(IntegrityError, match="missing"):
        verify_folder(out)


def test_verify_refuses_an_altered_manifest_or_another_corpus(src: Path, tmp_path: Path) -> None:
    out, _ = prepared(src, tmp_path)
    with pytest.raises(IntegrityError, match="the run names corpus 0123"):
        verify_folder(out, "0123")
    d = json.loads((out / shards.MANIFEST).read_text())
    d["shards"][0]["tokens"] += 1
    d["splits"]["train"]["tokens"] += 1
    (out / shards.MANIFEST).write_text(json.dumps(d))
    with pytest.raises(IntegrityError, match="altered"):
        verify_folder(out)
    d["format"] = "something/else"
    (out / shards.MANIFEST).write_text(json.dumps(d))
    with pytest.raises(IntegrityError, match="not a prepared corpus"):
        verify_folder(out)
    (out / shards.MANIFEST).write_text("{}")
    with pytest.raises(IntegrityError, match="not a prepared corpus"):
        verify_folder(out)


def test_verify_refuses_a_mismatched_tokenizer(src: Path, bpe: BpeTokenizer, tmp_path: Path) -> None:
    out, manifest = prepared(src, tmp_path)
    (out / shards.TOKENIZER_FILE).write_text(bpe.to_json())
    with pytest.raises(IntegrityError, match="tokenised with tokenizer"):
        verify_folder(out)
    with pytest.raises(IntegrityError, match="tokenised with tokenizer"):
        manifest.check_tokenizer(hashlib.sha256(bpe.to_json().encode()).hexdigest())


def test_prepare_refuses_to_replace_a_folder_that_is_not_a_corpus(src: Path, tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a prepared corpus"):
        prepare(src, tmp_path / "mine", ByteTokenizer(), SMALL)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    shutil.rmtree(tmp_path / "mine")
