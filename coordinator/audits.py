"""Auditors' reports of sampled recomputations between the replicas of a stage (:mod:`swarm.runtime.audit`).

In runs with audits (``RunConfig.audits``) each replica of a stage recomputes some of its siblings'
microbatches from the frames their neighbours kept and reports the outcome: ``match``, ``mismatch``
or ``unavailable`` (the evidence was gone or unreachable), counted in ``swarm status`` and
``swarm_audits_total``. A report is refused unless its auditor could have made it: a host of the
stage (the service checks) auditing another node that the current epoch dealt that microbatch of
that stage. One auditor's mismatches never evict (it may be the liar); once ``audit.confirmations``
distinct auditors (parties: nodes sharing a personal join token count once) found the same node
computing wrong, it is evicted through ``evict``, which rolls the run back past everything it
contributed to.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from swarm.coordinator.errors import Rejected
from swarm.coordinator.ledger import Ledger
from swarm.coordinator.roster import Roster
from swarm.coordinator.state import NodeRecord

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.core.config import RunConfig
from swarm.ops.metrics import Metrics

log = logging.getLogger("swarm.coordinator")

OUTCOMES = ("match", "mismatch", "unavailable")


class Audits:
    """The audit reports of a run of ``config``, checked against the ``ledger``'s deal and the
    ``roster``; ``evict(node, reason)`` takes a node found computing wrong out of the run."""

    def __init__(
        self,
        config: RunConfig,
        ledger: Ledger,
        roster: Roster,
        evict: Callable[[NodeRecord, str], None],
        metrics: Metrics,
        kept: int = 8,
    ):
        self.config, self.ledger, self.roster, self.metrics = config, ledger, roster, metrics
        self.evict = evict
        self.counts: collections.Counter[str] = collections.Counter()  # outcome -> reports
        # accused node id -> the parties of the auditors that found it computing wrong
        self.accusers: dict[str, set[str]] = {}
        self.lines: collections.deque[str] = collections.deque(maxlen=kept)  # newest mismatches, evictions

    def add(self, report: coordinator_pb2.AuditReport) -> None:
        """Count ``report`` (from an authenticated host of ``report.stage`` in the current epoch);
        evict its accused on the last confirmation needed. :class:`Rejected` if it could not be."""
        self._check(report)
        self.counts[report.outcome] += 1
        self.metrics.audits.labels(outcome=report.outcome).inc()
        if report.outcome == "mismatch":
            self._mismatch(report)

    def _check(self, r: coordinator_pb2.AuditReport) -> None:
        if not self.config.audits:
            raise Rejected("bad_audit", "this run has no audits (see audit.rate, replica_sync.mode)")
        if r.outcome not in OUTCOMES:
            raise Rejected("malformed", f"audit outcome {r.outcome[:20]!r} is not one of {OUTCOMES}")
        if r.audited_node_id == r.node_id:
            raise Rejected("bad_audit", f"node {r.node_id[:8]} reports an audit of itself")
        dealt = self.ledger.dealt[r.stage] if r.stage < len(self.ledger.dealt) else {}
        if dealt.get(r.microbatch) != r.audited_node_id:
            raise Rejected(
                "bad_audit",
                f"node {r.audited_node_id[:8]!r} did not compute microbatch {r.microbatch} of stage "
                f"{r.stage} in plan epoch {r.plan_epoch}: it cannot be audited for it",
            )

    def _mismatch(self, r: coordinator_pb2.AuditReport) -> None:
        parties = self.accusers.setdefault(r.audited_node_id, set())
        parties.add(self.roster.party_of(r.node_id))
        needed = self.config.audit.confirmations
        self._show(
            f"step {r.step}, stage {r.stage}, microbatch {r.microbatch}: node {r.node_id[:8]} found "
            f"node {r.audited_node_id[:8]} computing wrong ({r.direction or '?'}: rel_l2 {r.rel_l2:.3g}, "
            f"cosine {r.cosine:.4f}); {len(parties)} of {needed} auditors"
        )
        accused = self.roster.alive_node(r.audited_node_id)
        if len(parties) < needed or accused is None:  # not confirmed yet, or gone (evicted once)
            return
        reason = f"{len(parties)} distinct auditors found it computing wrong"
        self._show(f"node {accused.id[:8]} ({accused.name or 'no name'}) evicted: {reason}")
        self.metrics.evictions.labels(reason="audit").inc()
        self.evict(accused, reason)

    def _show(self, line: str) -> None:
        self.lines.append(line)
        log.warning("audit: %s", line)
