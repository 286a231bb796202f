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
and the caller runs the round again without them, so no replica applies a partial average.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import AsyncIterator  # noqa: UP035 - hivemind's ServicerBase recognises typing's streams only

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.partition import TensorPartReducer
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter

JOIN_WAIT_S = 10.0  # a stream for a round this replica has not started yet waits this long for it


@dataclass(frozen=True)
class Round:
    """One averaging round: ``key`` (unique per stage and attempt), the members in order and the
    fraction of the vector each reduces."""

    key: str
    peers: tuple[PeerID, ...]
    fractions: tuple[float, ...]

    @property
    def group_id(self) -> bytes:
        members = ",".join(p.to_base58() for p in self.peers)
        return hashlib.sha256(f"{self.key}|{members}".encode()).digest()[:20]

    def without(self, silent: set[PeerID], key: str) -> Round:
        """The next attempt: the same round without the ``silent`` members."""
        kept = [(p, f) for p, f in zip(self.peers, self.fractions, strict=True) if p not in silent]
        if not kept:
            raise ValueError("no member of the round is left")
        return Round(key, tuple(p for p, _ in kept), tuple(f for _, f in kept))


def shares(numel: int, bandwidths: Sequence[float]) -> tuple[float, ...]:
    """How many of ``numel`` elements each member reduces, proportional to its bandwidth."""
    return tuple(float(x) for x in load_balance_peers(numel, list(bandwidths)))


class RoundFailed(RuntimeError):
    """A member went silent during the round; nothing was applied. ``silent``: who."""

    def __init__(self, silent: set[PeerID]):
        super().__init__(f"averaging round failed: {len(silent)} member(s) went silent")
        self.silent = silent


@dataclass(frozen=True)
class RoundStats:
    members: int
    bytes_sent: int  # tensor-part bytes this replica sent: its parts to reducers, averages to senders


class _Float64Reducer(TensorPartReducer):
    """hivemind's reducer sums into a default-dtype (float32) buffer; this one sums in float64."""

    def reset_accumulators(self):
        super().reset_accumulators()
        if getattr(self, "accumulator", None) is not None:  # finalize() deletes it
            self.accumulator = self.accumulator.double()


class _Runner(AllReduceRunner):
    """hivemind's runner, reducing in float64, remembering which members failed, counting bytes sent."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        shapes = tuple(part.shape for part in self.parts_for_local_averaging)
        self.tensor_part_reducer = _Float64Reducer(shapes, len(self.sender_peer_ids))
        self.failed: set[PeerID] = set()
        self.bytes_sent = 0
        self.serving = 0  # streams of other members this replica is still answering
        self.served = asyncio.Event()
        self.served.set()

    async def _communicate_with_peer(self, peer_id: PeerID):
        try:
            await super()._communicate_with_peer(peer_id)
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
        """Reduce a member's parts and send it the averages (counted)."""
        self.serving += 1
        self.served.clear()
        try:
            async for message in self.rpc_aggregate_part(stream, context):
                self.bytes_sent += len(message.tensor_part.buffer)
                yield message
        finally:
            self.serving -= 1
            if not self.serving:
                self.served.set()


class AveragingRouter(ServicerBase):
    """The all-reduce RPC of one P2P: each stream goes to the local runner of its group."""

    def __init__(self):
        self.rounds: dict[bytes, _Runner] = {}
        self.changed = asyncio.Condition()

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        first = await asyncio.wait_for(anext(stream), JOIN_WAIT_S)
        try:
            async with self.changed:
                started = self.changed.wait_for(lambda: first.group_id in self.rounds)
                await asyncio.wait_for(started, JOIN_WAIT_S)
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
    parts / returning averages before it is dropped and the round fails.
    """

    def __init__(self, p2p: P2P, namespace: str, sender_timeout: float = 5.0, reducer_timeout: float = 10.0):
        self.p2p, self.namespace = p2p, namespace
        self.sender_timeout, self.reducer_timeout = sender_timeout, reducer_timeout
        self.router = AveragingRouter()

    async def start(self) -> None:
        await self.router.add_p2p_handlers(self.p2p, namespace=self.namespace)

    async def stop(self) -> None:
        await self.router.remove_p2p_handlers(self.p2p, namespace=self.namespace)

    async def average(self, round_: Round, tensors: Sequence[torch.Tensor], weight: float) -> RoundStats:
        """Replace ``tensors`` in place by the ``weight``-weighted average over the round's members;
        :class:`RoundFailed` (tensors unchanged) if a member went silent."""
        work = [t.detach().to("cpu", torch.float64).contiguous() for t in tensors]
        runner = _Runner(
            p2p=self.p2p,
            servicer_type=AveragingRouter,
            prefix=self.namespace,
            group_id=round_.group_id,
            tensors=work,
            weight=weight,
            ordered_peer_ids=list(round_.peers),
            peer_fractions=round_.fractions,
            sender_timeout=self.sender_timeout,
            reducer_timeout=self.reducer_timeout,
        )
        await self.router.register(round_.group_id, runner)
        try:
            deltas = [delta async for delta in runner]
            # Done once the others have their averages too (bounded: a silent one is timed out).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(runner.served.wait(), self.reducer_timeout)
        finally:
            self.router.forget(round_.group_id)
        silent = runner.failed | runner.banned_senders
        if silent or runner.tensor_part_container.failed_size:
            raise RoundFailed(silent)
        for tensor, base, delta in zip(tensors, work, deltas, strict=True):
            tensor.copy_(base.add_(delta))
        return RoundStats(len(round_.peers), runner.bytes_sent)
