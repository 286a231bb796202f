"""Averaging one stage's gradients across its replicas with hivemind's butterfly all-reduce, in process.

Each replica holds a hivemind ``P2P`` (listening on loopback with NAT port mapping off unless
production says otherwise). :class:`ReplicaAverager` serves the all-reduce RPC once per P2P and
hands each incoming stream to the round it belongs to (by group id), waiting a moment for that
round to start locally, so replicas need no barrier before a round: whoever is first waits.

A round (:class:`Round`) names its group in order and the share of the flat vector each member
reduces (bandwidth-weighted, :func:`shares`). Tensors are averaged weighted by the samples each
replica processed. The exchange and the reduction run in float64: each member adds the reducer's
float64 delta to its own part, so float32 tensors end as the float32 rounding of the same float64
average on every member (a different last bit is possible only where the members' values nearly
cancel). A round in which a member went silent (sender or reducer timeout) fails as a whole
(:class:`RoundFailed`, naming the silent members): every replica keeps its tensors as they were,
and the caller runs the round again without them. There is no commit step: a member may
finish a round another member fails (a CANCELLED answer reached only some), so the caller must
agree on each round's outcome (the coordinator's job once replicas are wired in) before
applying it.
A reducer screens every part before summing it: a non-finite part, or one whose RMS exceeds
100x the reducer's own part of the same slice, drops its sender like a silent one and is counted
(:attr:`ReplicaAverager.offences`) so repeated offenders can be evicted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import AsyncIterator  # noqa: UP035 - hivemind's ServicerBase recognises typing's streams only

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES, AllreduceException, TensorPartReducer
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter

from swarm.runtime.norm_guard import root_mean_square

POISON_FACTOR = 100.0  # a part whose RMS exceeds this many times our own part of the slice is refused
JOIN_WAIT_S = 10.0  # a stream for a round this replica has not started yet waits this long for it


@dataclass(frozen=True)
class Round:
    """One averaging round: ``key`` (unique per stage and attempt), the members in order, the
    fraction of the vector each reduces, and each one's weight (the samples it processed, as
    the group agreed: a member may not weigh itself more than that)."""

    key: str
    peers: tuple[PeerID, ...]
    fractions: tuple[float, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not len(self.peers) == len(self.fractions) == len(self.weights):
            raise ValueError("a round needs a fraction and a weight per member")
        if not all(math.isfinite(w) and w > 0 for w in self.weights):
            raise ValueError("member weights must be finite and positive")

    def weight_of(self, peer: PeerID) -> float:
        return self.weights[self.peers.index(peer)]

    @property
    def group_id(self) -> bytes:
        members = ",".join(p.to_base58() for p in self.peers)
        return hashlib.sha256(f"{self.key}|{members}".encode()).digest()[:20]

    def without(self, silent: set[PeerID], key: str) -> Round:
        """The next attempt: the same round without the ``silent`` members."""
        kept = [m for m in zip(self.peers, self.fractions, self.weights, strict=True) if m[0] not in silent]
        if not kept:
            raise ValueError("no member of the round is left")
        peers, fractions, weights = zip(*kept, strict=True)
        return Round(key, peers, fractions, weights)


def shares(numel: int, bandwidths: Sequence[float]) -> tuple[float, ...]:
    """How many of ``numel`` elements each member reduces, proportional to its bandwidth."""
    return tuple(float(x) for x in load_balance_peers(numel, list(bandwidths)))


class RoundFailed(RuntimeError):
    """The round lost a member; nothing was applied. ``silent``: members this replica lost contact
    with; ``poisoned``: members whose parts it refused; ``aborted_by``: reducers that cancelled the
    round because they dropped someone. The next group leaves out what the members' reports name
    as silent or poisoned."""

    def __init__(
        self, silent: set[PeerID], poisoned: set[PeerID], aborted_by: set[PeerID], implausible: bool = False
    ):
        what = "returned an implausible average" if implausible else "cancelled"
        super().__init__(
            f"averaging round failed: {len(silent)} member(s) silent, {len(poisoned)} poisoned, "
            f"{len(aborted_by)} reducer(s) {what}"
        )
        self.silent, self.poisoned, self.aborted_by = silent, poisoned, aborted_by
        self.implausible = implausible  # a reducer (which one is unknown) returned non-finite or huge values


class PoisonedPart(ValueError):
    """A member's part is non-finite or far larger than this replica's own part of the same slice."""


def poison(part: torch.Tensor, own: torch.Tensor, factor: float) -> str | None:
    """Why ``part`` must not be summed (None: it may): non-finite values, or an RMS above
    ``factor`` x this replica's ``own`` part (an honest reference from the same round)."""
    if not bool(torch.isfinite(part).all()):
        return "non-finite values"
    theirs, mine = root_mean_square(part), root_mean_square(own)
    if mine > 0 and theirs > factor * mine:
        return f"RMS {theirs:.3g} is over {factor:g} x this replica's {mine:.3g}"
    return None


@dataclass(frozen=True)
class RoundStats:
    members: int
    bytes_sent: int  # tensor-part bytes this replica sent: its parts to reducers, averages to senders


class _ScreeningReducer(TensorPartReducer):
    """hivemind's reducer, summing in float64 (its own buffer has the default dtype, float32) and
    handing every part, as hivemind deserialized it, to ``screen(sender index, part index, part,
    weight)`` before it is summed (``screen`` raises to refuse it)."""

    def __init__(
        self, part_shapes, num_senders: int, screen: Callable[[int, int, torch.Tensor, float], None]
    ):
        self.screen = screen
        super().__init__(part_shapes, num_senders)

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        self.screen(sender_index, part_index, tensor_part, weight)
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight)

    def reset_accumulators(self):
        super().reset_accumulators()
        if getattr(self, "accumulator", None) is not None:  # finalize() deletes it
            self.accumulator = self.accumulator.double()


class _Runner(AllReduceRunner):
    """hivemind's runner, reducing in float64, remembering which members failed, counting bytes sent."""

    def __init__(self, round_: Round, **kwargs):
        super().__init__(**kwargs)
        self.round = round_
        shapes = tuple(part.shape for part in self.parts_for_local_averaging)
        self.tensor_part_reducer.finished.set()  # hivemind's, unused: collected without a warning
        self.tensor_part_reducer = _ScreeningReducer(shapes, len(self.sender_peer_ids), self._screen)
        self.failed: set[PeerID] = set()
        self.aborted_by: set[PeerID] = set()
        self.bytes_sent = 0
        self.serving = 0  # streams of other members this replica is still answering
        self.served = asyncio.Event()
        self.served.set()
        self.poisoned: set[PeerID] = set()
        self.poison_factor = POISON_FACTOR

    async def _communicate_with_peer(self, peer_id: PeerID):
        try:
            await super()._communicate_with_peer(peer_id)
        except AllreduceException as e:
            # hivemind names the code a reducer answered with: CANCELLED is a reducer that dropped
            # another member and will not return a partial average (see serve), not a silent one.
            cancelled = averaging_pb2.MessageCode.Name(averaging_pb2.CANCELLED)
            (self.aborted_by if str(e).endswith(f"sent {cancelled}") else self.failed).add(peer_id)
            raise
        except BaseException:
            self.failed.add(peer_id)
            raise

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self.bytes_sent += len(message.tensor_part.buffer)
            yield message

    async def serve(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Reduce a member's parts and send it the averages (counted); once this reducer has dropped
        a member, the others get CANCELLED instead of an average without it."""
        self.serving += 1
        self.served.clear()
        try:
            async for message in self.rpc_aggregate_part(stream, context):
                if self.banned_senders:
                    yield averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED)
                    return
                self.bytes_sent += len(message.tensor_part.buffer)
                yield message
        finally:
            self.serving -= 1
            if not self.serving:
                self.served.set()

    def _screen(self, sender_index: int, part_index: int, part: torch.Tensor, weight: float) -> None:
        """Refuse another member's part (:class:`PoisonedPart`; hivemind's runner then drops the
        sender) that claims another weight than the agreed one, or that :func:`poison` refuses."""
        sender = self.sender_peer_ids[sender_index]
        if sender == self.peer_id:
            return
        agreed = self.round.weight_of(sender)
        problem = (
            f"weighs its parts {weight}, not the agreed {agreed}"
            if not math.isclose(weight, agreed, rel_tol=1e-9)
            else poison(part, self.parts_for_local_averaging[part_index], self.poison_factor)
        )
        if problem is not None:
            self.poisoned.add(sender)
            raise PoisonedPart(f"part {part_index} from {sender}: {problem}")


class AveragingRouter(ServicerBase):
    """The all-reduce RPC of one P2P: each stream goes to the local runner of its group."""

    def __init__(self, join_wait: float = JOIN_WAIT_S):
        self.join_wait = join_wait
        self.rounds: dict[bytes, _Runner] = {}
        self.changed = asyncio.Condition()

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        first = await asyncio.wait_for(anext(stream), self.join_wait)
        try:
            async with self.changed:
                started = self.changed.wait_for(lambda: first.group_id in self.rounds)
                await asyncio.wait_for(started, self.join_wait)
        except TimeoutError:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        runner = self.rounds[first.group_id]
        async for message in runner.serve(achain(as_aiter(first), stream), context):
            yield message

    async def register(self, group_id: bytes, runner: _Runner) -> None:
        async with self.changed:
            self.rounds[group_id] = runner
            self.changed.notify_all()

    def forget(self, group_id: bytes) -> None:
        self.rounds.pop(group_id, None)


class ReplicaAverager:
    """Averages tensors with the other replicas of a stage over ``p2p`` (``namespace``: one per stage).

    ``sender_timeout`` / ``reducer_timeout``: how long a member may stay silent while sending its
    parts / returning averages before it is dropped and the round fails; ``join_wait``: how long a
    member's stream waits for this replica to start the same round.
    """

    def __init__(
        self,
        p2p: P2P,
        namespace: str,
        sender_timeout: float = 5.0,
        reducer_timeout: float = 10.0,
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
        join_wait: float = JOIN_WAIT_S,
    ):
        self.p2p, self.namespace = p2p, namespace
        self.sender_timeout, self.reducer_timeout = sender_timeout, reducer_timeout
        self.part_size_bytes = part_size_bytes  # the vector is cut into parts of this size, dealt by share
        self.join_wait = join_wait
        self.router = AveragingRouter(join_wait)
        self.offences: collections.Counter[PeerID] = collections.Counter()  # poisoned parts seen, by member

    async def start(self) -> None:
        await self.router.add_p2p_handlers(self.p2p, namespace=self.namespace)

    async def stop(self) -> None:
        await self.router.remove_p2p_handlers(self.p2p, namespace=self.namespace)

    async def average(self, round_: Round, tensors: Sequence[torch.Tensor]) -> RoundStats:
        """Replace ``tensors`` in place by the weighted average over the round's members;
        :class:`RoundFailed` (tensors unchanged) if the round lost a member."""
        work = [t.detach().to("cpu", torch.float64).contiguous() for t in tensors]
        runner = _Runner(
            round_,
            p2p=self.p2p,
            servicer_type=AveragingRouter,
            prefix=self.namespace,
            group_id=round_.group_id,
            tensors=work,
            weight=round_.weight_of(self.p2p.peer_id),
            ordered_peer_ids=list(round_.peers),
            peer_fractions=round_.fractions,
            sender_timeout=self.sender_timeout,
            reducer_timeout=self.reducer_timeout,
            part_size_bytes=self.part_size_bytes,
        )
        await self.router.register(round_.group_id, runner)

        async def collect() -> list[torch.Tensor]:
            return [delta async for delta in runner]

        # hivemind times out each silent chunk; this bounds the round as a whole (a member that
        # never starts, or trickles), so a caller never waits forever
        limit = self.join_wait + 2 * (self.sender_timeout + self.reducer_timeout)
        try:
            try:
                deltas = await asyncio.wait_for(collect(), limit)
            except TimeoutError:
                others = set(round_.peers) - {self.p2p.peer_id}
                raise RoundFailed(others - runner.poisoned, runner.poisoned, runner.aborted_by) from None
            # Done once the others have their averages too (bounded: a silent one is timed out).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(runner.served.wait(), self.reducer_timeout)
        finally:
            self.router.forget(round_.group_id)
        silent = (runner.failed | runner.banned_senders) - runner.poisoned
        if silent or runner.poisoned or runner.aborted_by or runner.tensor_part_container.failed_size:
            self.offences.update(runner.poisoned)
            raise RoundFailed(silent, runner.poisoned, runner.aborted_by)
        results = [base + delta for base, delta in zip(work, deltas, strict=True)]
        for base, result in zip(work, results, strict=True):
            # A reducer could return anything: an average of finite parts is finite and no larger
            # than the largest of them, so one far larger than our own part is refused.
            if poison(result, base, POISON_FACTOR) is not None:
                raise RoundFailed(set(), set(), set(round_.peers) - {self.p2p.peer_id}, implausible=True)
        for tensor, result in zip(tensors, results, strict=True):
            tensor.copy_(result)
        return RoundStats(len(round_.peers), runner.bytes_sent)
