"""The run's subspace rotations: statistics offered to the collector, rotations kept and streamed.

A statistic that completes a rotation step turns into the next rotation
(:class:`~swarm.coordinator.rotation.RotationCollector`); the rotation is written to the state file
and pushed to every ``WatchRotations`` stream. A stream ends with the coordinator or with its node.
Statistics still pending are kept too, so a restarted coordinator collects on where it stopped.

A rotation is an update like any other: a plan epoch that resumes from a cut discards the rotations
computed from the steps after it (:meth:`RotationHub.rewind`), and the rerun computes them anew (an
honest rerun the same ones; after an audit eviction, ones the evicted node's values never fed).
Each withdrawal starts a new *lineage*: every streamed rotation carries the one it belongs to, plans
name the current one, and a node uses only rotations of its plan's lineage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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

log = logging.getLogger("swarm.coordinator")


class RotationHub:
    """Rotations from ``initial_basis`` on, resumed from ``state``."""

    def __init__(
        self, config: RunConfig, initial_basis: torch.Tensor | None, state: CoordinatorState, metrics: Metrics
    ):
        self.config, self.initial_basis, self.state, self.metrics = config, initial_basis, state, metrics
        # each WatchRotations stream's queue, and the node it serves (its stream ends with the node)
        self.watchers: dict[asyncio.Queue[tuple[SubspaceRotation, int] | None], str] = {}
        self.closing = False
        self._resume()

    def _resume(self) -> None:
        """Collect on from the state's last rotation and pending statistics."""
        self.collector = RotationCollector(self.config, self.initial_basis, self.state.last_rotation())
        self.lineage = self.state.rotation_lineage()
        for stat in self.state.statistics():
            with contextlib.suppress(Rejected):
                self.offer(stat)
        self.metrics.subspace_version.set(self.version)

    def rewind(self, resume_step: int, epoch: int) -> None:
        """Plan ``epoch`` resumes at ``resume_step``: withdraw the rotations effective after it (and
        the statistics of the steps from it on); if any went, a new lineage starts and every stream
        ends (its node re-opens it into the new lineage)."""
        withdrawn = self.state.withdraw_rotations(resume_step, epoch)
        if not withdrawn:
            return
        self._resume()
        log.info(
            "withdrew %d rotation(s) effective after step %d: lineage %d, subspace version %d",
            withdrawn,
            resume_step,
            self.lineage,
            self.version,
        )
        for queue in self.watchers:
            queue.put_nowait(None)

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
            queue.put_nowait((rotation, self.lineage))

    def already_rotated(self, step: int, version: int) -> bool:
        """A statistic replayed after a rollback, for a rotation that is already published."""
        return any(
            r.effective_step == step + 1 and r.version == version + 1
            for r in self.state.rotations(after_version=version)
        )

    async def watch(
        self, node_id: str, after_version: int, lineage: int
    ) -> AsyncIterator[common_pb2.Rotation]:
        """The rotations after ``after_version`` (all of them when the node holds another
        ``lineage``'s), then each new one, for ``node_id``'s stream; each tagged with its lineage."""
        queue: asyncio.Queue[tuple[SubspaceRotation, int] | None] = asyncio.Queue()
        self.watchers[queue] = node_id
        try:
            sent = after_version if lineage == self.lineage else 0
            current = self.lineage
            for rotation in self.state.rotations(after_version=sent):
                yield _tagged(rotation, current)
                sent = rotation.version
            while not self.closing and (item := await queue.get()) is not None:
                rotation, current = item
                if rotation.version > sent:
                    yield _tagged(rotation, current)
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


def _tagged(rotation: SubspaceRotation, lineage: int) -> common_pb2.Rotation:
    message = rotation_to_proto(rotation)
    message.lineage = lineage
    return message
