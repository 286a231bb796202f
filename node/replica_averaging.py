"""The replicas of a stage average their gradients after every step, over hivemind's all-reduce.

Each replica contributes per-microbatch means (its gradients and its step's counts: tokens,
loss, wire bytes, the cut mark), weighted by the microbatches it processed; the weighted
average times the step's microbatch count gives every replica the sums over the whole step:
the gradient one replica would compute on the global batch (the loss is already divided by
the step's microbatch count), the stage's tokens and loss. On the steps a boundary statistic
is reported, the statistic each replica accumulated on its own microbatches is summed too.

With ``replica_sync.mode = "outer"`` only the counts (and statistic) are summed every step;
each replica steps on its own gradient (scaled to the mean over its own microbatches), and
every ``replica_sync.every`` steps, at checkpoint cuts and at the end, the replicas average
their pseudo-gradients and take the outer step (:mod:`swarm.runtime.outer_step`); with
``replica_sync.overlap`` the round runs behind the next inner steps (:meth:`ReplicaGroup.after_step`).

A round that loses a member fails the step with :class:`ReplicaLost` naming it (or, for a
refused part, :class:`ReplicaPoisoned`, which gets the sender evicted); the coordinator then
starts a new epoch without it from the latest cut, as for any lost neighbour.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr
from swarm.node.links import BadFrameError, LinkError
from swarm.node.schedule import StepCounts

from swarm.ops.logs import say
from swarm.ops.metrics import Metrics
from swarm.runtime.averaging import ReplicaAverager, Round, RoundFailed, RoundStats, shares
from swarm.runtime.outer_step import OuterStep, sync_due
from swarm.runtime.sync_formats import SyncFormat
from swarm.runtime.worker import StageWorker


class ReplicaLost(LinkError):
    """A sibling replica went silent during the averaging round (``peer_node_id``: which)."""


class ReplicaPoisoned(BadFrameError):
    """A sibling replica's part of the averaging round was refused (non-finite, huge, overweight)."""


@dataclass(frozen=True)
class Sibling:
    """One replica of the stage as the plan lists it."""

    node_id: str
    address: str  # P2P multiaddr ending in /p2p/<peer id>
    microbatches: int

    @property
    def peer_id(self) -> PeerID:
        return PeerID.from_base58(self.address.rsplit("/p2p/", 1)[-1])


class ReplicaGroup:
    """Averages one stage's step with its sibling replicas (a :class:`~swarm.node.schedule.StageAveraging`).

    ``key`` names the stage in this epoch (rounds add the step); ``me`` is this node's id;
    ``statistic_due(step)``: whether the boundary statistic is reported after ``step``.
    """

    def __init__(
        self,
        averager: ReplicaAverager,
        key: str,
        siblings: Sequence[Sibling],
        me: str,
        statistic_due: Callable[[int], bool],
        metrics: Metrics,
    ):
        self.averager, self.key, self.siblings = averager, key, list(siblings)
        self.me = next(s for s in self.siblings if s.node_id == me)
        self.statistic_due = statistic_due
        self.total = sum(s.microbatches for s in self.siblings)
        self.node_of = {s.peer_id: s.node_id for s in self.siblings}
        self.metrics, self.stage = metrics, key.rsplit("/", 1)[-1]
        self.rounds = self.bytes_sent = 0
        self.seconds = 0.0
        self.syncs = self.sync_bytes = 0
        # an overlapped sync in flight: (its round, the step it lands after, the tensors it averages)
        self._pending: tuple[asyncio.Future, int, list[torch.Tensor]] | None = None

    async def connect(self) -> None:
        """Open the P2P connections to the other replicas (their addresses are in the plan)."""
        for s in self.siblings:
            if s is not self.me:
                maddr = Multiaddr(s.address).decapsulate(Multiaddr(f"/p2p/{s.peer_id}"))
                await self.averager.p2p._client.connect(s.peer_id, [maddr])
        say(
            f"{self.key}: one of {len(self.siblings)} replicas, {self.me.microbatches} of "
            f"{self.total} microbatches per step"
        )

    async def combine(self, step: int, worker: StageWorker, counts: StepCounts) -> StepCounts:
        params = worker.parameters()
        summed: list[torch.Tensor] = []
        if worker.config.replica_sync.mode == "outer":
            worker.outer = worker.outer or OuterStep(params, worker.config.replica_sync)
            scale = self.total / self.me.microbatches  # the mean over this replica's own microbatches
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        else:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            summed = [p.grad for p in params]
        vector = torch.tensor(
            [
                counts.tokens,
                counts.loss_sum,
                counts.loss_count,
                counts.wire_bytes_forward,
                counts.wire_bytes_backward,
                float(counts.cut),
            ],
            dtype=torch.float64,
        )
        statistic = worker.statistic if self.statistic_due(step) else None
        if statistic is not None:
            energies = torch.tensor(
                [statistic.off_energy, statistic.total_energy, statistic.count], dtype=torch.float64
            )
            summed += [statistic.gram_times_basis, energies]
        means = [t.detach().to("cpu", torch.float64) / self.me.microbatches for t in (*summed, vector)]
        numel = sum(t.numel() for t in means)
        round_ = Round(
            f"{self.key}/{step}",
            tuple(s.peer_id for s in self.siblings),
            shares(numel, [1.0] * len(self.siblings)),
            tuple(float(s.microbatches) for s in self.siblings),
        )
        gradients = 0 if worker.config.replica_sync.mode == "outer" else len(params)
        stats, seconds = await self._average(round_, means, screened=gradients)
        self.rounds, self.bytes_sent, self.seconds = (
            self.rounds + 1,
            self.bytes_sent + stats.bytes_sent,
            self.seconds + seconds,
        )
        totals = [t * self.total for t in means]
        for target, total in zip(summed, totals, strict=False):
            target.copy_(total)
        if statistic is not None:
            statistic.off_energy, statistic.total_energy = totals[-2][0].item(), totals[-2][1].item()
            statistic.count = round(totals[-2][2].item())
        v = totals[-1].tolist()
        return StepCounts(round(v[0]), v[1], round(v[2]), round(v[3]), round(v[4]), v[5] > 0.5)

    async def after_step(self, step: int, worker: StageWorker, cut: bool) -> None:
        """After the optimizer step of an outer-step run: apply an overlapped sync whose inner steps
        are done, and on a sync step (``cut``: the step is a checkpoint cut) average the
        pseudo-gradients and take the outer step, at once or (``replica_sync.overlap``) that many
        steps later; cuts and the last step wait for theirs."""
        config, outer = worker.config, worker.outer
        if outer is None:
            return
        sync, last = config.replica_sync, step == config.train.steps - 1
        cut = cut or config.checkpoint.is_cut(step, config.train.steps)
        due = sync_due(sync, step, config.train.steps, cut)
        if self._pending is not None and (step >= self._pending[1] or due):
            await self._land(outer)
        if not due:
            return
        overlapped = sync.overlap > 0 and not cut and not last
        sent = outer.pseudo_gradient(overlapped)
        round_ = Round(
            f"{self.key}/{step}/outer",
            tuple(s.peer_id for s in self.siblings),
            shares(sum(t.numel() for t in sent), [1.0] * len(self.siblings)),
            tuple(float(s.microbatches) for s in self.siblings),
        )
        task = asyncio.ensure_future(self._average(round_, sent, outer.format))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # an abandoned one: no warning
        self._pending = (task, step + sync.overlap, sent)
        if not overlapped:
            await self._land(outer)

    async def _land(self, outer: OuterStep) -> None:
        """Wait for the pending sync's all-reduce (its failure fails this step) and take its outer step."""
        task, _, sent = self._pending
        self._pending = None
        stats, seconds = await task
        outer.apply(sent)
        self.syncs, self.sync_bytes = self.syncs + 1, self.sync_bytes + stats.bytes_sent
        self.seconds += seconds

    async def _average(
        self,
        round_: Round,
        tensors: list[torch.Tensor],
        fmt: SyncFormat | None = None,
        screened: int | None = None,
    ) -> tuple[RoundStats, float]:
        """One round (its failure: the replica it lost), counted in the metrics; its stats and seconds."""
        start = time.perf_counter()
        try:
            stats = await self.averager.average(round_, tensors, fmt, screened)
        except RoundFailed as e:
            raise self._lost(e) from e
        seconds = time.perf_counter() - start
        self.metrics.averaging_bytes.labels(self.stage).inc(stats.bytes_sent)
        self.metrics.averaging_seconds.labels(self.stage).observe(seconds)
        return stats, seconds

    def summary(self) -> str:
        """What averaging cost this replica so far (printed at the end of an epoch): per-step rounds
        (bytes and seconds per round include the outer syncs'), and outer syncs if any."""
        per_round = (self.bytes_sent + self.sync_bytes) / self.rounds if self.rounds else 0
        seconds = self.seconds / self.rounds if self.rounds else 0.0
        line = (
            f"stage {self.stage} averaging: {self.rounds} rounds, {per_round:.0f} bytes sent "
            f"and {seconds:.3f} s per round"
        )
        if self.syncs:
            line += f"; {self.syncs} outer syncs, {self.sync_bytes / self.syncs:.0f} bytes sent per sync"
        return line

    def _lost(self, failure: RoundFailed) -> LinkError:
        """The error the step fails with, naming a replica the round lost (poisoned first)."""
        for members, kind in ((failure.poisoned, ReplicaPoisoned), (failure.silent, ReplicaLost)):
            if members:
                node = self.node_of.get(min(members, key=str), "")
                return kind(f"stage averaging: {failure}", None, node)
        return ReplicaLost(f"stage averaging: {failure}")
