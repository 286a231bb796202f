"""Churn on purpose: ``kill -9`` a random stage-hosting node every few seconds and measure recovery.

With ``scope="stage"`` each kill takes every host of a random middle stage together with every
standby (the nodes the coordinator picks first to keep snapshots): no copy of that stage is left,
the case ``checkpoint.lost_stage`` decides (roll every stage back, or rebuild the lost one).

Used by ``swarm up --chaos SECONDS`` and the churn benchmark. Each kill records the
wall time and the run's progress (the last step every stage had completed). Recovery is
read off the coordinator's step summaries, whose ``completed_at`` is the time of a
step's latest completion: the run rolls back to its latest checkpoint cut, so the steps
after that cut complete again, and

* **steps redone** = progress at the kill − (first redone step − 1): at most progress − the
  newest durable cut the coordinator had reported before the kill (``cut``), and
* **recovery time** = first completion, after the kill, of a step that had already been
  completed before it (or, when nothing had to be redone, of a step past the one that
  may still have been in flight) − the kill time.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass


@dataclass
class Kill:
    at: float  # unix time
    node: str
    progress: int  # last step completed by every stage when the node was killed (-1: none)
    cut: int  # the newest durable cut the coordinator had reported by then (-1: none)
    recovery_s: float | None = None
    steps_redone: int | None = None


class ChaosMonkey:
    """Decides when and whom to kill, and what each kill cost."""

    def __init__(self, every_s: float, seed: int = 0, scope: str = "node", events: int = 0):
        """Kill every ``every_s`` seconds, at most ``events`` times (0: no limit)."""
        if scope not in ("node", "stage"):
            raise ValueError(f"chaos scope {scope!r} must be 'node' or 'stage'")
        self.every_s, self.scope, self.events = every_s, scope, events
        self.picked = 0  # kill events so far
        self.rng = random.Random(seed)
        self.kills: list[Kill] = []
        self._next = time.time() + every_s

    def due(self) -> bool:
        return time.time() >= self._next and not (self.events and self.picked >= self.events)

    def pick(self, stages_of: dict[str, list[int]], n_stages: int) -> list[str]:
        """Whom to kill now, of the alive nodes and their stages (empty: standby). ``"node"``: one
        random stage host. ``"stage"``: every host of a random middle stage and every standby. Nobody
        while no such node is placed (then the kill stays due); else the next kill is scheduled."""
        if self.scope == "node":
            hosts = sorted(n for n, stages in stages_of.items() if stages)
            victims = [self.rng.choice(hosts)] if hosts else []
        else:
            middle = sorted({s for stages in stages_of.values() for s in stages if 0 < s < n_stages - 1})
            victims = []
            if middle:
                stage = self.rng.choice(middle)
                victims = sorted(n for n, stages in stages_of.items() if stage in stages or not stages)
        if victims:
            self._next = time.time() + self.every_s
            self.picked += 1
        return victims

    def killed(self, node: str, progress: int, cut: int) -> None:
        self.kills.append(Kill(time.time(), node, progress, cut))

    def observe(self, completed_at: dict[int, float]) -> None:
        """Update recovery from ``step -> completed_at`` (all steps, polled after each completion)."""
        for kill in self.kills:
            if kill.recovery_s is not None:
                continue
            after = {s: t for s, t in completed_at.items() if t > kill.at}
            redone = [s for s in after if s <= kill.progress]
            if redone:
                first = min(redone)
                kill.steps_redone = kill.progress - first + 1
                kill.recovery_s = after[first] - kill.at
            elif (fresh := [s for s in after if s > kill.progress + 1]) and min(fresh) == kill.progress + 2:
                kill.steps_redone = 0
                kill.recovery_s = min(after[s] for s in fresh) - kill.at

    def summary(self) -> dict:
        done = [k for k in self.kills if k.recovery_s is not None]
        return {
            "kills": len(self.kills),
            "recovered": len(done),
            "mean_recovery_s": sum(k.recovery_s for k in done) / len(done) if done else None,
            "max_recovery_s": max((k.recovery_s for k in done), default=None),
            "mean_steps_redone": sum(k.steps_redone for k in done) / len(done) if done else None,
        }
