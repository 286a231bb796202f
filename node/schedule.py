"""The microbatch schedule of one hosted stage over real boundary streams: GPipe or 1F1B.

The order of a stage's passes (``train.schedule``) and its end of step come from
:mod:`swarm.runtime.steps`, shared with the single-process pipeline; this module runs them
against the links. Stage 0 forwards its microbatches in order and sends each frame as soon as it
is computed (sends are queued, so compute overlaps the wire); other stages forward what arrives
next; the last stage backpropagates the microbatch the order names, the others the gradient
that arrives next. 1F1B's gradients are GPipe's up to the order of fp32 accumulation. Then
neighbours exchange boundary state (MAPL gradient shares, RVQ codebook deltas), the optimizer
steps, and a rotation announced for the next step is waited for and applied.

With replicas (several nodes hosting one stage, :mod:`swarm.runtime.replicas`) a stage processes only
its own microbatches of each step, sends each activation to the next stage's replica the plan
routes it to and each gradient back to the replica it came from, refuses frames from any other
peer, and averages its gradients with its sibling replicas (:class:`StageAveraging`) before the
optimizer step.

A step can be marked as a checkpoint cut on the fly: stage 0 sets ``cut`` on the step's
activation frames and every stage forwards the mark, so all of them know to snapshot
after that step (used when a node is about to leave).

Compute runs in a worker thread (``asyncio.to_thread``) so the event loop keeps
streams flowing while a stage is busy. Malformed or stale frames are rejected with a
counter and an ``Error`` to the peer, never applied.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from swarm.node.links import BadFrameError, rejection_reason

from swarm._proto.swarm.v1 import stage_pb2
from swarm.codecs.base import PayloadError, StaleVersionError
from swarm.ops.metrics import Metrics
from swarm.runtime.replicas import Routes
from swarm.runtime.steps import FORWARD, Receive, Send, end_step, run_over_links, stage_order
from swarm.runtime.wire import ActivationFrame, BoundarySync, GradientFrame
from swarm.runtime.worker import StageStats, StageWorker

log = logging.getLogger(__name__)


class StageTimeout(RuntimeError):
    """A neighbour stopped sending within the step timeout."""


@dataclass
class StepOutcome:
    stage: int
    step: int
    stats: StageStats
    wire_bytes_forward: int
    wire_bytes_backward: int
    seconds: float
    cut: bool = False  # the step was marked as a checkpoint cut
    peak_live_microbatches: int = 0  # most microbatches whose activations the stage held at once
    busy_seconds: float = 0.0  # computing or waiting for room to send (not waiting for neighbours)
    own_tokens: int = 0  # tokens this replica processed (stats.tokens: the whole stage's, summed)


@dataclass
class StepCounts:
    """What a step of one replica adds to the stage's totals (summed across replicas)."""

    tokens: int
    loss_sum: float
    loss_count: int
    wire_bytes_forward: int
    wire_bytes_backward: int
    cut: bool


class StageAveraging(Protocol):
    """Averages a stage's gradients and sums its step counts across the stage's replicas."""

    async def connect(self) -> None: ...

    def summary(self) -> str: ...

    async def combine(self, step: int, worker: StageWorker, counts: StepCounts) -> StepCounts: ...

    async def after_step(self, step: int, worker: StageWorker, cut: bool) -> None: ...


class StageRunner:
    """Runs one :class:`StageWorker` against the links to its neighbouring replicas, one step at a time.

    ``routes``: this replica's microbatches and their neighbours (default: every microbatch, one
    neighbour each way); ``averaging``: how it averages with its sibling replicas (None: it has none).
    """

    def __init__(
        self,
        worker: StageWorker,
        metrics: Metrics,
        batch_for_step: Callable[[int], torch.Tensor] | None = None,
        rotation_ready: Callable[[int], Awaitable[None]] | None = None,
        timeout: float = 300.0,
        routes: Routes | None = None,
        averaging: StageAveraging | None = None,
    ):
        self.worker, self.metrics, self.timeout = worker, metrics, timeout
        self.batch_for_step, self.rotation_ready = batch_for_step, rotation_ready
        self.routes = routes or Routes.alone(worker.config.train.microbatches)
        self.averaging = averaging
        # called once a step has begun (rotation applied, nothing computed yet): the auditor's draw
        self.step_begun: Callable[[int, StageWorker], None] | None = None
        # links to the replicas of stage index-1 / index+1 (StageLink or LocalLink), by node id
        self.upstream_links: dict[str, object] = {}
        self.downstream_links: dict[str, object] = {}
        self._activations: asyncio.Queue[tuple[str, ActivationFrame]] = asyncio.Queue()
        self._gradients: asyncio.Queue[tuple[str, GradientFrame]] = asyncio.Queue()
        self._syncs_up: asyncio.Queue[BoundarySync] = asyncio.Queue()
        self._syncs_down: asyncio.Queue[BoundarySync] = asyncio.Queue()
        self.failure: Exception | None = None

    @property
    def index(self) -> int:
        return self.worker.index

    # -- links --------------------------------------------------------------------------------

    def attach(self, link, peer: str, downstream: bool) -> Callable[[object], None]:
        """Use ``link`` to reach ``peer``, a replica of the next (``downstream``) or previous stage;
        returns the callback that delivers what arrives from it."""
        if downstream:
            self.downstream_links[peer] = link
            return functools.partial(self.deliver_from_downstream, sender=peer)
        self.upstream_links[peer] = link
        return functools.partial(self.deliver_from_upstream, sender=peer)

    @property
    def upstream(self):
        """The link to stage index-1 for boundary syncs (MAPL, RVQ: configurations with one
        replica per stage, so one link); None on stage 0."""
        return next(iter(self.upstream_links.values()), None)

    @property
    def downstream(self):
        """The link to stage index+1 for boundary syncs; None on the last stage."""
        return next(iter(self.downstream_links.values()), None)

    # -- delivery from links --------------------------------------------------------------------

    def deliver_from_upstream(self, item, sender: str = "") -> None:
        if isinstance(item, ActivationFrame):
            if self._routed(item, self.routes.upstream, sender, self.index - 1):
                self._count_dense(self.index - 1, "forward", "received", item)
                self._enqueue(self._activations, (sender, item), self.index - 1)
        else:
            self._enqueue(self._syncs_up, item, self.index - 1)

    def deliver_from_downstream(self, item, sender: str = "") -> None:
        if isinstance(item, GradientFrame):
            if self._routed(item, self.routes.downstream, sender, self.index):
                self._count_dense(self.index, "backward", "received", item)
                self._enqueue(self._gradients, (sender, item), self.index)
        else:
            self._enqueue(self._syncs_down, item, self.index)

    def _routed(self, frame, senders: Mapping[int, str], sender: str, boundary: int) -> bool:
        """Whether ``frame`` comes from the replica its microbatch is routed through. A frame of
        another replica's microbatch fails the step and gets its sender reported; one outside the
        step's microbatches goes on to the worker, which refuses it."""
        mb = frame.microbatch
        if not 0 <= mb < self.worker.config.train.microbatches or senders.get(mb) == sender:
            return True
        self.metrics.rejected.labels("misrouted").inc()
        who = sender[:8] or "the peer"
        self.fail(
            BadFrameError(
                f"boundary {boundary}: {who} sent microbatch {mb}, not routed through it", boundary, sender
            )
        )
        return False

    def _enqueue(self, queue: asyncio.Queue, item, boundary: int) -> None:
        """Queue a delivered item. An honest neighbour is at most a step ahead (M frames, a few
        syncs); one that sends more is flooding: the step fails and the sender is reported."""
        limit = 2 * self.worker.config.train.microbatches + 2
        if queue.qsize() >= limit:
            self.metrics.rejected.labels("flood").inc()
            while not queue.empty():  # dropped: the step fails at once, not after the backlog
                queue.get_nowait()
            self.fail(BadFrameError(f"boundary {boundary}: the peer sent over {limit} items ahead", boundary))
            return
        queue.put_nowait(item)
        self._show_depth(queue)

    def _show_depth(self, queue: asyncio.Queue) -> None:
        """``swarm_stream_queue_depth``: received frames of a boundary not yet taken for compute."""
        if queue is self._activations:
            self.metrics.queue_depth.labels(str(self.index - 1), "forward").set(queue.qsize())
        elif queue is self._gradients:
            self.metrics.queue_depth.labels(str(self.index), "backward").set(queue.qsize())

    def _count_dense(
        self, boundary: int, direction: str, io: str, frame: ActivationFrame | GradientFrame
    ) -> None:
        """What the frame would have been as uncompressed bf16 activations (rows x d x 2 bytes)."""
        dense = frame.payload.rows * self.worker.config.model.d_model * 2
        self.metrics.dense_bytes.labels(str(boundary), direction, io).inc(dense)

    def fail(self, error: Exception) -> None:
        """A link broke: wake the step with the error."""
        self.failure = error
        for q in (self._activations, self._gradients, self._syncs_up, self._syncs_down):
            q.put_nowait(None)

    async def _get(self, queue: asyncio.Queue, what: str, step: int):
        try:
            item = await asyncio.wait_for(queue.get(), timeout=self.timeout)
        except TimeoutError:
            raise StageTimeout(
                f"stage {self.index}: no {what} for step {step} within {self.timeout:.0f}s"
            ) from None
        if item is None:
            raise self.failure or RuntimeError("link closed")
        self._show_depth(queue)
        return item

    # -- one step -------------------------------------------------------------------------------

    async def run_step(self, step: int, cut: bool = False) -> StepOutcome:
        """One optimizer step; ``cut`` (stage 0) marks it as a checkpoint cut for every stage."""
        start = time.perf_counter()
        w, n_micro = self.worker, self.worker.config.train.microbatches
        if self.rotation_ready is not None:
            await self.rotation_ready(step)
        w.begin_step(step)
        if self.step_begun is not None:
            self.step_begun(step, w)
        self._cut, self._peak_live = cut, 0
        chunks = self.batch_for_step(step).chunk(n_micro) if w.is_first else None
        fwd_wire = bwd_wire = 0
        self._busy, self._forwarded = 0.0, []
        own = self.routes.own
        for kind, position in stage_order(w.config.train.schedule, w.config.n_stages, w.index, len(own)):
            if kind == FORWARD:
                fwd_wire += await self._forward_next(step, own[position], chunks)
            else:
                bwd_wire += await self._backward_next(step, position)
        own_tokens = w.stats.tokens
        counts = StepCounts(
            w.stats.tokens, w.stats.loss_sum, w.stats.loss_count, fwd_wire, bwd_wire, self._cut
        )
        if self.averaging is not None:
            counts = await self.averaging.combine(step, w, counts)
            w.stats.tokens, w.stats.loss_sum, w.stats.loss_count = (
                counts.tokens,
                counts.loss_sum,
                counts.loss_count,
            )
        cut = counts.cut
        receive = functools.partial(self._receive_sync, step)
        stats = await run_over_links(end_step(w, step), self._send_sync, receive)
        if self.averaging is not None:  # outer steps sync after the optimizer step
            await self.averaging.after_step(step, w, cut)
        seconds = time.perf_counter() - start
        self._observe(step, stats, seconds)
        self.metrics.live_microbatches.labels(str(w.index)).set(self._peak_live)
        return StepOutcome(
            w.index,
            step,
            stats,
            counts.wire_bytes_forward,
            counts.wire_bytes_backward,
            seconds,
            cut,
            self._peak_live,
            self._busy,
            own_tokens,
        )

    async def _compute(self, kind: str, fn: Callable, *args):
        """``fn(*args)`` in a worker thread, timed into ``swarm_microbatch_compute_seconds``."""
        start = time.perf_counter()
        result = await asyncio.to_thread(fn, *args)
        emulation = self.worker.config.emulation
        if emulation.slow_stage == self.index:  # a slower device, emulated (benchmarks)
            await asyncio.sleep((emulation.slowdown - 1) * (time.perf_counter() - start))
        seconds = time.perf_counter() - start
        self._busy += seconds
        self.metrics.microbatch_compute.labels(str(self.index), kind).observe(seconds)
        return result

    async def _forward_next(self, step: int, mb: int, chunks) -> int:
        """The next microbatch forward (stage 0: microbatch ``mb``; others: what arrives next); bytes sent."""
        w = self.worker
        if w.is_first:
            frame = await self._compute("forward", w.forward, step, mb, chunks[mb])
            self._forwarded.append(mb)
        else:
            sender, received = await self._get(self._activations, "activation", step)
            self._cut = self._cut or received.cut
            frame = await self._forward(step, sender, received)
            self._forwarded.append(received.microbatch)
        self._peak_live = max(self._peak_live, w.live_microbatches)
        return 0 if w.is_last else await self._send_down(frame, self._cut)

    async def _backward_next(self, step: int, position: int) -> int:
        """The next microbatch backward (the last stage: the ``position``-th it forwarded; others: the
        next gradient to arrive); bytes sent."""
        w = self.worker
        if w.is_last:
            grad = await self._compute("backward", w.backward, step, self._forwarded[position])
        else:
            sender, received = await self._get(self._gradients, "gradient", step)
            grad = await self._backward(step, sender, received)
        return 0 if grad is None or w.is_first else await self._send_up(grad)

    async def _send_down(self, frame: ActivationFrame, cut: bool) -> int:
        frame = dataclasses.replace(frame, cut=cut) if cut else frame
        self._count_dense(self.index, "forward", "sent", frame)
        link = self.downstream_links[self.routes.downstream[frame.microbatch]]
        return await self._send(link, self.index, "forward", frame)

    async def _send_up(self, frame: GradientFrame) -> int:
        self._count_dense(self.index - 1, "backward", "sent", frame)
        link = self.upstream_links[self.routes.upstream[frame.microbatch]]
        return await self._send(link, self.index - 1, "backward", frame)

    async def _send(self, link, boundary: int, direction: str, frame) -> int:
        """Queue one microbatch's frame (the link transmits it while compute goes on), timing any
        backpressure into ``swarm_microbatch_wire_seconds``; its bytes."""
        start = time.perf_counter()
        sent = await link.send(frame)
        seconds = time.perf_counter() - start
        self._busy += seconds
        self.metrics.microbatch_wire.labels(str(boundary), direction).observe(seconds)
        return sent

    async def _forward(self, step: int, sender: str, frame: ActivationFrame):
        try:
            return await self._compute("forward", self.worker.forward, step, frame.microbatch, frame)
        except PayloadError as e:
            raise await self._reject(self.upstream_links[sender], self.index - 1, sender, e) from e

    async def _backward(self, step: int, sender: str, frame: GradientFrame):
        try:
            return await self._compute("backward", self.worker.backward, step, frame.microbatch, frame)
        except PayloadError as e:
            raise await self._reject(self.downstream_links[sender], self.index, sender, e) from e

    async def _reject(self, link, boundary: int, sender: str, error: PayloadError) -> Exception:
        """Answer a frame that failed validation with an ``Error`` and count it; the exception the step
        fails with: a stale subspace version as it is (a timing matter between honest peers), anything
        else as :class:`BadFrameError`, which gets the sender evicted."""
        stale = isinstance(error, StaleVersionError)
        code = stage_pb2.ERROR_CODE_SUBSPACE_VERSION if stale else stage_pb2.ERROR_CODE_BAD_PAYLOAD
        self.metrics.rejected.labels(rejection_reason(code)).inc()
        await link.send_error(code, str(error))
        if stale:
            return error
        return BadFrameError(f"boundary {boundary}: bad frame from the peer: {error}", boundary, sender)

    async def _send_sync(self, send: Send) -> None:
        await (self.downstream if send.downstream else self.upstream).send(send.sync)

    async def _receive_sync(self, step: int, receive: Receive) -> BoundarySync:
        queue = self._syncs_down if receive.downstream else self._syncs_up
        return await self._get(queue, receive.what, step)

    def _observe(self, step: int, stats: StageStats, seconds: float) -> None:
        stage = str(self.index)
        self.metrics.tokens.labels(stage).inc(stats.tokens)
        self.metrics.step.labels(stage).set(step)
        self.metrics.step_seconds.labels(stage).observe(seconds)
        self.metrics.stage_tokens_per_second.labels(stage).set(stats.tokens / seconds if seconds > 0 else 0.0)
        if stats.loss_count:
            self.metrics.loss.set(stats.loss_sum / stats.loss_count)
        if stats.off_subspace_fraction is not None:
            self.metrics.off_subspace.labels(stage).set(stats.off_subspace_fraction)
