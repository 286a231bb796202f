"""The run's subspace rotations: statistics offered to the collector, rotations kept and streamed.

A statistic that completes a rotation step turns into the next rotation
(:class:`~swarm.coordinator.rotation.RotationCollector`); the rotation is written to the state file
and pushed to every ``WatchRotations`` stream. A stream ends with the coordinator or with its node.
Statistics still pending are kept too, so a restarted coordinator collects on where it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import torch
from swarm.coordinator.errors import Rejected
from swarm.coordinator.rotation import RotationCollector
from swarm.coordinator.state import CoordinatorState, SavedStatistic

from swarm._proto.swarm.v1 import common_pb2
from swarm.core.config import RunConfig
from swarm.core.subspace import SubspaceRotation
from swarm.net.frames import rotation_to_proto
from swarm.ops.metrics import Metrics


class RotationHub:
    """Rotations from ``initial_basis`` on, resumed from ``state``."""

    def __init__(
        self, config: RunConfig, initial_basis: torch.Tensor | None, state: CoordinatorState, metrics: Metrics
    ):
        self.state, self.metrics = state, metrics
        self.collector = RotationCollector(config, initial_basis, state.last_rotation())
        # each WatchRotations stream's queue, and the node it serves (its stream ends with the node)
        self.watchers: dict[asyncio.Queue[SubspaceRotation | None], str] = {}
        self.closing = False
        for stat in state.statistics():
            with contextlib.suppress(Rejected):
                self.offer(stat)
        metrics.subspace_version.set(self.version)

    @property
    def version(self) -> int:
        """The current subspace version."""
        return self.collector.version

    def offer(self, stat: SavedStatistic) -> None:
        """Feed a statistic to the collector; persist it, or the rotation it completes, and publish.

        Raises :class:`Rejected` for a statistic the collector cannot use.
        """
        rotation = self.collector.offer(stat.step, stat.boundary, stat.version, stat.data)
        if rotation is None:
            self.state.add_statistic(stat)
            return
        self.state.add_rotation(rotation)
        self.metrics.subspace_version.set(rotation.version)
        for queue in self.watchers:
            queue.put_nowait(rotation)

    def already_rotated(self, step: int, version: int) -> bool:
        """A statistic replayed after a rollback, for a rotation that is already published."""
        return any(
            r.effective_step == step + 1 and r.version == version + 1
            for r in self.state.rotations(after_version=version)
        )

    async def watch(self, node_id: str, after_version: int) -> AsyncIterator[common_pb2.Rotation]:
        """The rotations after ``after_version``, then each new one, for ``node_id``'s stream."""
        queue: asyncio.Queue[SubspaceRotation | None] = asyncio.Queue()
        self.watchers[queue] = node_id
        try:
            sent = after_version
            for rotation in self.state.rotations(after_version=sent):
                yield rotation_to_proto(rotation)
                sent = rotation.version
            while not self.closing and (rotation := await queue.get()) is not None:
                if rotation.version > sent:
                    yield rotation_to_proto(rotation)
                    sent = rotation.version
        finally:
            self.watchers.pop(queue, None)

    def end_stream_of(self, node_id: str) -> None:
        """Finish ``node_id``'s streams (it is out of the run)."""
        for queue, watcher in self.watchers.items():
            if watcher == node_id:
                queue.put_nowait(None)

    def end_streams(self) -> None:
        """Finish every stream (the coordinator stops)."""
        self.closing = True
        for queue in self.watchers:
            queue.put_nowait(None)
