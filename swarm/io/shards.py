"""The on-disk format of a prepared corpus: token shards, their manifest, and their verification.

A prepared corpus is a folder::

    manifest.json        format, tokenizer (digest, file, framing ids), dtype, block size, the shards;
                         its corpus id is the sha256 of its canonical JSON (the id excluded), 32 hex digits
    tokenizer.json       the HF tokenizer the ids come from (absent for the byte tokenizer)
    train-00000.bin ...  token shards of the training split, val-00000.bin ... of the validation split

A shard is a 64-byte header (:data:`HEADER`: magic, version, bytes per token, tokens, documents, block
size in tokens) and then its tokens, little-endian ``uint16`` (``uint32`` when the ids need it). Every
document is framed ``BOS ids EOS``. The manifest holds each shard's size and sha256 and the sha256 of
each block of ``block_tokens`` tokens, so a reader can verify a whole shard or any block it fetched
by an HTTP Range request alone.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "subspace-swarm/tokens/v1"
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
MAGIC = b"SWTOKENS"
VERSION = 1
HEADER = struct.Struct("<8sHHQQQ28x")  # magic, version, itemsize, tokens, documents, block_tokens
SPLITS = ("train", "val")
ID_LEN = 32  # hex digits of a corpus id
_READ = 1 << 22


class IntegrityError(ValueError):
    """Prepared data that does not match its manifest: tampered, truncated, or from another tokenizer."""


def dtype_for(n_ids: int) -> np.dtype:
    """The narrowest little-endian unsigned dtype holding ids ``0 .. n_ids - 1``."""
    return np.dtype("<u2") if n_ids <= 1 << 16 else np.dtype("<u4")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest records it."""

    name: str
    split: str
    tokens: int
    docs: int
    size: int
    sha256: str
    blocks: tuple[str, ...]  # sha256 of each block's bytes

    def to_dict(self) -> dict:
        return {**self.__dict__, "blocks": list(self.blocks)}


@dataclass(frozen=True)
class Manifest:
    """What a prepared corpus holds; see the module docstring."""

    tokenizer: dict  # digest, file (None: bytes), vocab_size, bos, eos
    dtype: str  # "uint16" or "uint32"
    block_tokens: int
    val_every: int  # every val_every-th document (by index, from the last of the first group) is val
    shards: tuple[ShardInfo, ...]

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def n_ids(self) -> int:
        """The vocabulary a model needs for these ids (the tokenizer's, plus framing ids past it)."""
        t = self.tokenizer
        return max(t["vocab_size"], t["bos"] + 1, t["eos"] + 1)

    def split(self, name: str) -> list[ShardInfo]:
        return [s for s in self.shards if s.split == name]

    def counts(self, split: str) -> dict[str, int]:
        shards = self.split(split)
        return {"tokens": sum(s.tokens for s in shards), "docs": sum(s.docs for s in shards)}

    def shard(self, name: str) -> ShardInfo:
        for s in self.shards:
            if s.name == name:
                return s
        raise KeyError(f"no shard {name!r} in corpus {self.corpus_id}")

    def n_blocks(self, shard: ShardInfo) -> int:
        return len(shard.blocks)

    def block_span(self, shard: ShardInfo, k: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of block ``k`` of ``shard`` in its file."""
        start = HEADER.size + k * self.block_tokens * self.itemsize
        end = min(start + self.block_tokens * self.itemsize, HEADER.size + shard.tokens * self.itemsize)
        return start, end

    def _body(self) -> dict:
        return {
            "format": FORMAT,
            "tokenizer": self.tokenizer,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
            "val_every": self.val_every,
            "splits": {s: self.counts(s) for s in SPLITS},
            "shards": [s.to_dict() for s in self.shards],
        }

    @property
    def corpus_id(self) -> str:
        canonical = json.dumps(self._body(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:ID_LEN]

    def to_json(self) -> str:
        return json.dumps({"corpus_id": self.corpus_id, **self._body()}, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, data: bytes | str, expect: str | None = None) -> Manifest:
        """Parse a manifest, checking it hashes to its corpus id and, if given, to ``expect``."""
        try:
            d = json.loads(data)
            if d.get("format") != FORMAT:
                raise IntegrityError(f"not a prepared corpus of format {FORMAT} (format {d.get('format')!r})")
            shards = tuple(ShardInfo(**{**s, "blocks": tuple(s["blocks"])}) for s in d["shards"])
            m = cls(d["tokenizer"], d["dtype"], d["block_tokens"], d["val_every"], shards)
            stated = d["corpus_id"]
            if d["splits"] != m._body()["splits"]:
                raise IntegrityError("manifest: its split totals do not add up to its shards")
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, IntegrityError):
                raise
            raise IntegrityError(f"manifest: malformed ({e!r})") from e
        if m.corpus_id != stated:
            raise IntegrityError(f"manifest: altered (it hashes to {m.corpus_id}, it says {stated})")
        if expect is not None and m.corpus_id != expect:
            raise IntegrityError(f"manifest is of corpus {m.corpus_id}, the run names corpus {expect}")
        return m

    def check_tokenizer(self, digest: str) -> None:
        """Refuse a tokenizer other than the one the corpus was tokenised with."""
        if digest != self.tokenizer["digest"]:
            raise IntegrityError(
                f"corpus {self.corpus_id} was tokenised with tokenizer {self.tokenizer['digest'][:16]}, "
                f"not {digest[:16]}"
            )


def pack_header(itemsize: int, tokens: int, docs: int, block_tokens: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, itemsize, tokens, docs, block_tokens)


def check_block(manifest: Manifest, shard: ShardInfo, k: int, data: bytes) -> None:
    """Raise :class:`IntegrityError` unless ``data`` is block ``k`` of ``shard``."""
    start, end = manifest.block_span(shard, k)
    if len(data) != end - start:
        raise IntegrityError(f"{shard.name} block {k}: {len(data)} bytes, expected {end - start} (truncated)")
    if hashlib.sha256(data).hexdigest() != shard.blocks[k]:
        raise IntegrityError(f"{shard.name} block {k}: sha256 mismatch (corrupt or tampered)")


def check_shard(manifest: Manifest, shard: ShardInfo, chunks: Iterator[bytes]) -> None:
    """Raise :class:`IntegrityError` unless the bytes ``chunks`` yield are ``shard``'s whole file."""
    h, size, head = hashlib.sha256(), 0, b""
    for chunk in chunks:
        if len(head) < HEADER.size:
            head += chunk[: HEADER.size - len(head)]
        h.update(chunk)
        size += len(chunk)
    if size != shard.size:
        raise IntegrityError(f"{shard.name}: {size} bytes, expected {shard.size} (truncated or padded)")
    if h.hexdigest() != shard.sha256:
        raise IntegrityError(f"{shard.name}: sha256 mismatch (corrupt or tampered)")
    if head != pack_header(manifest.itemsize, shard.tokens, shard.docs, manifest.block_tokens):
        raise IntegrityError(f"{shard.name}: header disagrees with the manifest")


def read_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            yield chunk


def verify_folder(folder: str | Path, expect: str | None = None, deep: bool = True) -> Manifest:
    """Read and verify a prepared folder: manifest, tokenizer file, every shard (``deep=False``: each
    shard's size only; readers check every block they fetch anyway)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise IntegrityError(f"{folder}: no {MANIFEST}; prepare it with `swarm data prepare`")
    manifest = Manifest.from_json(path.read_bytes(), expect)
    file = manifest.tokenizer["file"]
    if file is not None:
        manifest.check_tokenizer(hashlib.sha256((folder / file).read_bytes()).hexdigest())
    for shard in manifest.shards:
        path = folder / shard.name
        if not path.is_file():
            raise IntegrityError(f"{folder}: shard {shard.name} is missing")
        if deep:
            check_shard(manifest, shard, read_chunks(path))
        elif path.stat().st_size != shard.size:
            raise IntegrityError(f"{shard.name}: {path.stat().st_size} bytes, expected {shard.size}")
    return manifest


class ShardWriter:
    """Writes one shard: tokens appended in order, blocks hashed as they fill; :meth:`close` seals it."""

    def __init__(self, folder: Path, split: str, index: int, dtype: np.dtype, block_tokens: int) -> None:
        self.name, self.split = shard_name(split, index), split
        self.dtype, self.block_tokens = dtype, block_tokens
        self.path = folder / self.name
        self._f = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._f.write(bytes(HEADER.size))
        self.tokens = self.docs = 0
        self._blocks: list[str] = []
        self._block = hashlib.sha256()

    def add(self, tokens: np.ndarray, docs: int) -> None:
        """Append ``tokens`` (in which ``docs`` documents start)."""
        data = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._f.write(data.tobytes())
        self.docs += docs
        while len(data):
            room = self.block_tokens - self.tokens % self.block_tokens
            self._block.update(data[:room].tobytes())
            self.tokens += min(room, len(data))
            data = data[room:]
            if self.tokens % self.block_tokens == 0:
                self._seal_block()

    def _seal_block(self) -> None:
        self._blocks.append(self._block.hexdigest())
        self._block = hashlib.sha256()

    def close(self) -> ShardInfo:
        """Write the header, hash the file and return what the manifest records of it."""
        if self.tokens % self.block_tokens:
            self._seal_block()
        self._f.seek(0)
        self._f.write(pack_header(self.dtype.itemsize, self.tokens, self.docs, self.block_tokens))
        self._f.close()
        h = hashlib.sha256()
        for chunk in read_chunks(self.path):
            h.update(chunk)
        size = self.path.stat().st_size
        blocks = tuple(self._blocks)
        return ShardInfo(self.name, self.split, self.tokens, self.docs, size, h.hexdigest(), blocks)
