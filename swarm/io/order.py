"""The run's global sample order: sample ``i`` -> (block, window) by keyed permutations, no state.

A prepared corpus's training blocks hold ``windows[b]`` windows each (``seq_len + 1`` tokens, consecutive
windows sharing one token). Epoch ``e`` covers samples ``e * N .. (e + 1) * N - 1`` (``N``: all windows):
a keyed permutation shuffles the blocks, which are taken ``group`` at a time, and a second keyed
permutation shuffles the windows of each group. So a group's blocks are fetched once and then used
whole (bytes fetched ~ bytes trained on), while every batch still mixes ``group`` places of the corpus.
The order depends only on the seed and the corpus, never on who reads it: a resumed, re-planned or
replicated run reads the same sample ``i`` as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

ROUNDS = 4


def _round_keys(key: bytes) -> list[bytes]:
    return [hashlib.sha256(key + bytes([r])).digest()[:16] for r in range(ROUNDS)]


def permute(i: int, n: int, keys: list[bytes]) -> int:
    """Position of ``i`` in a keyed permutation of ``range(n)``: a balanced Feistel network on the
    smallest even-bit domain holding ``n``, cycle-walked back into range (a bijection of ``range(n)``)."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = i
    while True:
        left, right = x >> half, x & mask
        for k in keys:
            f = hashlib.blake2b(right.to_bytes(8, "little"), key=k, digest_size=8).digest()
            left, right = right, left ^ (int.from_bytes(f, "little") & mask)
        x = (left << half) | right
        if x < n:
            return x


class SampleOrder:
    """Sample ``i`` -> ``(block, window)``; see the module docstring."""

    def __init__(self, windows: Sequence[int], seed: int, group: int = 8) -> None:
        if group < 1:
            raise ValueError(f"group={group} must be >= 1")
        self.windows, self.seed, self.group = list(windows), seed, group
        self.per_epoch = sum(self.windows)
        if self.per_epoch == 0:
            raise ValueError("the corpus holds no training window of this length")
        self._blocks = [b for b, w in enumerate(self.windows) if w > 0]
        self._layouts: dict[int, tuple[list[tuple[list[int], list[int]]], list[int]]] = {}

    def _key(self, *parts: object) -> list[bytes]:
        return _round_keys("/".join(map(str, ("subspace-swarm/samples/v1", self.seed, *parts))).encode())

    def _layout(self, epoch: int) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
        """Epoch ``epoch``'s groups (their blocks and the running sum of their windows) and where each
        group starts in the epoch."""
        if epoch not in self._layouts:
            if len(self._layouts) >= 2:  # this epoch and the next (looked at ahead of time)
                del self._layouts[min(self._layouts)]
            n, keys = len(self._blocks), self._key(epoch, "blocks")
            shuffled = [self._blocks[permute(j, n, keys)] for j in range(n)]
            groups = []
            for g in range(0, n, self.group):
                blocks = shuffled[g : g + self.group]
                groups.append((blocks, [0, *accumulate(self.windows[b] for b in blocks)]))
            starts = [0, *accumulate(cum[-1] for _, cum in groups)]
            self._layouts[epoch] = (groups, starts)
        return self._layouts[epoch]

    def locate(self, i: int) -> tuple[int, int]:
        """The ``(block, window)`` of sample ``i`` of the run."""
        epoch, j = divmod(i, self.per_epoch)
        groups, starts = self._layout(epoch)
        g = bisect_right(starts, j) - 1
        blocks, cum = groups[g]
        p = permute(j - starts[g], cum[-1], self._key(epoch, "group", g))
        b = bisect_right(cum, p) - 1
        return blocks[b], p - cum[b]
