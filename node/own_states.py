"""What this node's stages held after their latest steps, kept in host memory.

An epoch that resumes right after one of those steps (a sibling replica died and the others go
on; a replica joins at a fresh cut) restores a stage from it instead of a snapshot fetched from
the coordinator, and nothing rolls back further than that step. Each stage keeps its newest
``keep`` steps; an epoch forgets the steps at or after its resume step (a history it abandons)
before it builds. Kept only for runs with replicas (``train.replicas > 1``), where it can serve:
a lone host's death takes its stage's state with it.
"""

from __future__ import annotations

from typing import Any

from swarm.io import checkpoint

KEEP_STEPS = 3  # a stage finishes at most a step or two past the run's last completed one


class OwnStates:
    """Captures (:func:`swarm.io.checkpoint.capture`) of the stages this node hosts, by stage and step."""

    def __init__(self, keep: int = KEEP_STEPS):
        self.keep = keep
        self._states: dict[int, dict[int, dict[str, Any]]] = {}

    def put(self, state: dict[str, Any]) -> None:
        """Keep a capture (it names its stage and step); the stage's oldest goes beyond ``keep``."""
        steps = self._states.setdefault(int(state["stage"]), {})
        steps[int(state["step"])] = state
        for old in sorted(steps)[: -self.keep]:
            del steps[old]

    def take(self, stage: int, step: int, device: Any) -> dict[str, Any] | None:
        """A copy on ``device`` of ``stage``'s state after ``step`` (None if not kept): training it on
        leaves the kept one as it was."""
        state = self._states.get(stage, {}).get(step)
        return None if state is None else checkpoint.copied(state, device)

    def forget_from(self, step: int) -> None:
        """Drop every state of ``step`` or later (steps an epoch that resumes at ``step`` redoes)."""
        for steps in self._states.values():
            for s in [s for s in steps if s >= step]:
                del steps[s]
