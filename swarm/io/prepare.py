"""``swarm data prepare``: tokenise a raw corpus once into verified shards (format: :mod:`swarm.io.shards`).

Documents stream from the source in a fixed order and go to worker processes in batches of about
:data:`TASK_BYTES` of text, at most two batches per worker in flight, so memory stays bounded whatever the
corpus size; results are written in submission order, so the same input and tokenizer give the same
bytes with any number of workers.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path

import numpy as np

from swarm.io import shards
from swarm.io.documents import iter_documents
from swarm.io.shards import Manifest, ShardInfo, ShardWriter
from swarm.io.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer, tokenizer_from_json

TASK_BYTES = 1 << 20
SPECIALS = ("<|bos|>", "<|eos|>")  # what a BPE trained here frames documents with


@dataclass(frozen=True)
class PrepareOptions:
    """How a corpus is cut: shard and block sizes in tokens, the validation split, the BPE sample."""

    shard_tokens: int = 1 << 26
    block_tokens: int = 1 << 18
    val_every: int = 20  # document i is validation when i % val_every == val_every - 1 (0: none)
    vocab_size: int = 4096  # of a BPE trained here
    bpe_sample_bytes: int = 64 << 20  # a BPE trained here learns from the corpus's first this many bytes
    workers: int = max(1, (os.cpu_count() or 1))

    def __post_init__(self) -> None:
        if self.block_tokens < 2 or self.shard_tokens < self.block_tokens:
            raise ValueError("prepare needs block_tokens >= 2 and shard_tokens >= block_tokens")
        if self.val_every < 0 or self.val_every == 1:
            raise ValueError(f"val_every={self.val_every}: 0 (no validation split) or >= 2")


def resolve_tokenizer(spec: str, source: str | Path | None, options: PrepareOptions) -> Tokenizer:
    """``"byte"``, ``"bpe"`` (trained on the start of ``source``, framing tokens included) or the path
    of a HF ``tokenizer.json``."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        sample, size = [], 0
        for doc in iter_documents(source):
            sample.append(doc)
            size += len(doc)
            if size >= options.bpe_sample_bytes:
                break
        return BpeTokenizer.train(sample, options.vocab_size, SPECIALS)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {spec!r}: expected 'bpe', 'byte' or a tokenizer.json file")
    return BpeTokenizer.from_json(path.read_text(encoding="utf-8"))


# -- workers ------------------------------------------------------------------------------------------

_worker: tuple[Tokenizer, int, int, np.dtype, int] | None = None


def _init(tok_json: str | None, bos: int, eos: int, dtype: str, val_every: int, pooled: bool) -> None:
    global _worker
    if pooled:  # one core per process: the pool is the parallelism
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = (tokenizer_from_json(tok_json), bos, eos, np.dtype(dtype), val_every)


Encoded = dict[str, tuple[np.ndarray, np.ndarray]]  # split -> (tokens, framed document lengths)


def _encode(first: int, texts: list[str]) -> Encoded:
    """Frame and tokenise documents ``first, first + 1, ...``, split into train and validation."""
    assert _worker is not None
    tok, bos, eos, dtype, val_every = _worker
    encoded = tok.encode_many(texts)
    split = [
        "val" if val_every and i % val_every == val_every - 1 else "train"
        for i in range(first, first + len(texts))
    ]
    return {
        s: _framed([ids for ids, d in zip(encoded, split, strict=True) if d == s], bos, eos, dtype)
        for s in shards.SPLITS
    }


def _framed(docs: list[list[int]], bos: int, eos: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``BOS ids EOS`` of every document, concatenated, and each framed document's length."""
    lengths = np.fromiter((len(d) + 2 for d in docs), dtype=np.int64, count=len(docs))
    ends = np.cumsum(lengths)
    out = np.empty(int(ends[-1]) if len(docs) else 0, dtype=dtype)
    inner = np.ones(len(out), dtype=bool)
    inner[ends - lengths] = inner[ends - 1] = False
    out[ends - lengths], out[ends - 1] = bos, eos
    out[inner] = np.fromiter(chain.from_iterable(docs), dtype=dtype, count=len(out) - 2 * len(docs))
    return out, lengths


def _tasks(docs: Iterable[str]) -> Iterator[tuple[int, list[str]]]:
    first, batch, size = 0, [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= TASK_BYTES:
            yield first, batch
            first, batch, size = first + len(batch), [], 0
    if batch:
        yield first, batch


def _encoded(tasks: Iterator[tuple[int, list[str]]], workers: int, init: tuple) -> Iterator[Encoded]:
    """Results in task order; at most ``2 * workers`` tasks in flight."""
    if workers <= 1:
        _init(*init, False)
        for task in tasks:
            yield _encode(*task)
        return
    context = multiprocessing.get_context("spawn")  # nothing inherited: safe after tokenizers used threads
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init, initargs=(*init, True)) as pool:
        pending = deque(pool.submit(_encode, *t) for t in islice(tasks, 2 * workers))
        while pending:
            result = pending.popleft().result()
            for task in islice(tasks, 1):
                pending.append(pool.submit(_encode, *task))
            yield result


# -- writing ------------------------------------------------------------------------------------------


class SplitWriter:
    """One split's shards: tokens appended in order, a new shard every ``shard_tokens`` tokens."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, options: PrepareOptions) -> None:
        self.folder, self.split, self.dtype, self.options = folder, split, dtype, options
        self.done: list[ShardInfo] = []
        self._open: ShardWriter | None = None

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        starts = np.cumsum(lengths) - lengths
        pos = 0
        while pos < len(tokens):
            if self._open is None:
                self._open = ShardWriter(
                    self.folder, self.split, len(self.done), self.dtype, self.options.block_tokens
                )
            end = min(len(tokens), pos + self.options.shard_tokens - self._open.tokens)
            docs = int(np.searchsorted(starts, end) - np.searchsorted(starts, pos))
            self._open.add(tokens[pos:end], docs)
            pos = end
            if self._open.tokens == self.options.shard_tokens:
                self.done.append(self._open.close())
                self._open = None

    def close(self) -> list[ShardInfo]:
        if self._open is not None:
            self.done.append(self._open.close())
            self._open = None
        return self.done


def prepare(
    source: str | Path | None, out: str | Path, tokenizer: Tokenizer, options: PrepareOptions | None = None
) -> Manifest:
    """Tokenise ``source`` (see :func:`~swarm.io.documents.iter_documents`) into the prepared folder ``out``
    (built beside it, then moved in place; a previous prepared folder there is replaced)."""
    options = options or PrepareOptions()
    out = Path(out)
    if out.exists() and not (out / shards.MANIFEST).is_file() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a prepared corpus: refusing to replace it")
    bos, eos = tokenizer.framing()
    dtype = shards.dtype_for(max(tokenizer.vocab_size, bos + 1, eos + 1))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tok_json = tokenizer.to_json()
        writers = {s: SplitWriter(tmp, s, dtype, options) for s in shards.SPLITS}
        init = (tok_json, bos, eos, dtype.str, options.val_every)
        for result in _encoded(_tasks(iter_documents(source)), options.workers, init):
            for split, (tokens, lengths) in result.items():
                writers[split].add(tokens, lengths)
        infos = [info for s in shards.SPLITS for info in writers[s].close()]
        if not any(i.split == "train" for i in infos):
            raise ValueError(f"{source}: no training tokens (every document went to validation)")
        if tok_json is not None:
            (tmp / shards.TOKENIZER_FILE).write_text(tok_json, encoding="utf-8")
        described = {
            "digest": tokenizer.fingerprint,
            "file": None if tok_json is None else shards.TOKENIZER_FILE,
            "vocab_size": tokenizer.vocab_size,
            "bos": bos,
            "eos": eos,
        }
        manifest = Manifest(described, dtype.name, options.block_tokens, options.val_every, tuple(infos))
        (tmp / shards.MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest
