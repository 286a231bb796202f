"""Several nodes per stage: who processes which microbatch, and who sends to whom.

Each step's ``M`` microbatches are dealt among the replicas of a stage once per plan epoch
(:func:`deal`): SWARM's balancer (a heap of each replica's expected finishing time, fed by
its measured throughput), run by the coordinator over the whole step instead of by each
sender per microbatch. Every node then knows, from the plan alone, which microbatches it
processes, which replica of the next stage gets each activation and which replica of the
previous stage gets each gradient back: a frame crosses exactly one stream of one pair of
neighbouring replicas, so the bytes per boundary are those of a single pipeline, and a frame
arriving from any other peer is refused. Routing per microbatch at run time would adapt within
an epoch too, but then no replica knows in advance how many microbatches it must wait for.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


def unmeasured_rate(rates: Iterable[float]) -> float:
    """What a node not measured yet counts as: the mean of the measured (positive) ``rates``,
    1.0 when none is."""
    measured = [r for r in rates if r > 0]
    return sum(measured) / len(measured) if measured else 1.0


def deal(microbatches: int, rates: Sequence[float]) -> list[list[int]]:
    """Deal microbatches ``0..microbatches-1`` to replicas of measured throughputs ``rates``
    (tokens/s; 0 where not measured yet, counted at the mean of the measured ones).

    Each replica gets one, then each next microbatch goes to the replica that would finish it
    first (ties: the earlier replica). Returns each replica's microbatches, ascending.
    """
    if not 1 <= len(rates) <= microbatches:
        raise ValueError(f"{len(rates)} replicas cannot share {microbatches} microbatches")
    default = unmeasured_rate(rates)
    speed = [r if r > 0 else default for r in rates]
    dealt: list[list[int]] = [[i] for i in range(len(rates))]
    heap = [(2 / s, i) for i, s in enumerate(speed)]  # when each would finish its next microbatch
    heapq.heapify(heap)
    for mb in range(len(rates), microbatches):
        _, i = heapq.heappop(heap)
        dealt[i].append(mb)
        heapq.heappush(heap, ((len(dealt[i]) + 1) / speed[i], i))
    return dealt


@dataclass(frozen=True)
class Routes:
    """One replica's view of a step: its microbatches (in order) and, for each of them, the node
    of the previous stage that sends its activation and the node of the next stage it goes to."""

    own: tuple[int, ...]
    upstream: Mapping[int, str]
    downstream: Mapping[int, str]

    @classmethod
    def alone(cls, microbatches: int, upstream: str = "", downstream: str = "") -> Routes:
        """Every microbatch, from and to one neighbour each (the pipeline without replicas)."""
        every = tuple(range(microbatches))
        return cls(every, dict.fromkeys(every, upstream), dict.fromkeys(every, downstream))

    @classmethod
    def of(cls, stage: int, node_id: str, owners: Sequence[Mapping[int, str]]) -> Routes:
        """``node_id``'s routes at ``stage``, where ``owners[s]`` maps each microbatch to the node
        processing it at stage ``s``."""
        own = tuple(sorted(mb for mb, node in owners[stage].items() if node == node_id))
        up = {mb: owners[stage - 1][mb] for mb in own} if stage > 0 else {}
        down = {mb: owners[stage + 1][mb] for mb in own} if stage + 1 < len(owners) else {}
        return cls(own, up, down)
