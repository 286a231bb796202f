"""Reading a prepared corpus from a local folder or HTTP(S) mirrors: verified blocks, an on-disk cache
under a size cap, prefetch in the background, failover between mirrors.

Every block is checked against the manifest (:func:`swarm.io.shards.check_block`) when it arrives and
again when it is read back from the cache, so a corrupt or truncated fetch is refused (and fetched again
from the next mirror), never returned. Mirrors that answer a Range request with the whole file (a server
without Range support) are used too: the whole shard is verified and all its blocks are cached.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from swarm.io import shards
from swarm.io.cache import atomic_write, resolve_cache_dir
from swarm.io.shards import IntegrityError, Manifest, ShardInfo

log = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 30.0
DEFAULT_CACHE_BYTES = 2 << 30
Key = tuple[str, int]  # (shard name, block index)


class FetchError(OSError):
    """No mirror could deliver verified data."""


class Mirror(ABC):
    """One place the prepared files are found."""

    @abstractmethod
    def read(self, name: str, start: int | None = None, end: int | None = None) -> tuple[bytes, bool]:
        """Bytes ``[start, end)`` of file ``name`` (``None``: the whole file), and whether they are the
        range asked for (``False``: the whole file came instead)."""


class FolderMirror(Mirror):
    """A prepared folder on this machine."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()

    def read(self, name: str, start: int | None = None, end: int | None = None) -> tuple[bytes, bool]:
        with open(self.path / name, "rb") as f:
            if start is None:
                return f.read(), True
            f.seek(start)
            return f.read(end - start), True

    def __str__(self) -> str:
        return str(self.path)


class HttpMirror(Mirror):
    """A base URL under which the prepared files are served (Range requests preferred)."""

    def __init__(self, base: str, timeout_s: float = HTTP_TIMEOUT_S) -> None:
        self.base, self.timeout_s = base.rstrip("/") + "/", timeout_s

    def read(self, name: str, start: int | None = None, end: int | None = None) -> tuple[bytes, bool]:
        request = urllib.request.Request(self.base + name)
        if start is not None:
            request.add_header("Range", f"bytes={start}-{end - 1}")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
            return reply.read(), start is None or reply.status == 206

    def __str__(self) -> str:
        return self.base


def mirrors_of(source: str) -> list[Mirror]:
    """The mirrors a run's ``data.source`` names: whitespace-separated folders or http(s) base URLs."""
    urls = ("http://", "https://")
    return [HttpMirror(s) if s.startswith(urls) else FolderMirror(s) for s in source.split()]


def is_prepared(source: str | None) -> bool:
    """Whether ``source`` names a prepared corpus (URLs, or a folder holding a manifest)."""
    if not source:
        return False
    first = source.split()[0]
    return first.startswith(("http://", "https://")) or (Path(first).expanduser() / shards.MANIFEST).is_file()


class BlockCache:
    """Verified blocks on disk, least recently used evicted past ``cap_bytes``."""

    def __init__(self, folder: Path, cap_bytes: int) -> None:
        self.folder, self.cap_bytes = folder, cap_bytes
        folder.mkdir(parents=True, exist_ok=True)
        found = sorted(
            (p for p in folder.iterdir() if p.suffix == ".blk"), key=lambda p: p.stat().st_mtime_ns
        )
        self._sizes: OrderedDict[str, int] = OrderedDict((p.name, p.stat().st_size) for p in found)
        self._lock = threading.Lock()

    @staticmethod
    def _name(key: Key) -> str:
        return f"{key[0]}.{key[1]}.blk"

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())

    def get(self, key: Key) -> bytes | None:
        name = self._name(key)
        with self._lock:
            if name not in self._sizes:
                return None
            self._sizes.move_to_end(name)
        try:
            data = (self.folder / name).read_bytes()
        except FileNotFoundError:
            return None
        os.utime(self.folder / name)
        return data

    def put(self, key: Key, data: bytes) -> None:
        name = self._name(key)
        atomic_write(self.folder / name, data)
        with self._lock:
            self._sizes[name] = len(data)
            self._sizes.move_to_end(name)
            while sum(self._sizes.values()) > self.cap_bytes and len(self._sizes) > 1:
                old, _ = self._sizes.popitem(last=False)
                (self.folder / old).unlink(missing_ok=True)

    def drop(self, key: Key) -> None:
        with self._lock:
            self._sizes.pop(self._name(key), None)
        (self.folder / self._name(key)).unlink(missing_ok=True)


@dataclass
class FetchCounters:
    """What a reader moved: bytes and requests from mirrors, blocks served from the cache, refusals."""

    bytes_fetched: int = 0
    requests: int = 0
    cache_hits: int = 0
    refused: int = 0  # fetches that failed verification or errored (each retried elsewhere)


class CorpusReader:
    """A prepared corpus named by id, read block by block from its mirrors through a verified cache."""

    def __init__(
        self,
        source: str,
        corpus_id: str | None = None,
        cache_dir: str | Path | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        prefetch_threads: int = 2,
    ) -> None:
        self.mirrors = mirrors_of(source)
        if not self.mirrors:
            raise ValueError("no corpus source given")
        self.counters = FetchCounters()
        self._lock = threading.Lock()
        self.manifest = self._manifest(corpus_id)
        root = resolve_cache_dir(cache_dir) / "corpora" / self.manifest.corpus_id
        self.cache = BlockCache(root, cache_bytes)
        self._pool = ThreadPoolExecutor(prefetch_threads, thread_name_prefix="corpus-prefetch")
        self._inflight: dict[Key, Future[bytes]] = {}

    def _manifest(self, corpus_id: str | None) -> Manifest:
        errors = []
        for mirror in self.mirrors:
            try:
                data, _ = self._fetch(mirror, shards.MANIFEST)
                return Manifest.from_json(data, corpus_id)
            except (OSError, IntegrityError) as e:
                errors.append(f"{mirror}: {e}")
        raise FetchError("no mirror served the corpus manifest: " + "; ".join(errors))

    def _fetch(self, mirror: Mirror, name: str, start: int | None = None, end: int | None = None):
        data, ranged = mirror.read(name, start, end)
        with self._lock:
            self.counters.bytes_fetched += len(data)
            self.counters.requests += 1
        return data, ranged

    def tokenizer_json(self) -> str | None:
        """The corpus's ``tokenizer.json`` (verified against the manifest), ``None`` for bytes."""
        file = self.manifest.tokenizer["file"]
        if file is None:
            return None
        for mirror in self.mirrors:
            try:
                data, _ = self._fetch(mirror, file)
                self.manifest.check_tokenizer(hashlib.sha256(data).hexdigest())
                return data.decode("utf-8")
            except (OSError, IntegrityError) as e:
                self._refused(mirror, file, e)
        raise FetchError(f"no mirror served a verified {file}")

    def _refused(self, mirror: Mirror, what: str, error: Exception) -> None:
        with self._lock:
            self.counters.refused += 1
        log.warning("corpus %s: %s from %s refused: %s", self.manifest.corpus_id, what, mirror, error)

    # -- blocks --------------------------------------------------------------------------------------

    def block(self, shard: ShardInfo, k: int) -> np.ndarray:
        """The tokens of block ``k`` of ``shard`` (verified), from the cache or the mirrors."""
        return np.frombuffer(self._block_bytes(shard, k), dtype=self.manifest.dtype)

    def prefetch(self, keys: list[Key]) -> None:
        """Start fetching these blocks in the background (those not cached or already on their way)."""
        for key in keys:
            with self._lock:
                if key in self._inflight:
                    continue
                future = self._pool.submit(self._load, self.manifest.shard(key[0]), key[1])
                self._inflight[key] = future
            future.add_done_callback(lambda _f, key=key: self._settle(key))

    def _settle(self, key: Key) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    def _block_bytes(self, shard: ShardInfo, k: int) -> bytes:
        with self._lock:
            future = self._inflight.get((shard.name, k))
        return future.result() if future is not None else self._load(shard, k)

    def _load(self, shard: ShardInfo, k: int) -> bytes:
        key = (shard.name, k)
        data = self.cache.get(key)
        if data is not None:
            try:
                shards.check_block(self.manifest, shard, k, data)
                with self._lock:
                    self.counters.cache_hits += 1
                return data
            except IntegrityError as e:
                log.warning("corpus cache: %s (dropped, fetching again)", e)
                self.cache.drop(key)
        start, end = self.manifest.block_span(shard, k)
        for mirror in self.mirrors:
            try:
                data, ranged = self._fetch(mirror, shard.name, start, end)
                if ranged:
                    shards.check_block(self.manifest, shard, k, data)
                    self.cache.put(key, data)
                    return data
                return self._whole_shard(shard, k, data)
            except (OSError, IntegrityError) as e:
                self._refused(mirror, f"{shard.name} block {k}", e)
        raise FetchError(f"no mirror delivered a verified {shard.name} block {k} ({len(self.mirrors)} tried)")

    def _whole_shard(self, shard: ShardInfo, k: int, data: bytes) -> bytes:
        """A mirror sent the whole file: verify it, cache every block, return block ``k``."""
        shards.check_shard(self.manifest, shard, iter([data]))
        for j in range(len(shard.blocks)):
            start, end = self.manifest.block_span(shard, j)
            self.cache.put((shard.name, j), data[start:end])
        start, end = self.manifest.block_span(shard, k)
        return data[start:end]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
