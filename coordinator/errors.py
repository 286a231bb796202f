"""The coordinator's refusal of a call or a report, labelled for ``swarm_rejected_messages``."""

from __future__ import annotations


class Rejected(Exception):
    """A call or report the coordinator refuses; ``label`` is the ``swarm_rejected_messages`` reason."""

    def __init__(self, label: str, message: str):
        super().__init__(message)
        self.label = label
