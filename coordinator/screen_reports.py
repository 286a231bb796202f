"""Flags from the stages' activation screens (:mod:`swarm.runtime.screen`), attributed to senders.

A lie changes what every later stage computes, so when a stage's host starts lying the screens of
the stages below it may all flag the same step. The flags of a step are therefore attributed once
the step completes, to the hosts of the stage upstream of the *first* flagged boundary only (every
host of that stage: replicas are not told apart); the others are logged as explained by it. A flag
is evidence, counted in ``swarm status`` and ``swarm_screen_drifted_frames_total``; it evicts no one,
but in runs with audits it makes the flagged hosts suspects for :data:`SUSPECT_STEPS` steps, whom
their siblings then audit at ``audit.suspect_rate`` (the audits tell which replica lies).
"""

from __future__ import annotations

import logging

from swarm.coordinator.roster import Roster

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.ops.metrics import Metrics

log = logging.getLogger("swarm.coordinator")
SUSPECT_STEPS = 50  # how long after its last flagged step a host stays a suspect


class ScreenReports:
    """The flagged frames of steps not yet complete, and their attribution once they are."""

    def __init__(self, roster: Roster, metrics: Metrics):
        self.roster, self.metrics = roster, metrics
        # (plan epoch, step) -> receiving stage -> (flagged frames, why, reporting node)
        self.pending: dict[tuple[int, int], dict[int, tuple[int, str, str]]] = {}
        self.flagged_at: dict[str, int] = {}  # node id -> the last step flags were attributed to it

    def add(self, report: coordinator_pb2.StepReport) -> None:
        """A stage's report of ``report.drifted_frames`` flagged frames (replicas' reports add up)."""
        by_stage = self.pending.setdefault((report.plan_epoch, report.step), {})
        frames, _, _ = by_stage.get(report.stage, (0, "", ""))
        by_stage[report.stage] = (frames + report.drifted_frames, report.drift, report.node_id)

    def settle(self, epoch: int, completed: int) -> None:
        """Attribute the flags of every step of ``epoch`` up to ``completed`` (the last step every
        stage finished in it) and those of earlier epochs (their steps will not complete: as they are)."""
        for key in sorted(k for k in self.pending if k[0] < epoch or k[1] <= completed):
            step, by_stage = key[1], self.pending.pop(key)
            stage = min(by_stage)
            frames, drift, reporter = by_stage[stage]
            sender = stage - 1
            hosts = self.roster.owners()[sender] if 0 <= sender < self.roster.n_stages else ()
            for node_id in hosts:
                self.roster.drifted[node_id] += frames
                self.flagged_at[node_id] = max(step, self.flagged_at.get(node_id, -1))
            self.metrics.screen_drifted_frames.labels(stage=str(sender)).inc(frames)
            later = sorted(set(by_stage) - {stage})
            log.warning(
                "screen: step %d: node %s (stage %d) flagged %d activation frames from stage %d (%s)%s: %s",
                step,
                reporter[:8],
                stage,
                frames,
                sender,
                ", ".join(h[:8] for h in hosts) or "no host now",
                f"; stages {later} flagged after it (its lie reached them)" if later else "",
                drift[:200],
            )

    def suspects(self, step: int) -> list[str]:
        """The hosts flags were attributed to within :data:`SUSPECT_STEPS` steps before ``step``."""
        return sorted(n for n, at in self.flagged_at.items() if step - at <= SUSPECT_STEPS)
