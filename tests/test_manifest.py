"""Chunked snapshot manifests: a round trip, refusal of wrong chunks, a fetch that resumes from disk."""

from __future__ import annotations

import os

import pytest

from swarm.io.manifest import ChunkError, Manifest
from swarm.io.partial import PartialSnapshot


def snapshot_bytes(n: int = 10_000) -> bytes:
    return os.urandom(n)


def test_manifest_round_trip_names_every_chunk():
    data = snapshot_bytes()
    m = Manifest.of(2, 40, data, chunk_bytes=4096)
    assert len(m.chunks) == 3 and m.span(2) == (8192, 10_000 - 8192)
    again = Manifest.parse(2, 40, m.digest, m.size, m.chunk_bytes, m.packed)
    assert again == m
    for i in range(3):
        offset, length = m.span(i)
        again.check(i, data[offset : offset + length])


def test_wrong_chunks_and_malformed_manifests_are_refused():
    data = snapshot_bytes()
    m = Manifest.of(0, 4, data, chunk_bytes=4096)
    with pytest.raises(ChunkError, match="does not match its sha256"):
        m.check(0, bytes(4096))
    with pytest.raises(ChunkError, match="has 4095 bytes"):
        m.check(0, data[:4095])
    with pytest.raises(ChunkError, match="no chunk 3"):
        m.check(3, b"")
    with pytest.raises(ChunkError, match="chunk hashes"):
        Manifest.parse(0, 4, m.digest, m.size, m.chunk_bytes, m.packed[:-1])
    with pytest.raises(ChunkError, match="chunk size"):
        Manifest.parse(0, 4, m.digest, m.size, 0, m.packed)
    with pytest.raises(ChunkError, match="not a sha256"):
        Manifest.parse(0, 4, "../../etc/passwd", m.size, m.chunk_bytes, m.packed)


def test_a_partial_fetch_resumes_with_only_the_missing_chunks(tmp_path):
    data = snapshot_bytes()
    m = Manifest.of(1, 9, data, chunk_bytes=2048)
    first = PartialSnapshot(tmp_path, m)
    for i in (0, 3):
        offset, length = m.span(i)
        first.put(i, data[offset : offset + length])
    with pytest.raises(ChunkError):
        first.put(1, bytes(2048))  # a lying holder's chunk is not kept
    resumed = PartialSnapshot(tmp_path, m)  # the process restarted
    assert resumed.missing() == [1, 2, 4]
    with pytest.raises(ChunkError, match="not fetched yet"):
        resumed.assemble()
    for i in resumed.missing():
        offset, length = m.span(i)
        resumed.put(i, data[offset : offset + length])
    assert resumed.assemble() == data
    assert not resumed.folder.exists()


def test_a_chunk_gone_bad_on_disk_is_dropped_and_fetched_again(tmp_path):
    data = snapshot_bytes()
    m = Manifest.of(1, 9, data, chunk_bytes=4096)
    partial = PartialSnapshot(tmp_path, m)
    for i in range(3):
        offset, length = m.span(i)
        partial.put(i, data[offset : offset + length])
    (partial.folder / "0000001.chunk").write_bytes(bytes(4096))
    with pytest.raises(ChunkError, match=r"chunks \[1\]"):
        partial.assemble()
    assert partial.missing() == [1]
