"""Checking that what the senders of boundary frames committed to is what the receivers got.

Every node sums the commitments of the frames its streams sent and received, per step, boundary and
direction (:class:`swarm.runtime.audit.CommitmentTally`), and reports the sums with its step. Sums
commute, so the hosts of a stage add up to the stage whichever microbatches each handled. A
crossing is compared once both sides counted exactly the step's microbatches. One that a failure
touched (a node died with frames in flight, microbatches redone within the step: more or fewer
frames on one side) is not compared but dropped once overdue (two steps after its step completed,
or its epoch ended) and counted as unchecked. A disagreement means a frame was altered between
its sender and its receiver, or a node reports other than what it sent or got: it is counted and
shown in ``swarm status`` (the evidence an audit or a verdict starts from).
"""

from __future__ import annotations

import collections
import logging

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.ops.metrics import Metrics
from swarm.runtime.audit import FrameTally

log = logging.getLogger("swarm.coordinator")

GRACE_STEPS = 2  # a crossing not full this many steps after its step completed is dropped, unchecked


class CommitmentChecks:
    """The reported commitment sums of steps not yet compared, and what the comparisons found."""

    def __init__(self, microbatches: int, metrics: Metrics, kept: int = 10):
        self.microbatches, self.metrics = microbatches, metrics
        # (plan epoch, step) -> (boundary, direction) -> both sides' sums so far, every node's added
        self.pending: dict[tuple[int, int], dict[tuple[int, str], FrameTally]] = {}
        self.checks = 0
        self.unchecked = 0  # crossings a failure touched (dropped without a comparison)
        self.mismatches: collections.deque[str] = collections.deque(maxlen=kept)  # the newest lines

    def add(self, report: coordinator_pb2.StepReport) -> None:
        """Add a node's tallies of one step."""
        crossings = self.pending.setdefault((report.plan_epoch, report.step), {})
        for t in report.tallies:
            c = crossings.setdefault((t.boundary, t.direction), FrameTally(t.boundary, t.direction))
            c.add(
                int.from_bytes(t.sent, "big"),
                int.from_bytes(t.received, "big"),
                t.sent_frames,
                t.received_frames,
            )

    def settle(self, epoch: int, completed: int) -> None:
        """Compare every full crossing; drop those overdue (of an earlier epoch than ``epoch``, or
        ``GRACE_STEPS`` steps before ``completed``, the last step of ``epoch`` every stage finished)."""
        for key in list(self.pending):
            crossings = self.pending[key]
            for where, c in list(crossings.items()):
                if c.sent_frames == c.received_frames == self.microbatches:
                    del crossings[where]
                    self._compare(key[1], c)
                elif key[0] < epoch or key[1] <= completed - GRACE_STEPS:
                    del crossings[where]
                    self.unchecked += 1
            if not crossings:
                del self.pending[key]

    def _compare(self, step: int, c: FrameTally) -> None:
        self.checks += 1
        self.metrics.commitment_checks.inc()
        if c.sent == c.received:
            return
        line = (
            f"step {step}, boundary {c.boundary} {c.direction}: the commitments of its "
            f"{c.sent_frames} frames differ between their senders and their receivers"
        )
        self.mismatches.append(line)
        self.metrics.commitment_mismatches.labels(direction=c.direction).inc()
        log.warning("frame commitments disagree: %s", line)
