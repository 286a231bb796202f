"""The run's history: plan epochs, the checkpoint cuts they resume from, the microbatches each deals.

A new epoch resumes from the latest complete cut whose snapshots all verify (on the coordinator's
disk) or have an alive holder (:class:`~swarm.coordinator.keepers.Keepers`); snapshot records
past that cut are dropped (those steps will be redone), so every cut the ledger holds comes from
one history. With ``checkpoint.lost_stage = "rebuild"`` a cut that lost only middle stages, none
next to another, still counts: those stages are rebuilt from their neighbours' snapshots (CheckFree)
instead of every stage rolling back. Only the newest ``checkpoint.keep`` complete cuts are kept (and
the current epoch's, which a late joiner restores from). An epoch after a node was evicted for
computing wrong resumes from the newest cut before it first hosted a stage. Epochs, resume steps
and snapshot records are written through to the state file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Sequence

from swarm.coordinator.assignment import Owners
from swarm.coordinator.bulletin import Bulletin
from swarm.coordinator.keepers import Keepers
from swarm.coordinator.state import CheckpointRecord, CoordinatorState, RunRecord
from swarm.coordinator.store import ArtifactStore

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.core.config import RunConfig
from swarm.ops.metrics import Metrics
from swarm.runtime.replicas import deal

log = logging.getLogger("swarm.coordinator")
PAST_DEALS = 4  # ended epochs whose deals are kept (their late audit reports still count)


class Ledger:
    """The plan epoch of ``run`` and its snapshot records (their bytes in ``store`` or with ``keepers``)."""

    def __init__(
        self,
        config: RunConfig,
        run: RunRecord,
        state: CoordinatorState,
        store: ArtifactStore,
        keepers: Keepers,
        metrics: Metrics,
    ):
        self.config, self.state, self.store, self.metrics = config, state, store, metrics
        self.keepers = keepers
        self.run_id, self.plan_epoch = run.id, run.plan_epoch
        self.link_key = run.auth_token.encode()  # the run's secret: boundary link secrets derive from it
        self.resume_step, self.restarts = run.resume_step, run.restarts
        self.checkpoints = {(r.step, r.stage): r for r in state.checkpoints()}
        self.dealt: list[dict[int, str]] = []  # per stage: microbatch -> the replica processing it
        self.owners: Owners = []  # per stage: its hosts this epoch
        # the last PAST_DEALS epochs before this one: epoch -> (owners, dealt) (reports made in an
        # epoch may arrive after it ended: audits run off the critical path)
        self.past_deals: dict[int, tuple[Owners, list[dict[int, str]]]] = {}
        self.cut_requests = 0  # cuts asked for (leaving nodes, replicas joining): see request_cut
        self.news = Bulletin()  # held heartbeats wait on it: epochs, cut requests, the run's end
        self.from_own_states = False  # whether this epoch resumed from its hosts' own states
        self._cut_shown = -1  # the complete cut the checkpoint metrics describe
        # The cut this epoch resumed from with stages rebuilt from their neighbours, and those stages
        # (their snapshots were lost); kept until a newer cut, for a later epoch resuming from it too.
        self.rebuild_cut, self.rebuilt = -1, frozenset[int]()

    def deal(self, owners: Owners, rates: Sequence[Sequence[float]]) -> None:
        """Deal each stage's microbatches among its hosts by their rates, for the epoch about to start
        (the current epoch's deal is kept among the past ones)."""
        if self.dealt:
            self.past_deals[self.plan_epoch] = (self.owners, self.dealt)
            for old in sorted(self.past_deals)[:-PAST_DEALS]:
                del self.past_deals[old]
        self.owners, self.dealt = [tuple(hosts) for hosts in owners], []
        for hosts, stage_rates in zip(owners, rates, strict=True):
            shares = deal(self.config.train.microbatches, list(stage_rates)) if hosts else []
            self.dealt.append({mb: node for node, mbs in zip(hosts, shares, strict=True) for mb in mbs})

    def deal_of(self, epoch: int) -> tuple[Owners, list[dict[int, str]]] | None:
        """Every stage's hosts and the microbatches dealt to them in plan ``epoch``: this one or one
        of the :data:`PAST_DEALS` before it that this coordinator planned (else None)."""
        return (self.owners, self.dealt) if epoch == self.plan_epoch else self.past_deals.get(epoch)

    def microbatches(self, stage: int, node_id: str) -> list[int]:
        """The microbatches of ``stage`` dealt to ``node_id`` this epoch, ascending."""
        return sorted(mb for mb, owner in self.dealt[stage].items() if owner == node_id)

    def start_epoch(
        self,
        reason: str,
        progressed: bool,
        after_own_step: int | None = None,
        planned: bool = False,
        before_step: int | None = None,
    ) -> None:
        """A new plan epoch, resuming from the latest verified cut; later snapshot records are dropped.

        ``progressed``: whether any step completed (then the epoch counts as a restart, unless
        ``planned``: replicas joining at a cut just taken for them). ``after_own_step``: resume right
        after that step instead, every host from the state it kept of it (a replica died, its
        siblings go on): nothing rolls back, and it is no restart. ``before_step``: resume from the
        latest verified cut before that step (step 0 when none is kept): every later state may
        hold what a node evicted for computing wrong contributed from that step on.
        """
        cut = self._latest_verified_cut(before_step) if after_own_step is None else after_own_step
        self._forget([r for r in self.checkpoints.values() if r.step > cut])
        if self.rebuild_cut > cut:  # a rebuild that is undone with the steps after the cut
            self.rebuild_cut, self.rebuilt = -1, frozenset()
        restarted = (progressed or self.resume_step > 0) and after_own_step is None and not planned
        self.plan_epoch, self.resume_step = self.plan_epoch + 1, cut + 1
        self.from_own_states = after_own_step is not None
        self.restarts += int(restarted)
        self.state.set_epoch(self.plan_epoch, self.resume_step, self.restarts)
        self.metrics.plan_epoch.set(self.plan_epoch)
        source = " from the hosts' own states" if after_own_step is not None else ""
        if before_step is not None and after_own_step is None:
            source = f" (the newest cut before step {before_step})"
        log.info("plan epoch %d (%s): resume at step %d%s", self.plan_epoch, reason, self.resume_step, source)
        self.news.post()

    def request_cut(self) -> None:
        """Ask stage 0 to mark the next step it starts as a snapshot cut (nodes hear of it at once)."""
        self.cut_requests += 1
        self.news.post()

    def link_secret(self, boundary: int, up: str, down: str) -> str:
        """The secret of the link from ``up`` to ``down`` across ``boundary``, this epoch."""
        return self._secret(f"{boundary}/{up}/{down}")

    def evidence_secret(self) -> str:
        """What auditors show Stage.FetchEvidence this epoch (the same for every member); empty when
        the run has no audits (``RunConfig.audits``)."""
        return self._secret("evidence") if self.config.audits else ""

    def _secret(self, what: str) -> str:
        """The HMAC of the run's key over ``run_id/plan_epoch/what``."""
        message = f"{self.run_id}/{self.plan_epoch}/{what}".encode()
        return hmac.new(self.link_key, message, hashlib.sha256).hexdigest()

    def restore(self, stages: Sequence[int]) -> list[coordinator_pb2.StageCheckpoint]:
        """The snapshots ``stages`` resume from this epoch (none when it starts at step 0, or after a
        step that is no cut: the hosts then resume from their own states)."""
        if self.resume_step <= 0:
            return []
        wanted = set(stages) | {n for s in self.rebuilding(stages) for n in (s - 1, s + 1)}
        keys = [(self.resume_step - 1, s) for s in sorted(wanted)]
        records = [self.checkpoints[key] for key in keys if key in self.checkpoints]
        return [self.keepers.describe(r, self.store.complete(r.digest)) for r in records]

    def rebuilding(self, stages: Sequence[int]) -> list[int]:
        """Which of ``stages`` this epoch rebuilds from their neighbours' snapshots (:meth:`restore`)."""
        if self.rebuild_cut < 0 or self.rebuild_cut != self.resume_step - 1:
            return []
        return sorted(set(stages) & self.rebuilt)

    def record(self, ref: coordinator_pb2.StageCheckpoint) -> CheckpointRecord | None:
        """The record ``ref`` names (same stage, step and digest), if the ledger holds it."""
        record = self.checkpoints.get((ref.step, ref.stage))
        return record if record is not None and record.digest == ref.digest else None

    def add_checkpoint(self, record: CheckpointRecord) -> int | None:
        """Record a reported snapshot; the newest complete cut when it is new (:meth:`cut_news`)."""
        self.checkpoints[(record.step, record.stage)] = record
        self.state.add_checkpoint(record)
        return self.cut_news()

    def cut_news(self) -> int | None:
        """Prune old cuts; the newest complete cut when it is new (a snapshot was reported, uploaded
        or kept since the last call)."""
        self._prune_cuts()
        cut = self.latest_cut()
        if cut < 0 or cut == self._cut_shown:
            return None
        self._cut_shown = cut
        self.metrics.checkpointed(cut)
        return cut

    def records(self) -> list[CheckpointRecord]:
        return list(self.checkpoints.values())

    def latest_cut(self) -> int:
        """The newest complete cut (-1: none)."""
        cuts = self._complete_cuts()
        return cuts[0] if cuts else -1

    def _complete_cuts(self) -> list[int]:
        """Steps every stage has a stored snapshot of, newest first."""
        counts: dict[int, int] = {}
        for (step, _), record in self.checkpoints.items():
            counts[step] = counts.get(step, 0) + self._stored(record)
        return sorted((s for s, n in counts.items() if n == self.config.n_stages), reverse=True)

    def _stored(self, r: CheckpointRecord) -> bool:
        """Whether the snapshot outlives the node that took it: a keeper holds it too, or this
        coordinator's disk (as an upload once made a cut durable, a keeper's copy does now)."""
        return len(self.keepers.holders.get(r.digest, ())) > 1 or self.store.complete(r.digest)

    def _latest_verified_cut(self, before: int | None = None) -> int:
        """The newest complete cut (before step ``before``, if given) whose snapshots all have an
        alive holder or pass their hash check on the coordinator's disk, or (``lost_stage =
        "rebuild"``) whose lost stages can be rebuilt (-1: none).

        A snapshot that has neither is dropped with its record, so its cut is never offered again
        (unless its stage is rebuilt at it).
        """
        n = self.config.n_stages
        cuts = set(self._complete_cuts()) | ({self.rebuild_cut} if self.rebuild_cut >= 0 else set())
        for step in sorted((c for c in cuts if before is None or c < before), reverse=True):
            records = [self.checkpoints[(step, s)] for s in range(n) if (step, s) in self.checkpoints]
            bad = [r for r in records if not self._available(r)]
            lost = {s for s in range(n) if (step, s) not in self.checkpoints} | {r.stage for r in bad}
            self._forget(bad)
            if not lost:
                return step
            if self._rebuildable(lost):
                if (step, lost) != (self.rebuild_cut, self.rebuilt):
                    self.rebuild_cut, self.rebuilt = step, frozenset(lost)
                    self.metrics.stage_rebuilds.inc(len(lost))
                    log.warning(
                        "no copy of stage(s) %s after step %d is left: rebuilding from their neighbours",
                        sorted(lost),
                        step,
                    )
                return step
        return -1

    def _rebuildable(self, lost: set[int]) -> bool:
        """Whether CheckFree can rebuild every stage in ``lost``: middle stages, neither neighbour lost."""
        last = self.config.n_stages - 1
        return self.config.checkpoint.lost_stage == "rebuild" and all(
            0 < s < last and s - 1 not in lost and s + 1 not in lost for s in lost
        )

    def rebuilt_lines(self) -> list[str]:
        """The stages this run rebuilt from their neighbours, for Status (empty: none)."""
        if self.rebuild_cut < 0:
            return []
        return [
            f"stage {s} rebuilt from stages {s - 1} and {s + 1} after step {self.rebuild_cut} "
            "(no copy of its snapshot was left; fresh optimizer)"
            for s in sorted(self.rebuilt)
        ]

    def _available(self, r: CheckpointRecord) -> bool:
        if self.keepers.alive_holders(r.digest):
            return True
        if not self.store.complete(r.digest):
            log.warning("snapshot of stage %d at step %d has no alive holder", r.stage, r.step)
            return False
        if self.store.read(r.digest) is None:
            self.metrics.rejected.labels(reason="corrupt_snapshot").inc()
            log.warning("snapshot of stage %d at step %d failed its hash check", r.stage, r.step)
            return False
        return True

    def _forget(self, records: list[CheckpointRecord]) -> None:
        """Drop snapshot records, and their artifacts when no other record names them."""
        for r in records:
            self.checkpoints.pop((r.step, r.stage), None)
        self.state.remove_checkpoints(records)
        kept = {r.digest for r in self.checkpoints.values()}
        gone = {r.digest for r in records} - kept
        for key in gone:
            self.store.remove(key)
        self.keepers.forget(gone)

    def _prune_cuts(self) -> None:
        """Keep the newest ``checkpoint.keep`` complete cuts (and anything newer)."""
        cuts = self._complete_cuts()
        if len(cuts) > self.config.checkpoint.keep:
            oldest_kept = cuts[self.config.checkpoint.keep - 1]
            restore = self.resume_step - 1  # the current epoch's cut: a late joiner still needs it
            self._forget([r for r in self.checkpoints.values() if r.step < oldest_kept and r.step != restore])
