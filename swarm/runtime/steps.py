"""The training step, written once for every transport: the microbatch order and the end-of-step syncs.

*Order.* :func:`stage_order` is the sequence of forward and backward passes of one stage for a
schedule: GPipe (``"gpipe"``) runs every microbatch forward, then every backward in reverse;
1F1B (``"1f1b"``, PipeDream-flush) runs ``min(P - 1 - s, M)`` forwards on stage ``s`` of ``P``,
then alternates one forward and one backward, then drains the remaining backwards, so it holds
at most ``P - s`` microbatches' activations instead of all ``M``. An action names a microbatch by
its position in the stage's forward order (the microbatch itself when a stage runs all of them,
in order). Every stage backpropagates in the order its downstream neighbour does, so gradients
arrive in the order a stage expects them. :func:`pipeline_order` interleaves the stages' orders
into the one sequence a single process follows.

*End of step.* :func:`end_step` is what a stage does after its last backward pass, as a program
that yields the messages it exchanges with its neighbours (:class:`Send`, :class:`Receive`):
MAPL gradient shares are summed across each boundary (so both copies of a boundary take the
identical step), the optimizer steps, then the RVQ sender learns its codebooks from what it sent
this step and ships the delta, which the receiver applies before the step ends; at the end of a
MAPL PCA warm-up the sender ships its new projection the same way. A transport
drives one program per stage: :func:`run_in_process` by function calls (the single-process
pipeline), :func:`run_over_links` over a node's boundary streams. Bytes moved are the
:attr:`BoundarySync.nbytes` of every message sent.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeVar

from swarm.core.config import SCHEDULES
from swarm.core.mapl import pack_gradients, sum_gradients, unpack_gradients, unpack_projection
from swarm.runtime.wire import BoundarySync
from swarm.runtime.worker import StageStats, StageWorker

T = TypeVar("T")

FORWARD, BACKWARD = "F", "B"


class Action(NamedTuple):
    """The forward (``F``) or backward (``B``) pass of the ``position``-th microbatch a stage forwards."""

    kind: Literal["F", "B"]
    position: int


def stage_order(schedule: str, n_stages: int, stage: int, n_microbatches: int) -> list[Action]:
    """Stage ``stage`` of ``n_stages``: its passes over ``n_microbatches`` microbatches in one step."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")
    n = n_microbatches
    if schedule == "gpipe":
        return [Action(FORWARD, i) for i in range(n)] + [Action(BACKWARD, i) for i in reversed(range(n))]
    warmup = min(n_stages - 1 - stage, n)
    order = [Action(FORWARD, i) for i in range(warmup)]
    for i in range(n - warmup):
        order += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
    return order + [Action(BACKWARD, i) for i in range(n - warmup, n)]


def pipeline_order(schedule: str, n_stages: int, n_microbatches: int) -> list[tuple[int, Action]]:
    """Every stage's :func:`stage_order` merged into one sequence of ``(stage, action)`` that respects
    the data flow (a forward after the previous stage's, a backward after the next stage's).

    Each pass's output is consumed at once where the neighbour's next pass takes it, else the
    lowest ready stage goes on: under GPipe every microbatch travels forward through all stages,
    then each travels back through all of them, newest first.
    """
    orders = [stage_order(schedule, n_stages, s, n_microbatches) for s in range(n_stages)]
    done = [0] * n_stages  # passes run, per stage
    passed: set[tuple[int, Action]] = set()

    def ready(stage: int) -> bool:
        if not 0 <= stage < n_stages or done[stage] == len(orders[stage]):
            return False
        action = orders[stage][done[stage]]
        source = stage - 1 if action.kind == FORWARD else stage + 1  # whose pass it consumes
        return not 0 <= source < n_stages or (source, action) in passed

    sequence: list[tuple[int, Action]] = []
    stage, total = 0, sum(map(len, orders))
    while len(sequence) < total:
        if not ready(stage):
            stage = next((s for s in range(n_stages) if ready(s)), -1)
            if stage < 0:
                raise RuntimeError(f"{schedule} orders of {n_stages} stages deadlock")
        action = orders[stage][done[stage]]
        done[stage] += 1
        passed.add((stage, action))
        sequence.append((stage, action))
        stage += 1 if action.kind == FORWARD else -1  # follow the data
    return sequence


# -- end of step ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    """Send ``sync`` to the neighbouring stage downstream (``downstream``) or upstream."""

    downstream: bool
    sync: BoundarySync


@dataclass(frozen=True)
class Receive:
    """Wait for the next sync from the neighbour downstream or upstream (``what``: for errors)."""

    downstream: bool
    what: str


# A stage's part of an exchange: yields messages, is sent back what each Receive got, returns T.
Program = Generator[Send | Receive, BoundarySync | None, T]


def share_mapl_gradients(worker: StageWorker, step: int) -> Program[None]:
    """MAPL: send each boundary copy's gradient share to the other copy and install ``out + in``,
    added in that order on both sides so both copies take the identical optimizer step."""
    mapl = worker.mapl
    if "out" in mapl:
        share_out = worker.boundary_gradients("out")
        yield Send(True, BoundarySync(step, worker.index, mapl_gradients=pack_gradients(share_out)))
    if "in" in mapl:
        share_in = worker.boundary_gradients("in")
        yield Send(False, BoundarySync(step, worker.index - 1, mapl_gradients=pack_gradients(share_in)))
        peer = yield Receive(False, "MAPL gradient share")
        share_out_upstream = unpack_gradients(peer.mapl_gradients, mapl["in"])
        worker.set_boundary_gradients("in", sum_gradients(share_out_upstream, share_in))
    if "out" in mapl:
        peer = yield Receive(True, "MAPL gradient share")
        share_in_downstream = unpack_gradients(peer.mapl_gradients, mapl["out"])
        worker.set_boundary_gradients("out", sum_gradients(share_out, share_in_downstream))


def ship_codebooks(worker: StageWorker, step: int) -> Program[None]:
    """RVQ: the sender learns its codebooks from this step's coordinates and sends the delta; the
    receiver applies it at once, so both sides end every step at the same codebook version (a
    snapshot cut after the step holds one consistent boundary state)."""
    delta = worker.codebook_delta()
    if delta is not None:
        yield Send(True, BoundarySync(step, worker.index, codebook_delta=delta))
    if worker.codebooks("in") is not None:
        sync = yield Receive(False, "codebook delta")
        worker.apply_codebook_delta(sync.codebook_delta)


def ship_mapl_projection(worker: StageWorker, step: int) -> Program[None]:
    """MAPL PCA initialisation, after optimizer step ``codec.mapl_pca_steps - 1``: the sender switches
    its projection to the principal directions of its warm-up inputs and ships it; the receiver
    validates and installs it, so both copies hold the same new ``A`` from the next step on."""
    if step + 1 != worker.config.codec.mapl_pca_steps:
        return
    if "out" in worker.mapl:
        yield Send(True, BoundarySync(step, worker.index, mapl_projection=worker.principal_projection()))
    if "in" in worker.mapl:
        sync = yield Receive(False, "MAPL projection")
        worker.install_projection("in", unpack_projection(sync.mapl_projection, worker.mapl["in"]))


def end_step(worker: StageWorker, step: int) -> Program[StageStats]:
    """A stage's end of step after its last backward: MAPL shares, the optimizer step, RVQ deltas,
    the MAPL projection at the end of a PCA warm-up; returns the step's stats."""
    yield from share_mapl_gradients(worker, step)
    stats = worker.optimizer_step(step)
    yield from ship_codebooks(worker, step)
    yield from ship_mapl_projection(worker, step)
    return stats


def _advance(program: Program[T], reply: BoundarySync | None) -> tuple[bool, object]:
    """Resume ``program``: (True, its result) when it ends, else (False, its next message)."""
    try:
        return False, program.send(reply)
    except StopIteration as end:  # returned, not raised: a thread's future refuses StopIteration
        return True, end.value


def run_in_process(programs: Sequence[Program[T]]) -> tuple[list[T], int]:
    """Run the programs of all stages of a pipeline (stage ``i``'s neighbours: ``i - 1`` and ``i + 1``)
    with messages handed over by function call; their results and the bytes sent."""
    inboxes = [{True: deque(), False: deque()} for _ in programs]  # by "from downstream"
    waiting: dict[int, Receive] = {}
    results: list = [None] * len(programs)
    moved = 0

    def advance(i: int, reply: BoundarySync | None) -> None:
        """Run program ``i`` until it waits for a message not yet sent, or ends."""
        nonlocal moved
        while True:
            ended, op = _advance(programs[i], reply)
            if ended:
                results[i] = op
                return
            reply = None
            if isinstance(op, Send):
                inboxes[i + 1 if op.downstream else i - 1][not op.downstream].append(op.sync)
                moved += op.sync.nbytes
            elif inboxes[i][op.downstream]:
                reply = inboxes[i][op.downstream].popleft()
            else:
                waiting[i] = op
                return

    for i in range(len(programs)):
        advance(i, None)
    while waiting:
        ready = [i for i, op in waiting.items() if inboxes[i][op.downstream]]
        if not ready:
            raise RuntimeError(f"stages {sorted(waiting)} wait for boundary syncs nobody sends")
        for i in ready:
            advance(i, inboxes[i][waiting.pop(i).downstream].popleft())
    return results, moved


async def run_over_links(
    program: Program[T],
    send: Callable[[Send], Awaitable[object]],
    receive: Callable[[Receive], Awaitable[BoundarySync]],
) -> T:
    """Run one stage's program against its links; the compute between two messages runs in a worker
    thread, so the event loop keeps the streams flowing."""
    reply = None
    while True:
        ended, op = await asyncio.to_thread(_advance, program, reply)
        if ended:
            return op
        if isinstance(op, Send):
            await send(op)
            reply = None
        else:
            reply = await receive(op)
