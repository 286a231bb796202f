"""This node's audits of its sibling replicas: draw, keep the weights, recompute, report.

In runs where replicas average every step (``RunConfig.audits``), a replica holds the same weights
as its siblings at every step. As each step begins (its rotation applied, nothing computed yet) it
draws, privately (the audited node cannot tell), which of each sibling's microbatches it will
recompute (each with probability ``audit.rate``, or ``audit.suspect_rate`` for a sibling the
coordinator names a suspect: a screen flagged its activations lately) and, when any, keeps a copy of
the stage's weights (:class:`StageState`). After the
step, off the critical path, it fetches the frames the neighbouring stages' nodes kept of those
microbatches (``Stage.FetchEvidence``), recomputes them (:class:`StageAuditor`, in a thread) and
reports each outcome to the coordinator (``ReportAudit``), which evicts on confirmed mismatches.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Collection

import grpc

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm._proto.swarm.v1 import stage_pb2, stage_pb2_grpc
from swarm.core.config import RunConfig
from swarm.net.channel import DEFAULT_KEEPALIVE, KeepAlive, open_channel
from swarm.net.frames import activation_from_proto, gradient_from_proto
from swarm.net.tls import INSECURE, NODE_SERVER_NAME, Security
from swarm.ops.metrics import Metrics
from swarm.runtime.audit import CommitmentTally, Evidence, StageAuditor, StageState, audit_tolerance
from swarm.runtime.wire import ActivationFrame, GradientFrame
from swarm.runtime.worker import StageWorker

log = logging.getLogger(__name__)
FETCH_S = 10.0  # one evidence call
CLOSE_GRACE_S = 5.0  # how long an ended epoch's audits may still run
Frame = ActivationFrame | GradientFrame


class EvidenceUnavailable(Exception):
    """A frame the audit needs is gone, unreachable or malformed."""


class Auditor:
    """Audits the siblings of this node's replicated stages for one plan epoch.

    ``owners``: per stage, microbatch -> the node processing it this epoch; ``addresses``: node id
    -> announce address; ``report``: sends a ``ReportAudit`` request (the coordinator client's);
    ``suspects``: the nodes to audit at ``audit.suspect_rate`` now (the screen flagged them).
    """

    def __init__(
        self,
        config: RunConfig,
        plan: cpb.Plan,
        node_id: str,
        owners: list[dict[int, str]],
        addresses: dict[str, str],
        tally: CommitmentTally,
        report: Callable[[cpb.AuditReport], None],
        metrics: Metrics,
        security: Security = INSECURE,
        keepalive: KeepAlive = DEFAULT_KEEPALIVE,
        suspects: Callable[[], Collection[str]] = frozenset,
        accuse: bool = False,
    ):
        self.config, self.plan, self.node_id = config, plan, node_id
        self.suspects = suspects
        self.accuse = accuse  # tests only (``--fault accuse``): report every audit as a mismatch
        self.owners, self.addresses, self.tally = owners, addresses, tally
        self.report, self.metrics = report, metrics
        self.security, self.keepalive = security, keepalive
        self.rng = random.SystemRandom()
        self.auditors: dict[int, StageAuditor] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.channels: dict[str, grpc.aio.Channel] = {}  # by neighbour address, for the epoch
        # per stage: the weights its step began with, the microbatches drawn, the worker (until the step ends)
        self.due: dict[int, tuple[StageState, list[int], StageWorker]] = {}

    def step_begun(self, step: int, worker: StageWorker) -> None:
        """A hosted stage began ``step`` (its rotation applied): draw its audits of the siblings'
        microbatches and, when any, keep its weights as they are now."""
        audit, suspects = self.config.audit, self.suspects()
        theirs = [(mb, n) for mb, n in sorted(self.owners[worker.index].items()) if n != self.node_id]
        drawn = [
            mb
            for mb, n in theirs
            if self.rng.random() < (max(audit.rate, audit.suspect_rate) if n in suspects else audit.rate)
        ]
        if drawn:
            self.due[worker.index] = (StageState.capture(worker, step), drawn, worker)

    def after_step(self) -> None:
        """Start the audits drawn for the step just done (in the background)."""
        for stage, (state, drawn, worker) in self.due.items():
            auditor = self.auditors.get(stage) or self._auditor(worker)
            for mb in drawn:
                task = asyncio.create_task(self._audit(auditor, stage, state, mb))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        self.due = {}

    def _auditor(self, worker: StageWorker) -> StageAuditor:
        c = self.config  # (the audited node's device is unknown: the cross-device tolerance)
        tolerance = audit_tolerance(c.train.precision, c.codec.forward_format, c.codec.backward_format)
        auditor = StageAuditor(
            self.config,
            worker.index,
            worker.stage.fixed_embedding,
            worker.basis,
            worker.device,
            worker.dtype,
            tolerance,
        )
        self.auditors[worker.index] = auditor
        return auditor

    async def _audit(self, auditor: StageAuditor, stage: int, state: StageState, mb: int) -> None:
        audited = self.owners[stage][mb]
        report = cpb.AuditReport(
            node_id=self.node_id,
            plan_epoch=self.plan.epoch,
            stage=stage,
            step=state.step,
            microbatch=mb,
            audited_node_id=audited,
        )
        try:
            evidence = await self._evidence(stage, state.step, mb)
            verdict = await asyncio.to_thread(auditor.check, state, mb, evidence)
        except (EvidenceUnavailable, ValueError) as e:
            report.outcome, report.detail = "unavailable", str(e)[:300]
        except Exception as e:  # a bug here must not pass for a verdict, nor kill the node
            log.exception("audit of stage %d, step %d, microbatch %d failed", stage, state.step, mb)
            report.outcome, report.detail = "unavailable", f"the recomputation failed: {e}"[:300]
        else:
            direction, comparison = verdict.deciding
            report.outcome = "match" if verdict.matches and not self.accuse else "mismatch"
            report.direction = direction
            if comparison is not None:
                report.rel_l2, report.cosine = comparison.rel_l2, comparison.cosine
            if not verdict.matches:
                log.warning(
                    "audit: node %s's %s of stage %d, step %d, microbatch %d is off by %.3g (cosine %.4f)",
                    audited[:8],
                    direction,
                    stage,
                    state.step,
                    mb,
                    report.rel_l2,
                    report.cosine,
                )
        self.metrics.audits.labels(outcome=report.outcome).inc()
        self.report(report)

    async def _evidence(self, stage: int, step: int, mb: int) -> Evidence:
        """The frames microbatch ``mb`` of ``stage`` crossed its boundaries with, from its neighbours."""
        last = self.config.n_stages - 1
        up = self.owners[stage - 1][mb] if stage > 0 else None
        down = self.owners[stage + 1][mb] if stage < last else None
        if self.owners[stage][mb] in (up, down):
            raise EvidenceUnavailable("the audited node is its own neighbour: no one else saw its frames")
        wanted = []
        if up is not None:
            wanted += [(up, stage - 1, "forward", "sent"), (up, stage - 1, "backward", "received")]
        if down is not None:
            wanted += [(down, stage, "forward", "received"), (down, stage, "backward", "sent")]
        frames = await asyncio.gather(*(self._frame(n, step, b, d, mb, side) for n, b, d, side in wanted))
        got = dict(zip([(b, d) for _, b, d, _ in wanted], frames, strict=True))
        return Evidence(
            inputs=got.get((stage - 1, "forward")),
            output=got.get((stage, "forward")),
            grad_out=got.get((stage, "backward")),
            grad_in=got.get((stage - 1, "backward")),
        )

    async def _frame(self, node: str, step: int, boundary: int, direction: str, mb: int, side: str) -> Frame:
        """One kept frame: from this node's own streams, or from ``node`` over ``Stage.FetchEvidence``."""
        if node == self.node_id:
            frame = self.tally.kept(step, boundary, direction, mb, side)
            if frame is None:
                raise EvidenceUnavailable(f"this node kept no {direction} frame of boundary {boundary}")
            return frame
        address = self.addresses.get(node, "")
        if not address:
            raise EvidenceUnavailable(f"node {node[:8]} announces no address to fetch evidence from")
        request = stage_pb2.EvidenceRequest(
            step=step,
            boundary=boundary,
            direction=direction,
            microbatch=mb,
            side=side,
            access=self.plan.evidence_secret,
        )
        channel = self.channels.get(address)
        if channel is None:
            channel = self.channels[address] = open_channel(
                address, self.security, self.keepalive, NODE_SERVER_NAME
            )
        try:
            reply = await stage_pb2_grpc.StageStub(channel).FetchEvidence(request, timeout=FETCH_S)
        except grpc.aio.AioRpcError as e:
            raise EvidenceUnavailable(f"node {node[:8]}: {e.code().name}: {e.details()}") from None
        body = reply.WhichOneof("frame")
        if body != ("activation" if direction == "forward" else "gradient"):
            raise EvidenceUnavailable(f"node {node[:8]} answered a {body} for a {direction} frame")
        try:
            if body == "activation":
                return activation_from_proto(reply.activation)
            return gradient_from_proto(reply.gradient)
        except ValueError as e:
            raise EvidenceUnavailable(f"node {node[:8]} sent a malformed frame: {e}") from None

    async def close(self) -> None:
        """The epoch ended: give the audits still running up to :data:`CLOSE_GRACE_S` to finish
        (their reports still count, made in this epoch), cancel the rest, close the evidence channels."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=CLOSE_GRACE_S)
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.channels.values()), return_exceptions=True)
        self.channels.clear()
