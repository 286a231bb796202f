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
100x the reducer's own part of the same slice and 100x its whole gradient's RMS (``screened``),
drops its sender like a silent one and is counted
(:attr:`ReplicaAverager.offences`) so repeated offenders can be evicted.

A round may send its tensors in a :class:`~swarm.runtime.sync_formats.SyncFormat` (outer steps'
pseudo-gradients) instead of float64: every member rounds its tensors to the format, sends its
parts encoded, and each reducer encodes the float64 average of its slice once and sends those
same bytes to every member, itself included: every member ends with the same values, bit for bit.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import AsyncIterator  # noqa: UP035 - hivemind's ServicerBase recognises typing's streams only

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.partition import (
    DEFAULT_PART_SIZE_BYTES,
    AllreduceException,
    BannedException,
    TensorPartContainer,
    TensorPartReducer,
)
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import achain, as_aiter

from swarm.runtime.norm_guard import root_mean_square
from swarm.runtime.sync_formats import SyncFormat

log = logging.getLogger(__name__)

POISON_FACTOR = 100.0  # a part whose RMS exceeds this many times our own (part, whole) is refused
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


def poison(part: torch.Tensor, own: torch.Tensor, factor: float, floor: float = 0.0) -> str | None:
    """Why ``part`` must not be summed (None: it may): non-finite values, or an RMS above
    ``factor`` x this replica's ``own`` part (an honest reference from the same round), or x
    ``floor`` where that is larger (a slice that is nearly zero here, such as output-head rows
    of tokens only another replica's microbatches hold, may be far larger elsewhere)."""
    if not bool(torch.isfinite(part).all()):
        return "non-finite values"
    theirs, mine = root_mean_square(part), max(root_mean_square(own), floor)
    if mine > 0 and theirs > factor * mine:
        return f"RMS {theirs:.3g} is over {factor:g} x this replica's {mine:.3g}"
    return None


@dataclass(frozen=True)
class RoundStats:
    members: int
    bytes_sent: int  # tensor-part bytes this replica sent: its parts to reducers, averages to senders


class _Encoded(CompressionBase):
    """hivemind's compression hook for a :class:`SyncFormat`: a part travels as its encoded bytes
    (a uint8 tensor, which hivemind's own deserializer restores; the receiver decodes it). Parts
    hold a multiple of the format's alignment, so their encoding loses nothing of a rounded vector."""

    compression_type = runtime_pb2.CompressionType.NONE

    def __init__(self, fmt: SyncFormat, part_size_bytes: int):
        self.fmt = fmt
        per_value = max(1, fmt.wire_bytes(1 << 20) >> 20)
        self.part_values = max(1, part_size_bytes // per_value // fmt.alignment) * fmt.alignment
        self.part_size_bytes = part_size_bytes

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        return serialize_torch_tensor(self.fmt.encode(tensor))

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return deserialize_torch_tensor(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # hivemind cuts parts of int(part_size_bytes / (element size x ratio)) values: part_values
        itemsize = torch.empty((), dtype=info.descriptor.dtype).element_size()
        return self.part_size_bytes / (itemsize * (self.part_values + 0.5))


class _UndecodableAverage(ValueError):
    """A reducer answered with bytes that are not an average in the round's format."""


class _DecodingContainer(TensorPartContainer):
    """hivemind's container for a round in a :class:`SyncFormat`: reducers return averages (not
    deltas) as encoded bytes, decoded here; anything else is refused."""

    def __init__(self, fmt: SyncFormat, *args, **kwargs):
        self.fmt = fmt
        super().__init__(*args, return_deltas=False, **kwargs)

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor):
        local = self._input_parts_by_peer[peer_index][part_index][0]
        try:
            average = self.fmt.decode(part, local.numel()).view_as(local)
        except ValueError as e:
            raise _UndecodableAverage(str(e)) from None
        super().register_processed_part(peer_index, part_index, average)

    def register_failed_reducer(self, peer_index: int):
        # our own values in place of the lost average (the round fails, as hivemind counts them)
        for part_index in range(
            self._outputs_registered_by_peer[peer_index], self.num_parts_by_peer[peer_index]
        ):
            local = self._input_parts_by_peer[peer_index][part_index][0]
            self.register_processed_part(peer_index, part_index, self.fmt.encode(local))
            self.failed_size += local.numel()


class _ScreeningReducer(TensorPartReducer):
    """hivemind's reducer, summing in float64 (its own buffer has the default dtype, float32) what
    ``screen(sender index, part index, part, weight)`` makes of every part as hivemind deserialized
    it (the part, decoded where the round has a format; ``screen`` raises to refuse it)."""

    def __init__(
        self, part_shapes, num_senders: int, screen: Callable[[int, int, torch.Tensor, float], torch.Tensor]
    ):
        self.screen = screen
        super().__init__(part_shapes, num_senders)

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        tensor_part = self.screen(sender_index, part_index, tensor_part, weight)
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight)

    def reset_accumulators(self):
        super().reset_accumulators()
        if getattr(self, "accumulator", None) is not None:  # finalize() deletes it
            self.accumulator = self.accumulator.double()


class _Runner(AllReduceRunner):
    """hivemind's runner, reducing in float64, remembering which members failed, counting bytes sent;
    with a ``fmt``, sending parts and averages in it (see the module docstring)."""

    def __init__(self, round_: Round, fmt: SyncFormat | None = None, **kwargs):
        if fmt is not None:
            kwargs["compression"] = _Encoded(fmt, kwargs.get("part_size_bytes", DEFAULT_PART_SIZE_BYTES))
        super().__init__(**kwargs)
        self.round, self.fmt = round_, fmt
        self.encoded_averages: dict[int, torch.Tensor] = {}  # by part index: what every member gets
        if fmt is not None:  # hivemind's container returns deltas; this one decoded averages
            self.tensor_part_container.finalize()
            self.tensor_part_container = _DecodingContainer(
                fmt,
                kwargs["tensors"],
                kwargs["peer_fractions"],
                compression=kwargs["compression"],
                part_size_bytes=kwargs.get("part_size_bytes", DEFAULT_PART_SIZE_BYTES),
            )
            own = self.ordered_peer_ids.index(self.peer_id)
            self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(own)
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
        self.poison_floor = 0.0  # see poison

    async def _communicate_with_peer(self, peer_id: PeerID):
        if self.fmt is not None and peer_id == self.peer_id:
            await self._reduce_own_parts()
            return
        try:
            await super()._communicate_with_peer(peer_id)
        except AllreduceException as e:
            # hivemind names the code a reducer answered with: CANCELLED is a reducer that dropped
            # another member and will not return a partial average (see serve), not a silent one.
            cancelled = averaging_pb2.MessageCode.Name(averaging_pb2.CANCELLED)
            (self.aborted_by if str(e).endswith(f"sent {cancelled}") else self.failed).add(peer_id)
            raise
        except _UndecodableAverage:  # a reducer that lies about its average: an offence, not silence
            self.poisoned.add(peer_id)
            raise
        except BaseException:
            self.failed.add(peer_id)
            raise

    async def _reduce_own_parts(self) -> None:
        """Our share of the vector, reduced by us: we keep the encoded average, as the others get it."""
        peer_index = self.ordered_peer_ids.index(self.peer_id)
        sender_index = self.sender_peer_ids.index(self.peer_id)
        for part_index, part in enumerate(self.parts_for_local_averaging):
            average = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, part, self.weight
            )
            self.tensor_part_container.register_processed_part(
                peer_index, part_index, self._encoded_average(part_index, average)
            )

    def _encoded_average(self, part_index: int, average: torch.Tensor) -> torch.Tensor:
        """The average of part ``part_index`` in the round's format, encoded once for every member."""
        if part_index not in self.encoded_averages:
            self.encoded_averages[part_index] = self.fmt.encode(average)
        return self.encoded_averages[part_index]

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, answering each part with the encoded average where the round has a format."""
        if self.fmt is None:
            async for message in super()._accumulate_parts_streaming(stream, sender_index):
                yield message
            return
        part_index = 0
        try:
            async for message in stream:
                part = deserialize_torch_tensor(message.tensor_part)
                try:
                    average = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=message.weight
                    )
                except BannedException:
                    break
                encoded = serialize_torch_tensor(self._encoded_average(part_index, average))
                part_index += 1
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

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

    def _screen(self, sender_index: int, part_index: int, part: torch.Tensor, weight: float) -> torch.Tensor:
        """The part to sum (decoded where the round has a format); refuse another member's part
        (:class:`PoisonedPart`; hivemind's runner then drops the sender) that does not decode,
        claims another weight than the agreed one, or that :func:`poison` refuses."""
        sender = self.sender_peer_ids[sender_index]
        if sender == self.peer_id:
            return part
        own = self.parts_for_local_averaging[part_index]
        agreed = self.round.weight_of(sender)
        problem = None
        if self.fmt is not None:
            try:
                part = self.fmt.decode(part, own.numel()).view_as(own)
            except (ValueError, RuntimeError) as e:
                problem = f"not in the round's {self.fmt.name} format ({e})"
        if problem is None and not math.isclose(weight, agreed, rel_tol=1e-9):
            problem = f"weighs its parts {weight}, not the agreed {agreed}"
        problem = problem or poison(part, own, self.poison_factor, self.poison_floor)
        if problem is not None:
            self.poisoned.add(sender)
            log.warning("round %s refuses part %d from %s: %s", self.round.key, part_index, sender, problem)
            raise PoisonedPart(f"part {part_index} from {sender}: {problem}")
        return part


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

    async def average(
        self,
        round_: Round,
        tensors: Sequence[torch.Tensor],
        fmt: SyncFormat | None = None,
        screened: int | None = None,
    ) -> RoundStats:
        """Replace ``tensors`` in place by the weighted average over the round's members (sent in
        ``fmt`` where given, after rounding each member's tensors to it; else float64);
        :class:`RoundFailed` (tensors unchanged) if the round lost a member. ``screened``: how many
        of the first tensors are of one kind (gradients), whose RMS here is the least reference a
        part is screened against (:func:`poison`); None: all of them."""
        work = [t.detach().to("cpu", torch.float64).contiguous() for t in tensors]
        if fmt is not None:
            work = [fmt.roundtrip(w) for w in work]
        runner = _Runner(
            round_,
            fmt,
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
        reference = work[:screened]
        numel = sum(w.numel() for w in reference)
        if numel:
            runner.poison_floor = math.sqrt(sum(float(w.pow(2).sum()) for w in reference) / numel)
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
        # a round with a format returns the averages themselves (identical on every member)
        results = (
            deltas if fmt is not None else [base + delta for base, delta in zip(work, deltas, strict=True)]
        )
        for base, result in zip(work, results, strict=True):
            # A reducer could return anything: an average of finite parts is finite and no larger
            # than the largest of them, so one far larger than our own part is refused.
            if poison(result, base, POISON_FACTOR, runner.poison_floor) is not None:
                raise RoundFailed(set(), set(), set(round_.peers) - {self.p2p.peer_id}, implausible=True)
        for tensor, result in zip(tensors, results, strict=True):
            tensor.copy_(result)
        return RoundStats(len(round_.peers), runner.bytes_sent)
