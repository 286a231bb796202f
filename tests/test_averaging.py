"""Replica averaging over hivemind's all-reduce on real P2P daemons (loopback, NAT port mapping off):
exactness against a single replica on the global batch, identical results on every replica,
bytes on the wire, and a round that loses a member fails whole and succeeds without it."""

from __future__ import annotations

import asyncio
import dataclasses
import gc

import pytest
import torch
from hivemind.p2p import P2P

from bench.averaging import loopback_peers
from swarm.runtime.averaging import ReplicaAverager, Round, RoundFailed, shares
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config


async def p2p_group(n: int) -> list[P2P]:
    """``n`` P2P daemons on loopback that know each other (no NAT port mapping, no relays)."""
    p2ps = await loopback_peers(n)
    for p2p in p2ps:  # nothing listens or announces beyond loopback
        assert all(str(m).startswith("/ip4/127.0.0.1/") for m in await p2p.get_visible_maddrs())
    return p2ps


async def averagers(p2ps: list[P2P], **options) -> list[ReplicaAverager]:
    out = [ReplicaAverager(p, "stage-0", **options) for p in p2ps]
    for a in out:
        await a.start()
    return out


def run(coro, timeout: float = 120.0):
    try:
        return asyncio.run(asyncio.wait_for(coro, timeout))
    finally:
        # The daemons' sockets and streams are garbage now: collected here, not at a random later
        # moment (CPython 3.11 can mis-count its recursion depth when that lands inside ast.parse).
        gc.collect()


def stage_gradients(config, ids: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of a one-stage fp64 model (the whole model) on ``ids``."""
    pipe = LocalPipeline(config, dtype=torch.float64)
    pipe.forward_backward(0, ids)
    return [p.grad.clone() for p in pipe.workers[0].parameters()]


def test_two_replicas_average_to_the_global_batch_gradient():
    """Replica A on one half of the batch, B on the other: their token-weighted average equals one
    replica's gradient on the whole batch (fp64, 1e-10), and both hold the same result (each adds
    the reducer's delta to its own part: equal up to the last bits)."""
    config = dataclasses.replace(tiny_config(n_stages=1, forward_format="fp64", backward_format="fp64"))
    ids = random_batch(config, seed=3)
    full = stage_gradients(config, ids)  # 2 microbatches of half the batch each
    half = dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, batch_size=config.train.batch_size // 2, microbatches=1),
    )
    rows = half.train.batch_size
    local = [stage_gradients(half, ids[:rows]), stage_gradients(half, ids[rows:])]
    numel = sum(g.numel() for g in full)

    async def scenario():
        p2ps = await p2p_group(2)
        try:
            group = await averagers(p2ps)
            tokens = float(rows * half.train.seq_len)
            peers = tuple(p.peer_id for p in p2ps)
            round_ = Round("step-0", peers, shares(numel, [100.0, 300.0]), (tokens, tokens))
            return await asyncio.gather(*(a.average(round_, g) for a, g in zip(group, local, strict=True)))
        finally:
            for p in p2ps:
                await p.shutdown()

    stats = run(scenario())
    for a, b, ref in zip(local[0], local[1], full, strict=True):
        scale = ref.norm().clamp_min(1e-30)
        assert ((a - ref).norm() / scale).item() < 1e-10 and ((a - b).norm() / scale).item() < 1e-14
    fractions = shares(numel, [100.0, 300.0])
    own = [f / sum(fractions) for f in fractions]
    for i, s in enumerate(stats):  # its parts to the other reducer, the average of its own part back
        expected = 8 * (round((1 - own[i]) * numel) + round(own[i] * numel))
        assert abs(s.bytes_sent - expected) <= 16 and s.members == 2


@pytest.mark.timeout(180)
def test_a_round_that_loses_a_member_fails_whole_and_succeeds_without_it():
    """Three replicas; one dies (its P2P shuts down mid-round). The two others get RoundFailed (one at
    least naming it), with their tensors untouched, and the retry without it averages exactly the two."""
    numel = 1 << 18
    values = [torch.full((numel,), float(i + 1)) for i in range(3)]

    async def scenario():
        p2ps = await p2p_group(3)
        try:
            group = await averagers(p2ps, sender_timeout=2.0, reducer_timeout=4.0)
            members = tuple(p.peer_id for p in p2ps)
            first = Round("step-7/0", members, shares(numel, [1.0, 1.0, 1.0]), (1.0, 1.0, 1.0))
            mine = [[v.clone()] for v in values]

            async def dies() -> None:  # starts the round, then its daemon is gone
                task = asyncio.create_task(group[2].average(first, mine[2]))
                await asyncio.sleep(0.05)
                await p2ps[2].shutdown()
                task.cancel()

            outcomes = await asyncio.gather(
                group[0].average(first, mine[0]),
                group[1].average(first, mine[1]),
                dies(),
                return_exceptions=True,
            )
            # A survivor names the dead one, or (when the dead one had already returned all its
            # averages to it) the other survivor as the reducer that cancelled because of it.
            for i, outcome in enumerate(outcomes[:2]):
                assert isinstance(outcome, RoundFailed), outcome
                assert members[2] in outcome.silent or members[1 - i] in outcome.aborted_by, outcome
            assert any(members[2] in outcome.silent for outcome in outcomes[:2])
            assert all(torch.equal(mine[i][0], values[i]) for i in range(2))  # nothing applied
            retry = first.without({members[2]}, "step-7/1")
            await asyncio.gather(group[0].average(retry, mine[0]), group[1].average(retry, mine[1]))
            return mine
        finally:
            for p in p2ps[:2]:
                await p.shutdown()

    mine = run(scenario())
    assert torch.equal(mine[0][0], torch.full((numel,), 1.5)) and torch.equal(mine[1][0], mine[0][0])


@pytest.mark.parametrize("attack", ["nan", "scaled", "overweight"])
def test_a_poisoned_contribution_is_dropped_and_counted(attack: str):
    """Three replicas; one sends NaN gradients, 10^4 times larger ones, or honest-sized ones under a
    weight of 10^9 instead of the agreed 1; as a reducer it returns averages with its poison in
    them. Every honest reducer refuses its parts (the round fails naming it as poisoned, the
    offence counted), nothing is applied anywhere, and the retry without it averages the two
    honest replicas exactly."""
    numel = 1 << 16
    honest = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    bad = {"nan": torch.full((numel,), float("nan")), "scaled": torch.randn(numel) * 1e4}.get(
        attack, -torch.randn(numel)
    )

    async def scenario():
        p2ps = await p2p_group(3)
        try:
            group = await averagers(p2ps, sender_timeout=2.0, reducer_timeout=4.0, part_size_bytes=1 << 12)
            members = tuple(p.peer_id for p in p2ps)
            first = Round("step-3/0", members, (1.0, 1.0, 1.0), (1.0, 1.0, 1.0))  # a third each
            claimed = Round(
                "step-3/0", members, (1.0, 1.0, 1.0), (1.0, 1.0, 1e9 if attack == "overweight" else 1.0)
            )
            mine = [[honest[0].clone()], [honest[1].clone()], [bad.clone()]]
            outcomes = await asyncio.gather(
                *(a.average(r, t) for a, r, t in zip(group, (first, first, claimed), mine, strict=True)),
                return_exceptions=True,
            )
            for outcome in outcomes[:2]:
                assert isinstance(outcome, RoundFailed) and members[2] in outcome.poisoned, outcome
            assert torch.equal(mine[0][0], honest[0]) and torch.equal(mine[1][0], honest[1])
            assert group[0].offences[members[2]] == 1 and group[1].offences[members[2]] == 1
            retry = first.without({members[2]}, "step-3/1")
            await asyncio.gather(group[0].average(retry, mine[0]), group[1].average(retry, mine[1]))
            return mine
        finally:
            for p in p2ps:
                await p.shutdown()

    mine = run(scenario())
    expected = (honest[0].double() + honest[1].double()) / 2
    assert torch.allclose(mine[0][0].double(), expected, rtol=0, atol=1e-6)
    assert torch.equal(mine[0][0], mine[1][0])


def test_a_slice_nearly_zero_on_one_replica_is_no_poison():
    """Honest gradients can be sparse: the output-head rows of tokens only one replica's microbatches
    hold are nearly zero on the other. Two replicas whose first part is 10^4 times smaller on one:
    screened against the whole gradient's RMS (not that part's alone), the round goes through and
    averages them exactly; a part 10^4 times the whole gradient is still refused."""
    numel, part = 1 << 14, 1 << 9
    honest = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) * 1e-3 for i in range(2)]
    honest[0][:part] *= 1e-4

    async def scenario(tensors: list[torch.Tensor]):
        p2ps = await p2p_group(2)
        try:
            group = await averagers(p2ps, sender_timeout=2.0, reducer_timeout=4.0, part_size_bytes=part * 8)
            round_ = Round("step-0/0", tuple(p.peer_id for p in p2ps), (1.0, 1.0), (1.0, 1.0))
            mine = [[t.clone()] for t in tensors]
            outcomes = await asyncio.gather(
                *(a.average(round_, t) for a, t in zip(group, mine, strict=True)), return_exceptions=True
            )
            return outcomes, mine
        finally:
            for p in p2ps:
                await p.shutdown()

    outcomes, mine = run(scenario(honest))
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    expected = (honest[0].double() + honest[1].double()) / 2
    assert all(torch.allclose(m[0].double(), expected, rtol=1e-6, atol=1e-12) for m in mine)  # float32
    scaled = honest[1].clone()
    scaled[:part] = torch.randn(part) * 10.0  # 10^4 x the whole gradient's RMS
    outcomes, _ = run(scenario([honest[0], scaled]))
    assert isinstance(outcomes[0], RoundFailed) and outcomes[0].poisoned, outcomes
