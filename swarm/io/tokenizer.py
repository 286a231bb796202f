"""Tokenizers (torch-free): UTF-8 bytes, a byte-level BPE trained locally, or any HF ``tokenizer.json``."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from swarm.io.cache import KEY_LEN, atomic_write, corpus_hash, resolve_cache_dir

DEFAULT_BPE_VOCAB = 4096
_BPE_RECIPE = "bytelevel-bpe-v1"  # bump when BpeTokenizer.train changes, to invalidate caches
# The names a tokenizer's own document-start and document-end tokens go by (first found wins).
BOS_NAMES = ("<|bos|>", "<s>", "<|begin_of_text|>", "<|startoftext|>")
EOS_NAMES = ("<|eos|>", "</s>", "<|end_of_text|>", "<|endoftext|>")


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

    def token_id(self, name: str) -> int | None:
        """The id of the special token ``name``, or ``None`` when it has none."""
        return None

    def to_json(self) -> str | None:
        """The HF ``tokenizer.json`` this tokenizer is, or ``None`` when it needs no file."""
        return None

    def framing(self) -> tuple[int, int]:
        """The ``(bos, eos)`` ids that frame a document: the tokenizer's own special tokens
        (:data:`BOS_NAMES`, :data:`EOS_NAMES`), else the first ids past its vocabulary."""
        bos = next((i for n in BOS_NAMES if (i := self.token_id(n)) is not None), None)
        eos = next((i for n in EOS_NAMES if (i := self.token_id(n)) is not None), None)
        fresh = iter(range(self.vocab_size, self.vocab_size + 2))
        return (next(fresh) if bos is None else bos), (next(fresh) if eos is None else eos)


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
    """A HF ``tokenizers`` tokenizer: the byte-level BPE trained here (every string round-trips
    exactly), or any ``tokenizer.json`` a user brings."""

    def __init__(self, hf: tokenizers.Tokenizer) -> None:
        self._hf = hf
        self._json = hf.to_str()
        self.vocab_size = hf.get_vocab_size()
        self.fingerprint = hashlib.sha256(self._json.encode("utf-8")).hexdigest()

    @classmethod
    def train(
        cls, texts: Sequence[str], vocab_size: int = DEFAULT_BPE_VOCAB, specials: Sequence[str] = ()
    ) -> BpeTokenizer:
        """Train a byte-level BPE of at most ``vocab_size`` tokens on ``texts`` (deterministic, no cache);
        ``specials`` take the first ids."""
        if vocab_size < 256 + len(specials):
            need = 256 + len(specials)  # the byte alphabet and the specials
            raise ValueError(f"BPE vocab_size must be >= {need}, got {vocab_size}")
        hf = tokenizers.Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=list(specials),
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
        path = resolve_cache_dir(cache_dir) / "tokenizers" / f"bpe-{key[:KEY_LEN]}.json"
        if path.is_file():
            return cls.from_json(path.read_text(encoding="utf-8"))
        tok = cls.train(texts, vocab_size)
        atomic_write(path, tok.to_json().encode("utf-8"))
        return tok

    @classmethod
    def from_json(cls, data: str) -> BpeTokenizer:
        """Rebuild a tokenizer from :meth:`to_json` output (any HF ``tokenizer.json``)."""
        return cls(tokenizers.Tokenizer.from_str(data))

    def to_json(self) -> str:
        """Return the HF ``tokenizer.json`` serialisation (what the fingerprint hashes)."""
        return self._json

    def token_id(self, name: str) -> int | None:
        """The id of the added (special) token spelled ``name``, if there is one."""
        return next((i for i, t in self._hf.get_added_tokens_decoder().items() if t.content == name), None)

    def encode(self, text: str) -> list[int]:
        """Return the BPE token ids of ``text``."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Return the text of ``ids``."""
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Return the token ids of each text, encoded in parallel."""
        return [e.ids for e in self._hf.encode_batch_fast(list(texts), add_special_tokens=False)]


def tokenizer_from_json(data: str | None) -> Tokenizer:
    """The tokenizer :meth:`Tokenizer.to_json` describes (``None``: bytes)."""
    return ByteTokenizer() if data is None else BpeTokenizer.from_json(data)
