"""Auditors' reports of sampled recomputations between the replicas of a stage (:mod:`swarm.runtime.audit`).

In runs with audits (``RunConfig.audits``) each replica of a stage recomputes some of its siblings'
microbatches from the frames their neighbours kept and reports the outcome: ``match``, ``mismatch``
or ``unavailable`` (the evidence was gone or unreachable), counted in ``swarm status`` and
``swarm_audits_total``. A report is refused unless its auditor could have made it: an alive host
of the stage in the report's epoch auditing another node that epoch dealt that microbatch of that
stage; the epoch may have ended since (an audit runs off the critical path, after its step) if it is
one of the last :data:`~swarm.coordinator.ledger.PAST_DEALS`. One auditor's mismatches never evict
(it may be the liar); once ``audit.confirmations`` distinct auditors (parties: nodes sharing a
personal join token count once) found the same node computing wrong, it is evicted through
``evict``, which rolls the run back past everything it contributed to.

An auditor that lies is caught by the others' audits of the node it accuses: an accused node is a
suspect (its siblings audit it at ``audit.suspect_rate``), and an accuser whose reports of it are
mostly mismatches (at least :data:`LIAR_MISMATCHES`, half of its audits of it or more) while another
party audited the same node :data:`CONTRADICTING_MATCHES` times without a single mismatch is evicted
itself (no rollback: its reports changed no weights). If the accused lied on half its microbatches
or more, an honest second auditor would see no lie in that many audits with chance 2^-20 or less.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from swarm.coordinator.errors import Rejected
from swarm.coordinator.ledger import PAST_DEALS, Ledger
from swarm.coordinator.roster import Roster
from swarm.coordinator.state import NodeRecord

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.core.config import RunConfig
from swarm.ops.metrics import Metrics

log = logging.getLogger("swarm.coordinator")
LIAR_MISMATCHES = 3  # an accuser's mismatches of one node before its accusations can be contradicted
CONTRADICTING_MATCHES = 20  # another party's clean audits of that node that contradict them

OUTCOMES = ("match", "mismatch", "unavailable")


class Audits:
    """The audit reports of a run of ``config``, checked against the ``ledger``'s deal and the
    ``roster``; ``evict(node, reason)`` takes a node found computing wrong out of the run."""

    def __init__(
        self,
        config: RunConfig,
        ledger: Ledger,
        roster: Roster,
        evict: Callable[[NodeRecord, str, bool], None],
        metrics: Metrics,
        kept: int = 8,
    ):
        self.config, self.ledger, self.roster, self.metrics = config, ledger, roster, metrics
        self.evict = evict
        self.counts: collections.Counter[str] = collections.Counter()  # outcome -> reports
        # accused node id -> the parties of the auditors that found it computing wrong
        self.accusers: dict[str, set[str]] = {}
        # (auditor, audited) -> outcome -> reports
        self.tallies: dict[tuple[str, str], collections.Counter[str]] = {}
        self.lines: collections.deque[str] = collections.deque(maxlen=kept)  # newest mismatches, evictions

    def add(self, report: coordinator_pb2.AuditReport) -> None:
        """Count ``report`` (from an authenticated node); evict its accused on the last confirmation
        needed. :class:`Rejected` if it could not have been made."""
        self._check(report)
        self.counts[report.outcome] += 1
        self.metrics.audits.labels(outcome=report.outcome).inc()
        self.tallies.setdefault((report.node_id, report.audited_node_id), collections.Counter())[
            report.outcome
        ] += 1
        if report.outcome == "mismatch":
            self._mismatch(report)
        self._contradicted(report.audited_node_id)

    def suspects(self) -> list[str]:
        """The alive nodes some auditor found computing wrong (their siblings audit them more)."""
        return sorted(n for n in self.accusers if self.roster.alive_node(n) is not None)

    def _contradicted(self, accused: str) -> None:
        """Evict the accusers of ``accused`` whose mismatches another party's clean audits contradict."""
        clean = {
            self.roster.party_of(auditor)
            for (auditor, audited), t in self.tallies.items()
            if audited == accused and t["match"] >= CONTRADICTING_MATCHES and not t["mismatch"]
        }
        for (auditor, audited), t in list(self.tallies.items()):
            node = self.roster.alive_node(auditor)
            mostly_wrong = t["mismatch"] >= max(LIAR_MISMATCHES, t["match"])
            if audited != accused or node is None or not mostly_wrong:
                continue
            if clean - {self.roster.party_of(auditor)}:
                reason = (
                    f"its {t['mismatch']} mismatches of node {accused[:8]} are contradicted by another "
                    f"auditor's {CONTRADICTING_MATCHES}+ clean audits of it"
                )
                self._show(f"node {auditor[:8]} ({node.name or 'no name'}) evicted: {reason}")
                self.metrics.evictions.labels(reason="audit_accuser").inc()
                self.accusers.get(accused, set()).discard(self.roster.party_of(auditor))
                self.evict(node, reason, False)

    def _check(self, r: coordinator_pb2.AuditReport) -> None:
        if not self.config.audits:
            raise Rejected("bad_audit", "this run has no audits (see audit.rate, replica_sync.mode)")
        if r.outcome not in OUTCOMES:
            raise Rejected("malformed", f"audit outcome {r.outcome[:20]!r} is not one of {OUTCOMES}")
        if r.audited_node_id == r.node_id:
            raise Rejected("bad_audit", f"node {r.node_id[:8]} reports an audit of itself")
        if self.roster.alive_node(r.node_id) is None:
            raise Rejected("unknown_node", f"node {r.node_id[:8]!r} is not in the run")
        deal = self.ledger.deal_of(r.plan_epoch)
        if deal is None:
            raise Rejected(
                "stale_epoch",
                f"plan epoch {r.plan_epoch} is neither the current one ({self.ledger.plan_epoch}) nor one "
                f"of the {PAST_DEALS} before it",
            )
        owners, dealt_in = deal
        if r.stage >= len(owners) or r.node_id not in owners[r.stage]:
            raise Rejected(
                "not_hosting", f"node {r.node_id[:8]} did not host stage {r.stage} in epoch {r.plan_epoch}"
            )
        if dealt_in[r.stage].get(r.microbatch) != r.audited_node_id:
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
        self.evict(accused, reason, True)

    def _show(self, line: str) -> None:
        self.lines.append(line)
        log.warning("audit: %s", line)
