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
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from node.links import BadFrameError, rejection_reason
from swarm._proto.swarm.v1 import stage_pb2
from swarm.codecs.base import PayloadError, StaleVersionError
from swarm.mapl import pack_gradients, sum_gradients, unpack_gradients
from swarm.metrics import Metrics
from swarm.wire import ActivationFrame, BoundarySync, GradientFrame
from swarm.worker import StageStats, StageWorker

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


class StageRunner:
    """Runs one :class:`StageWorker` against its two links, one step at a time."""

    def __init__(
        self,
        worker: StageWorker,
        metrics: Metrics,
        batch_for_step: Callable[[int], torch.Tensor] | None = None,
        rotation_ready: Callable[[int], Awaitable[None]] | None = None,
        timeout: float = 300.0,
    ):
        self.worker, self.metrics, self.timeout = worker, metrics, timeout
        self.batch_for_step, self.rotation_ready = batch_for_step, rotation_ready
        self.upstream = None  # link to stage index-1 (StageLink or LocalLink)
        self.downstream = None  # link to stage index+1
        self._activations: asyncio.Queue[ActivationFrame] = asyncio.Queue()
        self._gradients: asyncio.Queue[GradientFrame] = asyncio.Queue()
        self._syncs_up: asyncio.Queue[BoundarySync] = asyncio.Queue()
        self._syncs_down: asyncio.Queue[BoundarySync] = asyncio.Queue()
        self.failure: Exception | None = None

    @property
    def index(self) -> int:
        return self.worker.index

    # -- delivery from links --------------------------------------------------------------------

    def deliver_from_upstream(self, item) -> None:
        if isinstance(item, ActivationFrame):
            self._count_dense(self.index - 1, "forward", "received", item)
            self._enqueue(self._activations, item, self.index - 1)
        else:
            self._enqueue(self._syncs_up, item, self.index - 1)

    def deliver_from_downstream(self, item) -> None:
        if isinstance(item, GradientFrame):
            self._count_dense(self.index, "backward", "received", item)
            self._enqueue(self._gradients, item, self.index)
        else:
            self._enqueue(self._syncs_down, item, self.index)

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
        if w.config.train.schedule == "1f1b":
            warmup = min(w.config.n_stages - 1 - w.index, n_micro)
            order = ["F"] * warmup + ["F", "B"] * (n_micro - warmup) + ["B"] * warmup
            last_backwards = iter(range(n_micro))  # the last stage backpropagates in forward order
        else:
            order = ["F"] * n_micro + ["B"] * n_micro
            last_backwards = iter(reversed(range(n_micro)))
        forwards = iter(range(n_micro))
        for op in order:
            if op == "F":
                fwd_wire += await self._forward_next(step, next(forwards), chunks)
            else:
                bwd_wire += await self._backward_next(step, last_backwards)
        cut = self._cut
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
        return StepOutcome(w.index, step, stats, fwd_wire, bwd_wire, seconds, cut, self._peak_live)

    async def _compute(self, kind: str, fn: Callable, *args):
        """``fn(*args)`` in a worker thread, timed into ``swarm_microbatch_compute_seconds``."""
        start = time.perf_counter()
        result = await asyncio.to_thread(fn, *args)
        self.metrics.microbatch_compute.labels(str(self.index), kind).observe(time.perf_counter() - start)
        return result

    async def _forward_next(self, step: int, mb: int, chunks) -> int:
        """The next microbatch forward (stage 0: microbatch ``mb``; others: what arrives next); bytes sent."""
        w = self.worker
        if w.is_first:
            frame = await self._compute("forward", w.forward, step, mb, chunks[mb])
        else:
            received = await self._get(self._activations, "activation", step)
            self._cut = self._cut or received.cut
            frame = await self._forward(step, received)
        self._peak_live = max(self._peak_live, w.live_microbatches)
        return 0 if w.is_last else await self._send_down(frame, self._cut)

    async def _backward_next(self, step: int, last_stage_order) -> int:
        """The next microbatch backward (the last stage: in ``last_stage_order``; others: the next
        gradient to arrive); bytes sent."""
        w = self.worker
        if w.is_last:
            grad = await self._compute("backward", w.backward, step, next(last_stage_order))
        else:
            grad = await self._backward(step, await self._get(self._gradients, "gradient", step))
        return 0 if grad is None or self.upstream is None else await self._send_up(grad)

    async def _send_down(self, frame: ActivationFrame, cut: bool) -> int:
        frame = dataclasses.replace(frame, cut=cut) if cut else frame
        self._count_dense(self.index, "forward", "sent", frame)
        return await self._send(self.downstream, self.index, "forward", frame)

    async def _send_up(self, frame: GradientFrame) -> int:
        self._count_dense(self.index - 1, "backward", "sent", frame)
        return await self._send(self.upstream, self.index - 1, "backward", frame)

    async def _send(self, link, boundary: int, direction: str, frame) -> int:
        """Queue one microbatch's frame (the link transmits it while compute goes on), timing any
        backpressure into ``swarm_microbatch_wire_seconds``; its bytes."""
        start = time.perf_counter()
        sent = await link.send(frame)
        self.metrics.microbatch_wire.labels(str(boundary), direction).observe(time.perf_counter() - start)
        return sent

    async def _forward(self, step: int, frame: ActivationFrame):
        try:
            return await self._compute("forward", self.worker.forward, step, frame.microbatch, frame)
        except PayloadError as e:
            raise await self._reject(self.upstream, self.index - 1, e) from e

    async def _backward(self, step: int, frame: GradientFrame):
        try:
            return await self._compute("backward", self.worker.backward, step, frame.microbatch, frame)
        except PayloadError as e:
            raise await self._reject(self.downstream, self.index, e) from e

    async def _reject(self, link, boundary: int, error: PayloadError) -> Exception:
        """Answer a frame that failed validation with an ``Error`` and count it; the exception the step
        fails with: a stale subspace version as it is (a timing matter between honest peers), anything
        else as :class:`BadFrameError`, which gets the sender evicted."""
        stale = isinstance(error, StaleVersionError)
        code = stage_pb2.ERROR_CODE_SUBSPACE_VERSION if stale else stage_pb2.ERROR_CODE_BAD_PAYLOAD
        self.metrics.rejected.labels(rejection_reason(code)).inc()
        await link.send_error(code, str(error))
        if stale:
            return error
        return BadFrameError(f"boundary {boundary}: bad frame from the peer: {error}", boundary)

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
