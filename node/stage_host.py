"""The stages a node hosts in one plan epoch: built or restored, trained, snapshotted.

Every epoch starts from fresh :class:`~swarm.runtime.worker.StageWorker` objects (built off the
event loop): from the run seed when the epoch resumes at step 0, else restored from the
node's own state of the step before it (:class:`~swarm.node.own_states.OwnStates`, kept in runs
with replicas) or from the snapshots of the epoch's cut (the node's own verified copy when it has
one, else fetched from its holders: :class:`~swarm.node.snapshot_fetch.SnapshotFetcher`). Consecutive
hosted stages talk in memory. After each step the step reports are queued for the coordinator;
after each cut step every led stage's state is captured to host memory and handed to the
:class:`~swarm.node.checkpointer.Checkpointer`, which saves it in the background while training
goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch
from swarm.node.auditor import Auditor
from swarm.node.checkpointer import Checkpointer
from swarm.node.coordinator_client import CoordinatorClient
from swarm.node.keeper import held_report
from swarm.node.links import LocalLink
from swarm.node.own_states import OwnStates
from swarm.node.schedule import StageAveraging, StageRunner, StepOutcome
from swarm.node.settings import Timeouts
from swarm.node.snapshot_fetch import SnapshotFetcher

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm.core.config import RunConfig
from swarm.core.subspace import initial_basis
from swarm.io import checkpoint
from swarm.io.checkpoint import Sampler
from swarm.io.data import TokenDataset, batch_ids
from swarm.io.prepared import PreparedDataset
from swarm.ops.logs import say
from swarm.ops.metrics import Metrics
from swarm.runtime.audit import CommitmentTally
from swarm.runtime.faults import Fault, FaultSpec
from swarm.runtime.norm_guard import NormBound
from swarm.runtime.replicas import Routes
from swarm.runtime.worker import StageWorker

log = logging.getLogger(__name__)


def connect_local(up: StageRunner, down: StageRunner, node_id: str) -> None:
    """Consecutive stages on this node: frames handed over in memory."""
    to_down, to_up = LocalLink(), LocalLink()
    to_down.deliver = down.attach(to_up, node_id, downstream=False)
    to_up.deliver = up.attach(to_down, node_id, downstream=True)


def microbatch_owners(plan: cpb.Plan) -> list[dict[int, str]]:
    """Per stage: microbatch -> the node processing it, as the plan deals them."""
    owners: list[dict[int, str]] = [{} for _ in plan.replicas]
    for entry in plan.replicas:
        for replica in entry.replicas:
            owners[entry.stage].update(dict.fromkeys(replica.microbatches, replica.node_id))
    return owners


# The averaging of a replicated hosted stage with its sibling replicas, made per epoch.
AveragingFactory = Callable[[cpb.StageReplicas, Callable[[int], bool]], StageAveraging]


class StageHost:
    """This node's stages for one plan epoch."""

    def __init__(
        self,
        config: RunConfig,
        plan: cpb.Plan,
        fixed: torch.Tensor,
        device: torch.device,
        client: CoordinatorClient,
        checkpointer: Checkpointer,
        fetcher: SnapshotFetcher,
        metrics: Metrics,
        dataset: Callable[[], TokenDataset | PreparedDataset],
        timeouts: Timeouts,
        averaging_for: AveragingFactory | None = None,
        own: OwnStates | None = None,
        fault: FaultSpec | None = None,
        tally: CommitmentTally | None = None,
        auditor: Auditor | None = None,
    ):
        self.config, self.plan, self.fixed, self.device = config, plan, fixed, device
        self.own = own  # this node's states after its latest steps (runs with replicas)
        self.client, self.checkpointer, self.fetcher, self.metrics = client, checkpointer, fetcher, metrics
        self.dataset, self.timeouts = dataset, timeouts
        self.averaging_for, self.fault = averaging_for, fault
        self.faults: dict[int, Fault] = {}  # tests only: the lies this node's stages tell (``fault``)
        self.tally = tally  # the commitments of its streams' frames, reported with each step
        self.auditor = auditor  # its audits of sibling replicas (runs with audits)
        self.node_id = client.node_id
        # the stages this node leads (the first replica): it reports their steps, statistics, snapshots
        self.leads = {e.stage for e in plan.replicas if e.replicas and e.replicas[0].node_id == self.node_id}
        self.runners: dict[int, StageRunner] = {}
        self.sampler: Sampler | None = None
        self.last_cut: int | None = None  # the last step snapshotted in this epoch

    @property
    def rotating(self) -> bool:
        return self.config.rotation.interval > 0 and self.config.model.constrained

    # -- building -------------------------------------------------------------------------------

    async def build(self) -> None:
        """Build the stages (off the event loop) and restore them at the epoch's resume step: from this
        node's own state of the step before when it kept one, else from the cut's snapshot; a stage the
        plan rebuilds, from its neighbours' (:func:`swarm.io.checkpoint.rebuild`)."""
        resume = self.plan.resume_step
        own: dict[int, dict] = {}
        if self.own is not None:
            self.own.forget_from(resume)
            kept = {s: self.own.take(s, resume - 1, self.device) for s in self.plan.stages if resume > 0}
            own = {s: state for s, state in kept.items() if state is not None}
        rebuilt = set(self.plan.rebuild) - set(own)
        snapshots = {}
        for ref in self.plan.restore:
            if ref.stage in own:
                continue
            self.client.set_phase(cpb.NODE_PHASE_FETCHING)
            data = await asyncio.to_thread(self.checkpointer.store.read, ref.stage, ref.step, ref.digest)
            if data is None:
                data = await self.fetcher.fetch(ref)
                await asyncio.to_thread(self.checkpointer.store.write, ref.stage, ref.step, data)
                self.client.report("ReportCheckpoint", held_report(self.node_id, ref))  # a holder now
            snapshots[ref.stage] = data
        have = {*own, *snapshots}
        missing = [s for s in self.plan.stages if resume > 0 and s not in have and s not in rebuilt]
        missing += [n for s in rebuilt for n in (s - 1, s + 1) if n not in have]
        if missing:
            raise RuntimeError(
                f"no state of stage(s) {missing} after step {resume - 1}: this node kept none and the "
                "plan names no snapshot"
            )
        for s in own:
            say(f"stage {s}: resumed from this node's own state after step {resume - 1}")
        self.client.set_phase(cpb.NODE_PHASE_LOADING)
        await asyncio.to_thread(self._build, snapshots, own, rebuilt)
        if self.own is not None:  # what came from a snapshot (or was rebuilt) is this node's own state now
            for state in self._capture(resume - 1, [*snapshots, *rebuilt]):
                self.own.put(state)
        for s, runner in self.runners.items():
            if self.auditor is not None:
                runner.step_begun = self.auditor.step_begun
            nxt = self.runners.get(s + 1)
            if nxt is not None:
                connect_local(runner, nxt, self.node_id)

    def _build(self, snapshots: dict[int, bytes], own: dict[int, dict], rebuilt: set[int]) -> None:
        basis = initial_basis(self.config)
        t = self.config.train
        owners = microbatch_owners(self.plan)
        for s in self.plan.stages:
            worker = StageWorker(
                self.config, s, self.fixed, basis, device=self.device, norm_bound=NormBound()
            )
            sampler = None
            if worker.is_first:
                sampler = self.dataset().sampler(t.batch_size, t.seq_len, t.seed)
                self.sampler = sampler
            state = self._state_of(s, own, snapshots)
            if s in rebuilt:
                step = checkpoint.rebuild(worker, [self._state_of(n, own, snapshots) for n in (s - 1, s + 1)])
                if step != self.plan.resume_step - 1:
                    raise RuntimeError(f"stage {s} rebuilt from step {step}, the plan resumes after it")
                say(f"stage {s}: rebuilt from stages {s - 1} and {s + 1} after step {step} (no copy left)")
            elif state is not None:
                step = checkpoint.restore(worker, state, sampler)
                if step != self.plan.resume_step - 1:
                    raise RuntimeError(f"snapshot of stage {s} is of step {step}, the plan resumes after it")
                if s not in own and s not in self.leads and worker.statistic is not None:
                    # Replicas sum what each accumulated toward the next rotation: the lead's snapshot
                    # holds its share, which the lead itself brings; this replica starts from none.
                    worker.statistic.reset()
            fault = self.fault.attach(worker, seed=s) if self.fault is not None else None
            if fault is not None:  # tests only: this node lies from here on
                self.faults[s] = fault
                say(f"stage {s}: FAULTY on purpose ({self.fault})")
            rotation_ready = self._rotation_ready(worker) if self.rotating else None
            batches = self._batches(sampler) if sampler is not None else None
            replicas = self.plan.replicas[s]
            averaging = (
                self.averaging_for(replicas, self._statistic_due) if len(replicas.replicas) > 1 else None
            )
            self.runners[s] = StageRunner(
                worker,
                self.metrics,
                batches,
                rotation_ready,
                self.timeouts.step_s,
                Routes.of(s, self.node_id, owners),
                averaging,
            )

    def _state_of(self, stage: int, own: dict[int, dict], snapshots: dict[int, bytes]) -> dict | None:
        """The state of ``stage`` this node kept itself, else parsed from its fetched snapshot (None)."""
        if stage in own:
            return own[stage]
        return checkpoint.from_bytes(snapshots[stage], self.device) if stage in snapshots else None

    def _batches(self, sampler: Sampler) -> Callable[[int], torch.Tensor]:
        expected = [self.plan.resume_step]

        def batch_for_step(step: int) -> torch.Tensor:
            if step != expected[0]:
                raise RuntimeError(f"stage 0 asked for step {step}, sampler is at {expected[0]}")
            expected[0] += 1
            return batch_ids(*sampler.next_batch())

        return batch_for_step

    def _rotation_ready(self, worker: StageWorker):
        interval = self.config.rotation.interval

        async def ready(step: int) -> None:
            """Before a step at which a rotation is due, wait for it and hand it to the worker."""
            if step == 0 or step % interval:
                return
            rotation = await self.client.rotation(step // interval, self.plan.rotation_lineage)
            if worker.version < rotation.version:
                worker.schedule_rotation(rotation)
                say(
                    f"rotation to subspace version {rotation.version} at step {rotation.effective_step} "
                    f"(rank {rotation.basis.shape[1]})"
                )

        return ready

    async def connect_replicas(self) -> None:
        """Connect to the sibling replicas of every replicated stage (before the first step)."""
        for runner in self.runners.values():
            if runner.averaging is not None:
                await runner.averaging.connect()

    # -- training -------------------------------------------------------------------------------

    async def train(self, take_cut_request: Callable[[], bool], leaving: asyncio.Event) -> bool:
        """Run the epoch's steps to the end of the run; False if stopped early to leave: at the first
        cut after ``leaving`` is set, or without one once ``Timeouts.leave_s`` has passed."""
        epoch, steps = self.plan.epoch, self.config.train.steps
        loop = asyncio.get_running_loop()
        leave_by = None
        for step in range(self.plan.resume_step, steps):
            if leaving.is_set():
                leave_by = leave_by or loop.time() + self.timeouts.leave_s
                if loop.time() > leave_by:
                    say(f"no snapshot cut within {self.timeouts.leave_s:.0f}s; leaving without one")
                    return False
            mark = 0 in self.runners and take_cut_request()
            results = await asyncio.gather(*(r.run_step(step, mark) for r in self.runners.values()))
            for fault in self.faults.values():  # (a stale liar's copy follows the weights, lagging)
                fault.stepped()
            states, pause = None, 0.0
            if self.own is not None:
                # Kept before the step is reported, with no await in between: an epoch that resumes
                # after this step (its completion known from these reports) finds it here.
                started = time.perf_counter()
                states = self._capture(step)
                pause = self._paused("own", started)
                for state in states:
                    self.own.put(state)
            for outcome in results:
                self._report(epoch, outcome)
            if self.auditor is not None:
                self.auditor.after_step()
            seconds = max(o.seconds for o in results)
            busy = sum(o.busy_seconds for o in results)
            version = next(iter(self.runners.values())).worker.version
            tokens = results[0].own_tokens
            capacity = tokens / busy if busy > 0 else 0.0
            self.client.progress(step, tokens / seconds if seconds > 0 else 0.0, version, capacity)
            if any(o.cut for o in results) or self.config.checkpoint.is_cut(step, steps):
                if states is None:
                    started = time.perf_counter()
                    states = await asyncio.to_thread(self._capture, step)
                    pause = self._paused("cut", started)
                led = [state for state in states if state["stage"] in self.leads]
                if led:
                    # the final cut goes to the coordinator too: it writes the trained model from it
                    upload = self.plan.upload_snapshots or step == steps - 1
                    self.checkpointer.submit(epoch, led, pause, upload)
                self.last_cut = step
                if leaving.is_set():
                    return False
        for runner in self.runners.values():
            if runner.averaging is not None:
                say(runner.averaging.summary())
        return True

    def _capture(self, step: int, stages: list[int] | None = None) -> list[dict]:
        """The state of every hosted stage (or of ``stages``) after ``step`` (replicas hold identical
        state: only the lead's is stored at a cut; each keeps its own in :class:`OwnStates`)."""
        return [
            checkpoint.capture(r.worker, step, self.sampler if r.worker.is_first else None)
            for s, r in self.runners.items()
            if stages is None or s in stages
        ]

    def _paused(self, kind: str, started: float) -> float:
        """Record how long training stood still for a capture begun at ``started``; the seconds."""
        seconds = time.perf_counter() - started
        self.metrics.snapshot_pause.labels(kind=kind).observe(seconds)
        return seconds

    def _statistic_due(self, step: int) -> bool:
        """Whether the boundary statistic is reported after ``step`` (the rotation interval's end)."""
        return self.rotating and (step + 1) % self.config.rotation.interval == 0

    def _tallies(self, outcome: StepOutcome) -> list[cpb.FrameTally]:
        """The step's frame commitments, on the report of this node's first stage only (one node's
        streams: reported once)."""
        if self.tally is None or outcome.stage != min(self.runners):
            return []
        return [
            cpb.FrameTally(
                boundary=t.boundary,
                direction=t.direction,
                sent=t.sent.to_bytes(32, "big"),
                received=t.received.to_bytes(32, "big"),
                sent_frames=t.sent_frames,
                received_frames=t.received_frames,
            )
            for t in self.tally.take(outcome.step)
        ]

    def _report(self, epoch: int, outcome: StepOutcome) -> None:
        drifted = outcome.stats.drifted_frames
        tallies = self._tallies(outcome)
        if drifted:
            say(
                f"step {outcome.step}: the screen flagged {drifted} received activation frames "
                f"({outcome.stats.drift})"
            )
        if outcome.stage not in self.leads:  # the lead reports the stage's totals; this, how far it got
            progress = cpb.StepReport(
                plan_epoch=epoch,
                node_id=self.node_id,
                stage=outcome.stage,
                step=outcome.step,
                progress_only=True,
                drifted_frames=drifted,
                drift=outcome.stats.drift,
                tallies=tallies,
            )
            self.client.report("ReportStep", progress)
            return
        s = outcome.stats
        request = cpb.StepReport(
            plan_epoch=epoch,
            node_id=self.client.node_id,
            stage=outcome.stage,
            step=outcome.step,
            tokens=s.tokens,
            bytes_sent_forward=outcome.wire_bytes_forward,
            bytes_sent_backward=outcome.wire_bytes_backward,
            wall_seconds=outcome.seconds,
            drifted_frames=drifted,
            drift=s.drift,
            tallies=tallies,
        )
        if s.loss_count:
            request.loss = s.loss_sum / s.loss_count
            say(f"step {outcome.step} loss {request.loss:.4f}")
        self.client.report("ReportStep", request)
        worker = self.runners[outcome.stage].worker
        if worker.statistic is not None and self._statistic_due(outcome.step):
            st = worker.statistic
            self.client.report(
                "ReportStatistics",
                cpb.StatisticsReport(
                    node_id=self.client.node_id,
                    plan_epoch=epoch,
                    stage=outcome.stage,
                    step=outcome.step,
                    boundary=outcome.stage - 1,
                    subspace_version=worker.version,
                    gram_times_basis_f64_le=st.gram_times_basis.cpu()
                    .double()
                    .numpy()
                    .astype("<f8")
                    .tobytes(),
                    off_energy=st.off_energy,
                    total_energy=st.total_energy,
                    rows=st.count,
                ),
            )
