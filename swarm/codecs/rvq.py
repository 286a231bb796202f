"""Residual vector quantisation with learned, delta-synchronised codebooks.

One owner learns the codebooks (:meth:`ResidualVQ.update`) and ships what changed to
followers (:meth:`ResidualVQ.delta_since` / :meth:`ResidualVQ.apply_delta`); a newcomer
starts from :meth:`ResidualVQ.snapshot`. Encoder and decoder must hold the same codebook
version: the payload itself does not name it.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from swarm.codecs.base import MAX_COLS, PayloadError, TensorFormat, check_finite, check_size
from swarm.codecs.floats import pack, unpack
from swarm.codecs.quant import divide_by_scale, fp16_scale

_DELTA_HEADER = struct.Struct("<QQI")  # from_version, to_version, number of rows
_SNAPSHOT_HEADER = struct.Struct("<QBHH")  # version, n_codebooks, codebook_size, dim


class ResidualVQ(TensorFormat):
    """Each row as an fp16 RMS scale plus one uint8 code per codebook: ``n_codebooks + 2`` bytes/row.

    Rows are divided by their RMS, then greedily quantised: each codebook picks the codeword
    nearest to what the previous ones left over. Far cheaper than any per-value format for
    wide rows, but lossy by however well the learned codebooks fit the data; the error
    shrinks with more codebooks (more bytes) and with training. Rows with RMS above 65504
    saturate the fp16 scale.

    Learning is online EMA k-means per level (``decay``, Laplace-smoothed counts). A codeword
    is only moved when rows were assigned to it, so untouched rows stay bit-identical and
    deltas stay small; a codeword whose usage falls below ``dead_share`` of the average is
    re-seeded from a residual row drawn with probability proportional to its squared error.
    All randomness comes from a generator seeded with ``seed``, so copies built with the
    same arguments start (and, fed the same batches, stay) identical. Followers that
    receive deltas must not call :meth:`update` themselves. Codebooks and learning state
    stay on the CPU (:meth:`update` learns there); encoding and decoding read the codebooks
    on the device they compute on.
    """

    name = "rvq"

    def __init__(
        self,
        dim: int,
        n_codebooks: int = 4,
        codebook_size: int = 256,
        seed: int = 0,
        decay: float = 0.99,
        dead_share: float = 0.01,
        init_std: float = 0.1,
    ) -> None:
        if not (1 <= dim <= MAX_COLS and 1 <= n_codebooks <= 255 and 1 <= codebook_size <= 256):
            raise ValueError(f"need 1 <= dim <= {MAX_COLS}, n_codebooks <= 255, codebook_size <= 256")
        self.dim, self.n_codebooks, self.codebook_size = dim, n_codebooks, codebook_size
        self.decay, self.dead_share = decay, dead_share
        self._gen = torch.Generator().manual_seed(seed)
        shape = (n_codebooks, codebook_size)
        self.codebooks = torch.randn(*shape, dim, generator=self._gen) * init_std
        self.version = 0
        self._changed_at = torch.zeros(shape, dtype=torch.int64)
        self._ema_count = torch.zeros(shape)
        self._ema_sum = torch.zeros(*shape, dim)
        self._entry = np.dtype([("level", "u1"), ("row", "<u2"), ("vec", "<f4", (dim,))])

    # -- wire format ------------------------------------------------------------------

    def encoded_size(self, rows: int, cols: int) -> int:
        return rows * (self.n_codebooks + 2)

    def _quantise(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's fp16 scale and its codes (``rows x n_codebooks``, uint8)."""
        scale, res = self._normalise(x)
        codes = torch.empty(x.shape[0], self.n_codebooks, dtype=torch.uint8, device=x.device)
        for level in range(self.n_codebooks):
            idx, _ = self._assign(res, level)
            codes[:, level] = idx
            res = res - self.codebooks[level].to(res.device)[idx]
        return scale, codes

    def _reconstruct(self, scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The rows that ``scale`` and ``codes`` (in range) stand for."""
        levels = torch.arange(self.n_codebooks, device=codes.device)
        out = self.codebooks.to(codes.device)[levels, codes.long()].sum(dim=1)
        return out * scale.float()[:, None]

    def _encode(self, x: torch.Tensor) -> bytes:
        scale, codes = self._quantise(x)
        return pack(scale, torch.float16) + pack(codes, torch.uint8)

    def _roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self._reconstruct(*self._quantise(x))

    def _decode(self, data: bytes, rows: int, cols: int, device: torch.device | str) -> torch.Tensor:
        if cols != self.dim:
            raise PayloadError(f"{self.name}: {cols} columns, codebooks have dimension {self.dim}")
        check_size(data, self.encoded_size(rows, cols), self.name)
        scale, offset = unpack(data, torch.float16, (rows,), device=device)
        codes, _ = unpack(data, torch.uint8, (rows, self.n_codebooks), offset, device)
        if bool((codes.long() >= self.codebook_size).any()):
            raise PayloadError(f"{self.name}: code >= codebook size {self.codebook_size}")
        return self._reconstruct(scale, codes)

    def _normalise(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored fp16 row scales and the rows divided by them (zero rows stay zero)."""
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise PayloadError(f"{self.name}: shape {tuple(x.shape)}, codebooks have dimension {self.dim}")
        x = x.float()
        scale = fp16_scale(x.pow(2).mean(dim=1).sqrt())
        return scale, divide_by_scale(x, scale)

    def _assign(self, res: torch.Tensor, level: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Index of the codeword nearest each residual row at ``level``, and its squared distance."""
        cb = self.codebooks[level].to(res.device)
        dist = res.pow(2).sum(1, keepdim=True) - 2 * res @ cb.T + cb.pow(2).sum(1)
        best, idx = dist.min(dim=1)
        return idx, best.clamp_min(0)

    # -- learning ---------------------------------------------------------------------

    def update(self, x: torch.Tensor, eps: float = 1e-5) -> None:
        """One EMA k-means step per level on the rows of ``x`` (``n x dim``); bumps ``version`` on change."""
        check_finite(x, f"{self.name} training batch")
        _, res = self._normalise(x.detach().to(self.codebooks.device))
        if res.shape[0] == 0:
            return
        changed_any = False
        for level in range(self.n_codebooks):
            idx, err = self._assign(res, level)
            counts = torch.bincount(idx, minlength=self.codebook_size).float()
            sums = torch.zeros_like(self._ema_sum[level]).index_add_(0, idx, res)
            count, total = self._ema_count[level], self._ema_sum[level]
            count.mul_(self.decay).add_(counts, alpha=1 - self.decay)
            total.mul_(self.decay).add_(sums, alpha=1 - self.decay)
            n = count.sum()
            smoothed = (count + eps) / (n + self.codebook_size * eps) * n
            new = self.codebooks[level].clone()
            used = counts > 0
            new[used] = total[used] / smoothed[used, None]
            dead = (count < self.dead_share * n / self.codebook_size) & ~used
            if dead.any() and err.sum() > 0:
                picks = torch.multinomial(err, int(dead.sum()), replacement=True, generator=self._gen)
                new[dead] = res[picks]
                count[dead] = n / self.codebook_size
                total[dead] = res[picks] * count[dead, None]
            changed = (new != self.codebooks[level]).any(dim=1)
            if changed.any():
                changed_any = True
                self._changed_at[level, changed] = self.version + 1
                self.codebooks[level] = new
            res = res - new[self._assign(res, level)[0]]
        self.version += int(changed_any)

    # -- synchronisation --------------------------------------------------------------

    def delta_since(self, version: int) -> bytes:
        """The codeword rows changed after ``version``: ``20 + n_rows * (3 + 4 dim)`` bytes.

        Works from any past version, so a follower that missed several deltas catches up in one.
        """
        if not 0 <= version <= self.version:
            raise PayloadError(f"cannot build a delta from version {version}: at {self.version}")
        level, row = (self._changed_at > version).nonzero(as_tuple=True)
        entries = np.empty(len(level), dtype=self._entry)
        entries["level"], entries["row"] = level.numpy(), row.numpy()
        entries["vec"] = self.codebooks[level, row].numpy()
        return _DELTA_HEADER.pack(version, self.version, len(level)) + entries.tobytes()

    def apply_delta(self, data: bytes) -> None:
        """Apply a :meth:`delta_since` delta; raises :class:`PayloadError` unless it starts at our version."""
        if len(data) < _DELTA_HEADER.size:
            raise PayloadError(f"codebook delta: {len(data)} bytes is shorter than the header")
        start, end, n_rows = _DELTA_HEADER.unpack_from(data)
        if start != self.version:
            raise PayloadError(f"stale codebook version: delta starts at {start}, copy is at {self.version}")
        if end < start or (end == start and n_rows):
            raise PayloadError(f"codebook delta: bad version range {start} -> {end} for {n_rows} rows")
        check_size(data, _DELTA_HEADER.size + n_rows * self._entry.itemsize, "codebook delta")
        entries = np.frombuffer(data, dtype=self._entry, offset=_DELTA_HEADER.size)
        level = torch.from_numpy(entries["level"].astype(np.int64))
        row = torch.from_numpy(entries["row"].astype(np.int64))
        vec = torch.from_numpy(entries["vec"].astype(np.float32))
        if bool((level >= self.n_codebooks).any() | (row >= self.codebook_size).any()):
            raise PayloadError("codebook delta: codebook or row index out of range")
        if len(torch.unique(level * self.codebook_size + row)) != n_rows:
            raise PayloadError("codebook delta: a row appears twice")
        check_finite(vec, "codebook delta")
        self.codebooks[level, row] = vec
        self._changed_at[level, row] = end
        self.version = end

    def learner_state(self) -> dict[str, torch.Tensor]:
        """The sender's learning state beyond the codebooks (EMA statistics, generator, change marks)."""
        return {
            "ema_count": self._ema_count.clone(),
            "ema_sum": self._ema_sum.clone(),
            "changed_at": self._changed_at.clone(),
            "generator": self._gen.get_state(),
        }

    def load_learner_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`learner_state` (after :meth:`load_snapshot`) so learning continues exactly."""
        for key, mine in (("ema_count", self._ema_count), ("ema_sum", self._ema_sum)):
            if state[key].shape != mine.shape:
                raise PayloadError(
                    f"learner state {key} shape {tuple(state[key].shape)} != {tuple(mine.shape)}"
                )
        self._ema_count, self._ema_sum = state["ema_count"].clone(), state["ema_sum"].clone()
        self._changed_at = state["changed_at"].clone()
        self._gen.set_state(state["generator"])

    def snapshot(self) -> bytes:
        """All codebooks and their version: ``13 + 4 n_codebooks codebook_size dim`` bytes."""
        header = _SNAPSHOT_HEADER.pack(self.version, self.n_codebooks, self.codebook_size, self.dim)
        return header + pack(self.codebooks, torch.float32)

    def load_snapshot(self, data: bytes) -> None:
        """Replace the codebooks with a :meth:`snapshot` from a copy built with the same shape."""
        if len(data) < _SNAPSHOT_HEADER.size:
            raise PayloadError(f"codebook snapshot: {len(data)} bytes is shorter than the header")
        version, *shape = _SNAPSHOT_HEADER.unpack_from(data)
        if tuple(shape) != (self.n_codebooks, self.codebook_size, self.dim):
            raise PayloadError(f"snapshot shape {tuple(shape)} does not match {tuple(self.codebooks.shape)}")
        check_size(data, _SNAPSHOT_HEADER.size + self.codebooks.numel() * 4, "codebook snapshot")
        codebooks, _ = unpack(data, torch.float32, tuple(shape), _SNAPSHOT_HEADER.size)
        check_finite(codebooks, "codebook snapshot")
        self.codebooks = codebooks
        self._changed_at.fill_(version)
        self.version = version
