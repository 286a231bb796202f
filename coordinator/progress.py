"""How far the run is: step reports, the completed steps, their rates, and the ``Status`` document.

A step is completed once every stage reported it; once every stage reported the last step the run
is complete (and membership changes no longer replan it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from swarm.coordinator.ledger import Ledger
from swarm.coordinator.roster import Roster
from swarm.coordinator.rotation_hub import RotationHub
from swarm.coordinator.state import CoordinatorState

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.core.config import RunConfig
from swarm.ops.metrics import Metrics
from swarm.ops.status import RATE_WINDOW, run_rates

log = logging.getLogger("swarm.coordinator")


class Progress:
    """The steps reported to ``state``, and the run as ``Status`` shows it (its nodes from the
    ``roster``, its epoch and cuts from the ``ledger``, its subspace version from ``rotation``)."""

    def __init__(
        self,
        config: RunConfig,
        state: CoordinatorState,
        metrics: Metrics,
        roster: Roster,
        ledger: Ledger,
        rotation: RotationHub,
    ):
        self.config, self.state, self.metrics = config, state, metrics
        self.roster, self.ledger, self.rotation = roster, ledger, rotation
        self.completed = state.completed_step(config.n_stages)  # the last step every stage reported
        # The last step every stage completed since the current epoch resumed: its own history (a
        # rollback leaves reports of steps it redoes in the state, from the history it abandoned).
        self.timeline = min(self.completed, ledger.resume_step - 1)
        self._reported: dict[int, set[int]] = {}  # step -> the stages that reported it this epoch
        self._base = self.timeline  # where the epoch resumed after
        self._host_last: dict[str, int] = {}  # node id -> the last step it reported this epoch

    @property
    def run_complete(self) -> bool:
        return self.completed >= self.config.train.steps - 1

    def epoch_started(self, resume_step: int) -> None:
        """A plan epoch resumes at ``resume_step``: the steps from it on are to be done (again), and the
        rotations computed from them are withdrawn."""
        self.rotation.rewind(resume_step, self.ledger.plan_epoch)
        self.timeline, self._reported = resume_step - 1, {}
        self._base, self._host_last = resume_step - 1, {}

    def resumable(self, hosts: Iterable[str]) -> int:
        """The last step an epoch can resume after with ``hosts`` going on from their own states:
        one every stage completed (:attr:`timeline`) and each of ``hosts`` reported. A replica whose
        averaging round failed where its sibling's went through did not complete the step its
        stage reported, and holds no state of it."""
        return min([self.timeline] + [self._host_last.get(n, self._base) for n in hosts])

    def record(self, request: coordinator_pb2.StepReport) -> None:
        """Record a stage's step report (from a node hosting that stage); update the gauges. The
        stage's totals come from its lead; another replica's report (``progress_only``) says only
        how far that replica got. (Which host leads is the plan's, as the step ran: the roster's
        order changes as soon as a lead leaves, while its siblings' reports are on their way.)"""
        if request.step > self._host_last.get(request.node_id, self._base):
            self._host_last[request.node_id] = request.step
        if request.progress_only:
            return
        if request.step > self.timeline:
            self._reported.setdefault(request.step, set()).add(request.stage)
            while len(self._reported.get(self.timeline + 1, ())) == self.config.n_stages:
                self.timeline += 1
                del self._reported[self.timeline]
        loss = request.loss if request.HasField("loss") else None
        self.state.record_step(
            request.step,
            request.stage,
            loss,
            request.tokens,
            request.bytes_sent_forward,
            request.bytes_sent_backward,
            request.wall_seconds,
        )
        self.metrics.step.labels(stage=str(request.stage)).set(request.step)
        if loss is not None and request.stage == self.config.n_stages - 1:
            self.metrics.loss.set(loss)
        if request.step > self.completed:
            self.completed = self.state.completed_step(self.config.n_stages)
            rates = self.rates()
            self.metrics.run_tokens_per_second.set(rates.tokens_per_second)
            self.metrics.run_bytes_per_token.set(rates.bytes_per_token)
            self.metrics.run_compression_ratio.set(rates.compression_ratio)
            if self.run_complete:
                log.info("run complete: every stage finished step %d", self.completed)
                self.ledger.news.post()

    def status(self, config_hash: str, since_step: int = 0) -> coordinator_pb2.StatusReply:
        """The run (of configuration ``config_hash``), its nodes and the completed steps >= ``since_step``."""
        return coordinator_pb2.StatusReply(
            run_id=self.ledger.run_id,
            step=max(0, self.completed),
            subspace_version=self.rotation.version,
            nodes=self.roster.statuses(),
            config_hash=config_hash,
            steps_completed=self.completed + 1,
            steps=self.step_summaries(since_step),
            plan_epoch=self.ledger.plan_epoch,
            resume_step=self.ledger.resume_step,
            latest_cut=self.ledger.latest_cut() + 1,
            run_complete=self.run_complete,
            epochs_restarted=self.ledger.restarts,
            rates=self.rates(),
        )

    def step_summaries(self, since_step: int) -> list[coordinator_pb2.StepSummary]:
        """The completed steps >= ``since_step``, each summed over its stages."""
        return [
            coordinator_pb2.StepSummary(
                step=step,
                loss=loss,
                tokens=tokens or 0,
                bytes_sent_forward=fwd or 0,
                bytes_sent_backward=bwd or 0,
                wall_seconds=wall or 0.0,
                completed_at=at,
            )
            for step, loss, tokens, fwd, bwd, wall, at in self.state.step_summaries(
                self.config.n_stages, since_step
            )
        ]

    def rates(self) -> coordinator_pb2.RunRates:
        """Tokens/s, bytes/token and compression over the last ``RATE_WINDOW`` completed steps."""
        recent = self.step_summaries(max(0, self.completed - RATE_WINDOW + 1))[-RATE_WINDOW:]
        return run_rates(recent, self.config.model.d_model, self.config.n_stages - 1)
