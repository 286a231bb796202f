"""Reading a prepared corpus: verified blocks from a folder or HTTP mirrors (Range reads, or whole shards
from a server without Range support), failover, refetch of corrupt data, the cache's cap, prefetch."""

from __future__ import annotations

import functools
import json
import select
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from swarm.io import shards
from swarm.io.data_server import DataServer
from swarm.io.fetch import CorpusReader, FetchError
from swarm.io.prepare import PrepareOptions, prepare
from swarm.io.shards import HEADER, Manifest
from swarm.io.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    root = tmp_path_factory.mktemp("fetch")
    raw = root / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": f"document {i} " + "x" * (i * 7)}) + "\n" for i in range(60)))
    options = PrepareOptions(shard_tokens=2048, block_tokens=256, val_every=10, workers=1)
    return root / "corpus", prepare(raw, root / "corpus", ByteTokenizer(), options)


def all_blocks(manifest: Manifest) -> list[tuple[shards.ShardInfo, int]]:
    return [(s, k) for s in manifest.shards for k in range(len(s.blocks))]


def on_disk(folder: Path, manifest: Manifest, shard: shards.ShardInfo, k: int) -> np.ndarray:
    start, end = manifest.block_span(shard, k)
    return np.frombuffer((folder / shard.name).read_bytes()[start:end], dtype=manifest.dtype)


@pytest.fixture
def plain_http(corpus: tuple[Path, Manifest]) -> Iterator[str]:
    """Python's plain static file server: no Range support."""

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(corpus[0])))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_folder_reader_returns_every_block_verified_then_from_the_cache(
    corpus: tuple[Path, Manifest], tmp_path: Path
) -> None:
    folder, manifest = corpus
    reader = CorpusReader(str(folder), manifest.corpus_id, tmp_path)
    for shard, k in all_blocks(manifest):
        assert np.array_equal(reader.block(shard, k), on_disk(folder, manifest, shard, k))
    assert reader.counters.cache_hits == 0
    reader.close()
    again = CorpusReader(str(folder), manifest.corpus_id, tmp_path)
    for shard, k in all_blocks(manifest):
        again.block(shard, k)
    assert again.counters.cache_hits == len(all_blocks(manifest))
    assert again.counters.requests == 1  # the manifest only
    again.close()


def test_http_range_reads_fetch_only_the_blocks_asked_for(
    corpus: tuple[Path, Manifest], tmp_path: Path
) -> None:
    folder, manifest = corpus
    with DataServer(folder) as server:
        reader = CorpusReader(server.url, manifest.corpus_id, tmp_path)
        manifest_bytes = reader.counters.bytes_fetched
        shard = manifest.split("train")[1]
        assert np.array_equal(reader.block(shard, 2), on_disk(folder, manifest, shard, 2))
        start, end = manifest.block_span(shard, 2)
        assert reader.counters.bytes_fetched - manifest_bytes == end - start
        tok = reader.tokenizer_json()
        assert tok is None  # the byte tokenizer has no file
        reader.close()
        assert server.served_bytes == manifest_bytes + end - start


def test_a_server_without_range_support_serves_whole_shards(
    corpus: tuple[Path, Manifest], plain_http: str, tmp_path: Path
) -> None:
    folder, manifest = corpus
    reader = CorpusReader(plain_http, manifest.corpus_id, tmp_path)
    shard = manifest.split("train")[0]
    for k in range(len(shard.blocks)):
        assert np.array_equal(reader.block(shard, k), on_disk(folder, manifest, shard, k))
    assert reader.counters.requests == 2  # the manifest, then the whole shard once
    assert reader.counters.cache_hits == len(shard.blocks) - 1
    reader.close()


def test_failover_past_a_dead_mirror_and_a_corrupt_one(corpus: tuple[Path, Manifest], tmp_path: Path) -> None:
    folder, manifest = corpus
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    shard = manifest.split("train")[0]
    raw = bytearray((bad / shard.name).read_bytes())
    raw[HEADER.size + 5] ^= 0xFF
    (bad / shard.name).write_bytes(bytes(raw))
    with DataServer(folder) as good:
        dead = DataServer(folder)  # opened after the good one, so never on its port
        dead.close()  # nothing listens there any more
        reader = CorpusReader(f"{dead.url} {bad} {good.url}", manifest.corpus_id, tmp_path / "cache")
        assert np.array_equal(reader.block(shard, 0), on_disk(folder, manifest, shard, 0))
        assert reader.counters.refused == 2  # the dead mirror, then the corrupt block
        reader.close()


def test_a_corrupt_or_truncated_cache_entry_is_fetched_again(
    corpus: tuple[Path, Manifest], tmp_path: Path
) -> None:
    folder, manifest = corpus
    shard = manifest.split("train")[0]
    reader = CorpusReader(str(folder), manifest.corpus_id, tmp_path)
    reader.block(shard, 1)
    entry = next(reader.cache.folder.glob("*.blk"))
    entry.write_bytes(entry.read_bytes()[:-3])
    assert np.array_equal(reader.block(shard, 1), on_disk(folder, manifest, shard, 1))
    assert reader.counters.cache_hits == 0 and reader.counters.requests == 3
    reader.close()


def test_no_mirror_with_verified_data_is_an_error(corpus: tuple[Path, Manifest], tmp_path: Path) -> None:
    folder, manifest = corpus
    with pytest.raises(FetchError, match="the run names corpus"):
        CorpusReader(str(folder), "0" * 32, tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    shard = manifest.split("train")[0]
    (bad / shard.name).write_bytes((bad / shard.name).read_bytes()[:100])
    reader = CorpusReader(str(bad), manifest.corpus_id, tmp_path / "cache")
    with pytest.raises(FetchError, match=r"no mirror delivered a verified train-00000\.bin block 0"):
        reader.block(shard, 0)
    reader.close()


def test_the_cache_stays_under_its_cap(corpus: tuple[Path, Manifest], tmp_path: Path) -> None:
    folder, manifest = corpus
    block_bytes = manifest.block_tokens * manifest.itemsize
    reader = CorpusReader(str(folder), manifest.corpus_id, tmp_path, cache_bytes=3 * block_bytes)
    for shard, k in all_blocks(manifest):
        reader.block(shard, k)
        assert reader.cache.bytes <= 3 * block_bytes
    assert len(list(reader.cache.folder.glob("*.blk"))) <= 3
    reader.close()


def test_prefetch_fetches_ahead(corpus: tuple[Path, Manifest], tmp_path: Path) -> None:
    folder, manifest = corpus
    reader = CorpusReader(str(folder), manifest.corpus_id, tmp_path)
    keys = [(s.name, k) for s, k in all_blocks(manifest)[:4]]
    reader.prefetch(keys)
    reader.prefetch(keys)  # asked twice, fetched once
    for (name, k), (shard, _) in zip(keys, all_blocks(manifest)[:4], strict=True):
        assert np.array_equal(reader.block(manifest.shard(name), k), on_disk(folder, manifest, shard, k))
    assert reader.counters.requests == 1 + 4
    reader.close()


def test_the_data_server_serves_ranges_and_only_the_corpus(corpus: tuple[Path, Manifest]) -> None:
    folder, manifest = corpus
    shard = manifest.shards[0]
    with DataServer(folder) as server:
        request = urllib.request.Request(server.url + shard.name, headers={"Range": "bytes=10-19"})
        with urllib.request.urlopen(request, timeout=5) as reply:
            assert reply.status == 206 and reply.read() == (folder / shard.name).read_bytes()[10:20]
            assert reply.headers["Content-Range"] == f"bytes 10-19/{shard.size}"
        for name, code in [("../raw.jsonl", 404), ("nope.bin", 404)]:
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(server.url + name, timeout=5)
            assert e.value.code == code
        request = urllib.request.Request(server.url + shard.name, headers={"Range": f"bytes={shard.size}-"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=5)
        assert e.value.code == 416


def test_swarm_data_serve_serves_a_folder_until_stopped(
    corpus: tuple[Path, Manifest], tmp_path: Path
) -> None:
    folder, manifest = corpus
    cmd = [sys.executable, "-m", "swarm.cli", "data", "serve", str(folder)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert select.select([proc.stdout], [], [], 30)[0], "swarm data serve printed nothing in 30 s"
        line = proc.stdout.readline()  # printed once it serves
        assert line.startswith(f"corpus {manifest.corpus_id} served at http://127.0.0.1:")
        reader = CorpusReader(line.split()[-1], manifest.corpus_id, tmp_path)
        shard = manifest.shards[-1]
        assert np.array_equal(reader.block(shard, 0), on_disk(folder, manifest, shard, 0))
        reader.close()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
