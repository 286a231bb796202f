"""The microbatch schedule of one hosted stage over real boundary streams: GPipe or 1F1B.

GPipe (``train.schedule = "gpipe"``): stage 0 sends every microbatch forward as soon as it
is computed (sends are queued, so compute overlaps the wire); middle stages forward what
arrives; the last stage computes the loss of all microbatches, then sends their
gradients back in reverse order; every stage backpropagates gradients as they arrive.
1F1B (``"1f1b"``, PipeDream-flush): stage s of P runs ``min(P - 1 - s, M)`` forwards,
then alternates one forward and one backward, then drains the remaining backwards, so
it holds at most ``P - s`` microbatches' activations instead of all ``M``; the gradients
are GPipe's up to the order of fp32 accumulation. Then neighbours
exchange boundary state (MAPL gradient shares, RVQ codebook deltas), the optimizer
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
from swarm.core.mapl import pack_gradients, sum_gradients, unpack_gradients
from swarm.ops.metrics import Metrics
from swarm.runtime.replicas import Routes
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
        self._cut, self._peak_live = cut, 0
        chunks = self.batch_for_step(step).chunk(n_micro) if w.is_first else None
        fwd_wire = bwd_wire = 0
        self._busy, self._forwarded = 0.0, []
        own = self.routes.own
        one_f_one_b = w.config.train.schedule == "1f1b"
        if one_f_one_b:
            warmup = min(w.config.n_stages - 1 - w.index, len(own))
            order = ["F"] * warmup + ["F", "B"] * (len(own) - warmup) + ["B"] * warmup
        else:
            order = ["F"] * len(own) + ["B"] * len(own)
        forwards = iter(own)
        for op in order:
            if op == "F":
                fwd_wire += await self._forward_next(step, next(forwards), chunks)
            else:
                # the last stage backpropagates in the order it forwarded (1F1B) or reversed (GPipe)
                bwd_wire += await self._backward_next(step, 0 if one_f_one_b else -1)
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
        await self._exchange_mapl_shares(step)
        stats = await asyncio.to_thread(w.optimizer_step, step)
        delta = await asyncio.to_thread(w.codebook_delta)
        if delta is not None:
            await self.downstream.send(BoundarySync(step, w.index, codebook_delta=delta))
        if self.upstream is not None and w.inbound.forward_format.name == "rvq":
            # This step's delta, applied now: both sides end every step at the same codebook
            # version, so a snapshot cut after it holds one consistent boundary state.
            sync = await self._get(self._syncs_up, "codebook delta", step)
            w.apply_codebook_delta(sync.codebook_delta)
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

    async def _backward_next(self, step: int, last_stage_pick: int) -> int:
        """The next microbatch backward (the last stage: the forwarded one at ``last_stage_pick``,
        0 the oldest or -1 the newest; others: the next gradient to arrive); bytes sent."""
        w = self.worker
        if w.is_last:
            grad = await self._compute("backward", w.backward, step, self._forwarded.pop(last_stage_pick))
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

    async def _exchange_mapl_shares(self, step: int) -> None:
        """Send this side's MAPL gradient shares, add the neighbours' (the sum is identical on both)."""
        w = self.worker
        if "out" in w.mapl:
            share = w.boundary_gradients("out")
            await self.downstream.send(BoundarySync(step, w.index, mapl_gradients=pack_gradients(share)))
        if "in" in w.mapl:
            share_in = w.boundary_gradients("in")
            await self.upstream.send(BoundarySync(step, w.index - 1, mapl_gradients=pack_gradients(share_in)))
            peer = await self._get(self._syncs_up, "MAPL gradient share", step)
            w.set_boundary_gradients(
                "in", sum_gradients(unpack_gradients(peer.mapl_gradients, w.mapl["in"]), share_in)
            )
        if "out" in w.mapl:
            peer = await self._get(self._syncs_down, "MAPL gradient share", step)
            w.set_boundary_gradients(
                "out", sum_gradients(share, unpack_gradients(peer.mapl_gradients, w.mapl["out"]))
            )

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
