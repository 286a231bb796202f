"""Who to evict when a node reports that a neighbour sent it an invalid frame.

Parties are personal join tokens (an evicted node that rejoins with its token is the same party),
or a node alone when it joined with the operator's shared token. The accused is evicted, unless the
record says otherwise: an accuser that already had *another* party evicted is the suspect (the
common factor) and is evicted instead. The same pair :data:`SAME_PAIR_ACCUSATIONS` times cannot be
told apart (a liar, or a repeat offender next to the same honest node): both are evicted.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from swarm.coordinator.state import NodeRecord

from swarm.ops.metrics import Metrics

log = logging.getLogger("swarm.coordinator")

# The same accuser and accused this often: both evicted (one of them lies or keeps offending).
SAME_PAIR_ACCUSATIONS = 3


class Judge:
    """Rules on accusations between nodes of the parties ``party_of`` names; ``evict`` takes a node
    out of the run."""

    def __init__(self, party_of: Callable[[str], str], evict: Callable[[NodeRecord], None], metrics: Metrics):
        self.party_of, self.evict, self.metrics = party_of, evict, metrics
        # accuser -> the parties its bad-input reports got evicted, and how often (by party)
        self.accusations: dict[str, collections.Counter[str]] = {}

    def accusation(self, accuser: NodeRecord, accused: NodeRecord, reason: str) -> None:
        """``accuser`` received an invalid frame from its neighbour ``accused``: evict one or both."""
        accuser_key, accused_key = self.party_of(accuser.id), self.party_of(accused.id)
        record = self.accusations.setdefault(accuser_key, collections.Counter())
        others = sorted(k[:8] for k in record if k != accused_key)
        if others:
            log.warning(
                "node %s evicted: it accused a second party (%s, after %s) of invalid frames",
                accuser.id[:8],
                accused.id[:8],
                ", ".join(others),
            )
            self.metrics.evictions.labels(reason="accuser").inc()
            self.evict(accuser)
            return
        record[accused_key] += 1
        log.warning(
            "node %s evicted: its neighbour %s received an invalid frame from it: %s",
            accused.id[:8],
            accuser.id[:8],
            reason[:200],
        )
        self.metrics.evictions.labels(reason="bad_input").inc()
        self.evict(accused)
        if record[accused_key] >= SAME_PAIR_ACCUSATIONS:
            log.warning(
                "node %s evicted too: the %d-th accusation of the same party",
                accuser.id[:8],
                record[accused_key],
            )
            self.metrics.evictions.labels(reason="accuser").inc()
            self.evict(accuser)
