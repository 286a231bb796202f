"""A prepared corpus as a run's dataset: batches in the run's global sample order, validation tokens.

Batch ``s`` holds samples ``s * B .. (s + 1) * B - 1`` of :class:`~swarm.io.order.SampleOrder`: a
function of the step alone, so whoever draws step ``s`` (after a resume, a re-plan, on another node)
draws the same windows. Only the node that builds batches (stage 0) reads the corpus; the targets
travel to the last stage with the token ids. Memory holds at most ``2 * group`` decoded blocks.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch

from swarm.io.fetch import CorpusReader
from swarm.io.order import SampleOrder
from swarm.io.shards import ShardInfo

DEFAULT_GROUP = 8  # blocks whose windows one stretch of the order mixes
DEFAULT_AHEAD = 4  # batches whose blocks are prefetched ahead of the one drawn
VAL_TOKENS = 1 << 20  # the validation split's first this many tokens are evaluated on


class CorpusSampler:
    """Training batches of a prepared corpus; the interface of :class:`~swarm.io.data.BatchSampler`."""

    def __init__(
        self,
        reader: CorpusReader,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        group: int = DEFAULT_GROUP,
        ahead: int = DEFAULT_AHEAD,
    ) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        self.reader, self.batch_size, self.seq_len, self.seed = reader, batch_size, seq_len, seed
        m = reader.manifest
        self.blocks: list[tuple[ShardInfo, int]] = [
            (s, k) for s in m.split("train") for k in range(len(s.blocks))
        ]
        spans = [m.block_span(s, k) for s, k in self.blocks]
        windows = [((end - start) // m.itemsize - 1) // seq_len for start, end in spans]
        self.order = SampleOrder(windows, seed, group)
        self.ahead, self.step = ahead, 0
        self._decoded: OrderedDict[int, np.ndarray] = OrderedDict()
        self._capacity = 2 * group
        self._prefetched = -1  # the last step whose blocks were handed to the prefetcher

    def ids(self, step: int) -> torch.Tensor:
        """The ``B x (T + 1)`` int64 token ids of batch ``step`` (inputs and the targets' last column)."""
        t = self.seq_len
        self._prefetch(step)
        rows = []
        for i in range(step * self.batch_size, (step + 1) * self.batch_size):
            b, w = self.order.locate(i)
            rows.append(self._block(b)[w * t : w * t + t + 1])
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(inputs, targets)``; ``targets`` is ``inputs`` shifted left by one token."""
        ids = self.ids(self.step)
        self.step += 1
        return ids[:, :-1], ids[:, 1:]

    def _block(self, b: int) -> np.ndarray:
        if b in self._decoded:
            self._decoded.move_to_end(b)
            return self._decoded[b]
        tokens = self.reader.block(*self.blocks[b])
        self._decoded[b] = tokens
        if len(self._decoded) > self._capacity:
            self._decoded.popitem(last=False)
        return tokens

    def _prefetch(self, step: int) -> None:
        first = max(step + 1, self._prefetched + 1)
        last = step + self.ahead
        if first > last:
            return
        wanted: dict[tuple[str, int], None] = {}
        for i in range(first * self.batch_size, (last + 1) * self.batch_size):
            b, _ = self.order.locate(i)
            if b not in self._decoded:
                shard, k = self.blocks[b]
                wanted[(shard.name, k)] = None
        self.reader.prefetch(list(wanted))
        self._prefetched = last

    def state_dict(self) -> dict[str, int | str]:
        """The position (and the settings it is only valid for)."""
        return {
            "corpus": self.reader.manifest.corpus_id,
            "seed": self.seed,
            "step": self.step,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: Mapping[str, int | str]) -> None:
        """Resume at a position from :meth:`state_dict`; the settings must match this sampler's."""
        mine = self.state_dict()
        wrong = [
            f"{k}={state.get(k)} (here {mine[k]})" for k in mine if k != "step" and state.get(k) != mine[k]
        ]
        if wrong:
            raise ValueError(f"sampler state is for a different setup: {', '.join(wrong)}")
        self.step = int(state["step"])


class PreparedDataset:
    """A prepared corpus read through a :class:`CorpusReader`; the interface of ``TokenDataset``."""

    def __init__(self, reader: CorpusReader) -> None:
        self.reader = reader
        self.vocab_size = reader.manifest.n_ids

    def sampler(self, batch_size: int, seq_len: int, seed: int = 0) -> CorpusSampler:
        return CorpusSampler(self.reader, batch_size, seq_len, seed)

    @functools.cached_property
    def val(self) -> torch.Tensor:
        """The first :data:`VAL_TOKENS` tokens of the validation split (read on first use)."""
        parts, n = [], 0
        for shard in self.reader.manifest.split("val"):
            for k in range(len(shard.blocks)):
                if n >= VAL_TOKENS:
                    break
                parts.append(self.reader.block(shard, k))
                n += len(parts[-1])
        tokens = np.concatenate(parts)[:VAL_TOKENS] if parts else np.zeros(0, dtype=np.int32)
        return torch.from_numpy(tokens.astype(np.int32))
