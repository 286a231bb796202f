"""Stage snapshots: everything one stage needs to resume training exactly after a step.

A snapshot holds the stage's parameters and buffers (the subspace basis among them),
its optimizer state (AdamW moments, Stiefel momentum), the subspace version, the
boundary statistic accumulated toward the next rotation, RVQ codebooks, the outer-step
momentum and error-feedback residual of replicas taking outer steps, the step, and on
stage 0 the data position. Restored into a freshly built :class:`StageWorker`, the
next step computes what it would have computed without the interruption, bit for bit on
the same machine. The frozen token embedding is not in it (every stage regenerates or
fetches it once).

:func:`capture` only copies tensors to host memory (pinned on CUDA; the one part that pauses
training, between two steps); :func:`to_bytes` does the serialisation and runs off the hot
path. :class:`SnapshotStore` keeps a node's
snapshots on disk: atomic writes (temp file, fsync, rename), named by their sha256 and
verified on every read.
"""

from __future__ import annotations

import copy
import io
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarm.codecs.base import PayloadError
from swarm.codecs.rvq import ResidualVQ
from swarm.core.config import config_hash, stage_layer_ranges
from swarm.core.subspace import resize_rank
from swarm.io.artifacts import digest
from swarm.io.compact import compact_moments, expand_moments
from swarm.io.data import BatchSampler
from swarm.io.prepared import CorpusSampler
from swarm.runtime.outer_step import OuterStep
from swarm.runtime.worker import StageWorker

Sampler = BatchSampler | CorpusSampler  # the first stage's batches: a raw corpus's or a prepared one's

SNAPSHOT_FORMAT = 1
_NAME = re.compile(r"^stage(\d+)-step(\d+)-([0-9a-f]{64})\.snap$")
_DIGEST = re.compile(r"[0-9a-f]{64}")


def copied(obj: Any, device: torch.device | str = "cpu") -> Any:
    """A copy of ``obj`` (a capture, or any part of one) with every tensor copied to ``device``
    (host memory by default: a GPU holds no extra snapshot).

    A CUDA tensor bound for the host goes into pinned memory without blocking: call
    :func:`settled` before reading the copy (:func:`capture` does).
    """
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda and torch.device(device).type == "cpu":
            host = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
            return host.copy_(obj.detach(), non_blocking=True)
        return obj.detach().to(device, copy=True)
    if isinstance(obj, dict):
        return {k: copied(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copied(v, device) for v in obj)
    return copy.copy(obj)


def settled(device: torch.device) -> None:
    """Wait for the copies :func:`copied` started from ``device`` (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _codebook_formats(worker: StageWorker) -> dict[str, ResidualVQ]:
    return {side: fmt for side in ("in", "out") if (fmt := worker.codebooks(side)) is not None}


def capture(worker: StageWorker, step: int, sampler: Sampler | None = None) -> dict[str, Any]:
    """The state of ``worker`` after optimizer step ``step`` (tensors copied to host memory)."""
    stat = worker.statistic
    state = {
        "format": SNAPSHOT_FORMAT,
        "config_hash": config_hash(worker.config),
        "stage": worker.index,
        "step": step,
        "version": worker.version,
        "model": copied(worker.stage.state_dict()),
        "mapl": {side: copied(b.state_dict()) for side, b in worker.mapl.items()},
        "optimizers": [copied(opt.state_dict()) for opt in worker.optimizer.optimizers],
        "statistic": None
        if stat is None
        else {
            "gram_times_basis": copied(stat.gram_times_basis),
            "off_energy": stat.off_energy,
            "total_energy": stat.total_energy,
            "count": stat.count,
        },
        "codebooks": {side: fmt.snapshot() for side, fmt in _codebook_formats(worker).items()},
        # The sender learns its codebooks: its EMA statistics and generator continue the learning.
        "codebook_learner": {
            side: fmt.learner_state() for side, fmt in _codebook_formats(worker).items() if side == "out"
        },
        "sampler": None if sampler is None else sampler.state_dict(),
        "outer": None if worker.outer is None else worker.outer.state_dict(),
    }
    settled(worker.device)
    return state


def to_bytes(state: dict[str, Any], moments: str = "exact") -> bytes:
    """Serialise a capture; ``moments="int8"`` packs Adam's moments in 8 bits (:mod:`swarm.io.compact`)."""
    buffer = io.BytesIO()
    torch.save(compact_moments(state) if moments == "int8" else state, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Parse a snapshot (restricted unpickler: tensors and plain values only)."""
    try:
        state = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    except Exception as e:  # a corrupt or hostile file: any unpickling error
        raise PayloadError(f"unreadable stage snapshot: {e}") from None
    if not isinstance(state, dict) or state.get("format") != SNAPSHOT_FORMAT:
        raise PayloadError("not a stage snapshot of a known format")
    try:
        return expand_moments(state)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise PayloadError(f"malformed 8-bit moments in a stage snapshot: {e}") from None


def restore(worker: StageWorker, state: dict[str, Any], sampler: Sampler | None = None) -> int:
    """Load a :func:`capture` of the same stage and run into a freshly built worker; returns its step."""
    if state["config_hash"] != config_hash(worker.config) or state["stage"] != worker.index:
        raise PayloadError(
            f"snapshot of stage {state['stage']} (config {state['config_hash'][:12]}) "
            f"cannot restore stage {worker.index}"
        )
    _match_rank(worker, state["model"])
    worker.stage.load_state_dict(state["model"])
    for side, boundary in worker.mapl.items():
        moment = state["mapl"][side].get("input_moment")
        if moment is not None:  # d x d during the PCA warm-up, empty after it
            boundary.resize_input_moment(moment.shape)
        boundary.load_state_dict(state["mapl"][side])
    for opt, opt_state in zip(worker.optimizer.optimizers, state["optimizers"], strict=True):
        opt.load_state_dict(opt_state)
    worker.version, worker.pending_rotation = state["version"], None
    if worker.statistic is not None:
        stat, saved = worker.statistic, state["statistic"]
        stat.gram_times_basis.copy_(saved["gram_times_basis"])
        stat.off_energy, stat.total_energy, stat.count = (
            saved["off_energy"],
            saved["total_energy"],
            saved["count"],
        )
    for side, fmt in _codebook_formats(worker).items():
        fmt.load_snapshot(state["codebooks"][side])
        if side in state["codebook_learner"]:
            fmt.load_learner_state(state["codebook_learner"][side])
    if sampler is not None:
        sampler.load_state_dict(state["sampler"])
    worker.outer = None
    if state.get("outer") is not None:  # every replica of the stage resumes from the same outer state
        worker.outer = OuterStep(worker.parameters(), worker.config.replica_sync)
        worker.outer.load_state_dict(state["outer"])
    return int(state["step"])


def _match_rank(worker: StageWorker, model: dict[str, torch.Tensor]) -> None:
    """Grow ``worker``'s basis to the rank of the saved ``model``'s (it grew before the snapshot)."""
    saved_basis = model.get("basis")
    if saved_basis is not None and saved_basis.shape != worker.stage.basis.shape:
        resize_rank(worker.stage, saved_basis.shape[1])
        if worker.statistic is not None:
            worker.statistic.reset()


def rebuild(worker: StageWorker, neighbours: list[dict[str, Any]]) -> int:
    """Rebuild a lost middle stage from its two neighbours' captures of the same step (CheckFree,
    arXiv 2506.15461) into a freshly built ``worker``; returns the step.

    Each layer becomes the mean of the neighbours' layers at the same position within their stages
    (a neighbour with fewer layers contributes where it has one; a position neither has keeps its
    initial weights); the basis and the subspace version come from the neighbours; the optimizer,
    the boundary statistic and any outer-step state start fresh. Not exact: the run goes on from an
    approximation of the lost stage instead of rolling every stage back.
    """
    config, index = worker.config, worker.index
    if sorted(int(n["stage"]) for n in neighbours) != [index - 1, index + 1]:
        raise PayloadError(f"stage {index} is rebuilt from stages {index - 1} and {index + 1}")
    if any(n["config_hash"] != config_hash(config) for n in neighbours):
        raise PayloadError("a neighbour's snapshot belongs to another run configuration")
    if len({int(n["step"]) for n in neighbours}) != 1 or len({n["version"] for n in neighbours}) != 1:
        raise PayloadError("the neighbours' snapshots are of different steps or subspace versions")
    ranges = stage_layer_ranges(config.model.n_layers, config.n_stages)
    _match_rank(worker, neighbours[0]["model"])
    rebuilt = {}
    for key, value in worker.stage.state_dict().items():
        kind, _, rest = key.partition(".")
        if kind != "layers":
            if key in neighbours[0]["model"]:  # the shared basis
                rebuilt[key] = neighbours[0]["model"][key]
            continue
        layer, _, name = rest.partition(".")
        position = int(layer) - worker.stage.start
        sources = []
        for n in neighbours:
            start, end = ranges[int(n["stage"])]
            if start + position < end:
                sources.append(n["model"][f"layers.{start + position}.{name}"].to(value.device, value.dtype))
        if sources:
            rebuilt[key] = torch.stack(sources).mean(0)
    worker.stage.load_state_dict(rebuilt, strict=False)
    worker.version, worker.pending_rotation = neighbours[0]["version"], None
    if worker.statistic is not None:
        worker.statistic.reset()
    worker.outer = None
    return int(neighbours[0]["step"])


@dataclass(frozen=True)
class SnapshotFile:
    stage: int
    step: int
    digest: str
    path: Path


class SnapshotStore:
    """A node's snapshots under ``root``: ``stage{S}-step{N}-{sha256}.snap``, the last ``keep`` per stage."""

    def __init__(self, root: str | Path, keep: int = 3):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def write(self, stage: int, step: int, data: bytes, key: str | None = None) -> SnapshotFile:
        """Write atomically (temp file, fsync, rename, fsync the folder); prune older snapshots.
        ``key``: the sha256 of ``data`` when the caller computed it already."""
        key = key or digest(data)
        path = self.root / f"stage{stage}-step{step:010d}-{key}.snap"
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        for old in self.snapshots(stage)[: -self.keep]:
            old.path.unlink(missing_ok=True)
        return SnapshotFile(stage, step, key, path)

    def snapshots(self, stage: int) -> list[SnapshotFile]:
        """This stage's snapshot files, oldest step first (not verified)."""
        found = []
        for path in self.root.glob(f"stage{stage}-step*.snap"):
            m = _NAME.match(path.name)
            if m:
                found.append(SnapshotFile(int(m[1]), int(m[2]), m[3], path))
        return sorted(found, key=lambda f: f.step)

    def find(self, key: str) -> SnapshotFile | None:
        """The snapshot file whose sha256 is ``key`` (not verified), if this store holds one."""
        if not _DIGEST.fullmatch(key):
            return None
        for path in self.root.glob(f"stage*-step*-{key}.snap"):
            if m := _NAME.match(path.name):
                return SnapshotFile(int(m[1]), int(m[2]), m[3], path)
        return None

    def read(self, stage: int, step: int, key: str) -> bytes | None:
        """The verified bytes of that snapshot, or None if absent or corrupt (a corrupt file is removed)."""
        path = self.root / f"stage{stage}-step{step:010d}-{key}.snap"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if digest(data) != key:
            path.unlink(missing_ok=True)
            return None
        return data
