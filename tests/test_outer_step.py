"""DiLoCo-style outer steps for the replicas of a stage, over hivemind's all-reduce on real P2P daemons
(loopback, NAT port mapping off): the pseudo-gradient formats, the exact equivalence with per-step
averaging, identical replicas after every sync, error-feedback int8 against the uncompressed run,
and a poisoned pseudo-gradient refused."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from swarm.node.replica_averaging import ReplicaPoisoned
from swarm.node.schedule import StepCounts

from bench.replica_sync import connected_groups, train_replicas
from swarm.codecs.base import PayloadError
from swarm.core.config import ReplicaSyncConfig, RotationConfig, RunConfig
from swarm.core.subspace import initial_artifacts
from swarm.io import checkpoint
from swarm.runtime.averaging import Round, RoundFailed, shares
from swarm.runtime.outer_step import OuterStep
from swarm.runtime.sync_formats import BLOCK, FORMATS, sync_format
from swarm.runtime.worker import StageWorker
from tests.helpers import random_batch, tiny_config
from tests.test_averaging import averagers, p2p_group, run

# -- formats ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_rounded_vector_travels_losslessly_in_any_aligned_cut(name: str):
    """Rounding is idempotent, also on pieces that start at the format's alignment (hivemind's
    parts): what a sender rounds is exactly what reducers decode; int8 keeps ~1% of the RMS."""
    fmt = sync_format(name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3 * BLOCK + 17, generator=gen, dtype=torch.float64)
    x *= torch.logspace(-9, 3, x.numel(), dtype=torch.float64)  # blocks of very different scales
    x[10:BLOCK] = 0.0
    rounded = fmt.roundtrip(x)
    assert torch.equal(fmt.roundtrip(rounded), rounded)
    for cut in (fmt.alignment, 2 * BLOCK, 5 * BLOCK):
        pieces = [fmt.decode(fmt.encode(p), p.numel()) for p in rounded.split(cut)]
        assert torch.equal(torch.cat(pieces), rounded), cut
    assert fmt.encode(x).numel() == fmt.wire_bytes(x.numel())
    error = ((rounded - x).norm() / x.norm()).item()
    assert error <= {"fp64": 0.0, "fp32": 1e-7, "bf16": 5e-3, "int8": 2e-2}[name], error
    with pytest.raises(ValueError, match="bytes, expected"):
        fmt.decode(fmt.encode(x)[:-1], x.numel())


def test_int8_marks_a_non_finite_block_and_saturates_absurd_values():
    fmt = sync_format("int8")
    x = torch.zeros(2 * BLOCK, dtype=torch.float64)
    x[3], x[BLOCK + 1] = float("inf"), 2.0
    back = fmt.roundtrip(x)
    assert back[:BLOCK].isnan().all() and torch.equal(back[BLOCK:], x[BLOCK:])
    huge = fmt.roundtrip(torch.tensor([1e300, -1e300], dtype=torch.float64))
    assert torch.isfinite(huge).all() and (huge.abs() > 1e40).all()  # finite, and refused as absurd


# -- replicas of a one-stage model -------------------------------------------------------------------


class PlainSGD:
    """A stand-in for the stage optimizer: ``w <- w - lr g``, no clipping, no schedule."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float):
        self.params, self.lr = params, lr

    @torch.no_grad()
    def step(self, step: int, parameters) -> float:
        for p in self.params:
            p.sub_(p.grad * self.lr)
        return 0.0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def outer_config(sync: ReplicaSyncConfig, microbatches: int = 4, batch_size: int = 4) -> RunConfig:
    config = tiny_config(
        n_stages=1,
        forward_format="fp64",
        backward_format="fp64",
        microbatches=microbatches,
        batch_size=batch_size,
    )
    return dataclasses.replace(config, replica_sync=sync)


def make_worker(config: RunConfig, sgd: float | None, dtype: torch.dtype = torch.float64) -> StageWorker:
    fixed, basis = initial_artifacts(config)
    worker = StageWorker(config, 0, fixed, basis, dtype=dtype)
    if sgd is not None:
        worker.optimizer = PlainSGD(worker.parameters(), sgd)
    return worker


def weights(worker: StageWorker) -> list[torch.Tensor]:
    return [p.detach().clone() for p in worker.parameters()]


def compute_step(worker: StageWorker, step: int, microbatches: list[int]) -> None:
    chunks = random_batch(worker.config, seed=100 + step).chunk(worker.config.train.microbatches)
    worker.begin_step(step)
    for mb in microbatches:
        worker.forward(step, mb, chunks[mb])
        worker.backward(step, mb)


def replicas_trained(
    config: RunConfig,
    dealt: list[list[int]],
    steps: int,
    sgd: float | None = None,
    dtype: torch.dtype = torch.float64,
    **hooks,
) -> list[StageWorker]:
    """Replicas of a one-stage model, each on its ``dealt`` microbatches of the batches
    :func:`compute_step` uses, through :class:`ReplicaGroup` on real P2P daemons."""
    workers = [make_worker(config, sgd, dtype) for _ in dealt]
    train_replicas(workers, dealt, steps, lambda step: random_batch(config, seed=100 + step), **hooks)
    return workers


def relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum((x - y).double().pow(2).sum() for x, y in zip(a, b, strict=True))
    den = sum(y.double().pow(2).sum() for y in b)
    return float((num / den).sqrt())


EXACT = ReplicaSyncConfig(mode="outer", every=1, format="fp64", outer_lr=1.0, outer_momentum=0.0)


def test_one_inner_sgd_step_per_sync_is_per_step_gradient_averaging():
    """H = 1, outer lr 1, momentum 0: the outer step sets every replica to the average of their
    post-step weights; with plain SGD inside, that is one SGD step on the global batch's gradient,
    the per-step averaging of today. Three steps, replicas dealt 2 and 2 microbatches (and 3 and 1:
    weighted by microbatches), equal a single worker on all 4 microbatches (fp64, 1e-10 on the
    update)."""
    config = outer_config(EXACT)
    start = weights(make_worker(config, None))
    reference = make_worker(config, 0.5)
    for step in range(3):
        compute_step(reference, step, [0, 1, 2, 3])
        reference.optimizer_step(step)
    update = [w - s for w, s in zip(weights(reference), start, strict=True)]
    for dealt in ([[0, 3], [1, 2]], [[0, 1, 2], [3]]):
        replicas = replicas_trained(config, dealt, 3, sgd=0.5)
        for worker in replicas:
            mine = [w - s for w, s in zip(weights(worker), start, strict=True)]
            assert relative(mine, update) < 1e-10
        assert all(torch.equal(a, b) for a, b in zip(*map(weights, replicas), strict=True))


def test_one_inner_adamw_step_per_sync_averages_the_post_step_weights():
    """The same outer step after the stage's real AdamW (whose moments each replica keeps): every
    replica ends each step at the microbatch-weighted average of the replicas' post-step weights."""
    config = outer_config(EXACT)
    dealt = [[0, 1, 2], [3]]
    expected: list[list[torch.Tensor]] = []

    def average_before_sync(step: int, workers: list[StageWorker]) -> None:
        a, b = map(weights, workers)
        expected.append([(3 * x + y) / 4 for x, y in zip(a, b, strict=True)])

    def check(step: int, workers: list[StageWorker]) -> None:
        for worker in workers:
            assert relative(weights(worker), expected[step]) < 1e-12

    replicas_trained(config, dealt, 3, after_inner=average_before_sync, after_sync=check)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
def test_replicas_hold_identical_weights_after_every_sync(fmt: str):
    """Three replicas, AdamW inside, a Nesterov outer step every 2 steps, the pseudo-gradient sent
    in ``fmt``: after each sync (fp32 workers) all replicas hold the same weights bit for bit; in
    between, each has moved on its own microbatches."""
    sync = ReplicaSyncConfig(mode="outer", every=2, format=fmt, outer_lr=0.7, outer_momentum=0.9)
    config = outer_config(sync, microbatches=3, batch_size=6)
    seen = {"synced": 0, "apart": 0}

    def check(step: int, workers: list[StageWorker]) -> None:
        same = all(
            torch.equal(a, b)
            for other in workers[1:]
            for a, b in zip(weights(workers[0]), weights(other), strict=True)
        )
        synced = (step + 1) % 2 == 0
        assert same == synced, step
        seen["synced" if synced else "apart"] += 1

    replicas = replicas_trained(config, [[0], [1], [2]], 6, after_sync=check, dtype=torch.float32)
    assert seen == {"synced": 3, "apart": 3}
    assert all(torch.isfinite(w).all() for w in weights(replicas[0]))


def test_an_overlapped_sync_lands_a_step_later_and_keeps_that_steps_progress():
    """Overlap 1, a sync every 2 steps, outer lr 1, momentum 0, plain SGD, fp64, replicas dealt 3
    and 1 microbatches: the sync sent after step t lands after step t+1 on each replica as the
    weighted average of the weights the replicas sent plus the replica's own progress since
    (1e-12); nothing lands on the send's step; the last step's sync waits, and the replicas end
    bitwise equal."""
    config = outer_config(dataclasses.replace(EXACT, every=2, overlap=1))
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=6))
    inner: list[list[list[torch.Tensor]]] = []  # per step, per replica: the weights after its inner step
    landed = []

    def after_inner(step: int, workers: list[StageWorker]) -> None:
        inner.append([weights(w) for w in workers])

    def after_sync(step: int, workers: list[StageWorker]) -> None:
        now = [weights(w) for w in workers]
        if step in (2, 4):  # the syncs sent after steps 1 and 3
            sent = inner[step - 1]
            average = [(3 * a + b) / 4 for a, b in zip(*sent, strict=True)]
            for i, mine in enumerate(now):
                expected = [g + w - s for g, w, s in zip(average, inner[step][i], sent[i], strict=True)]
                assert relative(mine, expected) < 1e-12, (step, i)
            assert not all(torch.equal(a, b) for a, b in zip(*now, strict=True))  # apart by own steps
            landed.append(step)
        elif step < 5:  # nothing landed: each replica holds its inner step's weights
            for mine, reached in zip(now, inner[step], strict=True):
                assert all(map(torch.equal, mine, reached))
        else:
            assert all(torch.equal(a, b) for a, b in zip(*now, strict=True))

    replicas_trained(config, [[0, 1, 2], [3]], 6, sgd=0.5, after_inner=after_inner, after_sync=after_sync)
    assert landed == [2, 4]


def test_a_state_taken_while_a_sync_is_in_flight_resumes_as_if_nothing_was_sent():
    """Own states are captured after every step, also between an overlapped send and its landing:
    such a state holds the weights at the last sync and the error-feedback residual from before the
    send, so a replica resumed from it sends exactly what the original sent (bit for bit)."""
    config = outer_config(ReplicaSyncConfig(mode="outer", every=1, format="int8", outer_momentum=0.9))
    worker = make_worker(config, None)
    for step in range(3):
        compute_step(worker, step, [0, 1, 2, 3])
        worker.optimizer_step(step)
        worker.outer = worker.outer or OuterStep(worker.parameters(), config.replica_sync)
        if step < 2:
            worker.outer.apply(worker.outer.pseudo_gradient())
    before = checkpoint.capture(worker, 2)
    assert before["outer"]["anchor"] is not None  # the weights moved since the last sync
    sent = worker.outer.pseudo_gradient(overlapped=True)
    assert worker.outer.pending
    during = checkpoint.from_bytes(checkpoint.to_bytes(checkpoint.capture(worker, 2)))
    for key in ("momentum", "residual", "anchor"):
        assert all(torch.equal(a, b) for a, b in zip(before["outer"][key], during["outer"][key], strict=True))
    resumed = make_worker(config, None)
    checkpoint.restore(resumed, during)
    assert all(torch.equal(a, b) for a, b in zip(resumed.outer.pseudo_gradient(), sent, strict=True))


def test_outer_mode_refuses_rotations_and_unknown_settings():
    with pytest.raises(ValueError, match=r"cannot be combined with rotation\.interval"):
        dataclasses.replace(
            tiny_config(), replica_sync=ReplicaSyncConfig(mode="outer"), rotation=RotationConfig(interval=5)
        )
    for bad in (
        {"format": "int4"},
        {"mode": "sometimes"},
        {"every": 0},
        {"outer_momentum": 1.0},
        {"every": 2, "overlap": 2},
        {"overlap": -1},
    ):
        with pytest.raises(ValueError, match="replica_sync"):
            ReplicaSyncConfig(**bad)
    toml = RunConfig(replica_sync=ReplicaSyncConfig(mode="outer", every=50, format="bf16")).to_dict()
    assert RunConfig.from_dict(toml).replica_sync == ReplicaSyncConfig(mode="outer", every=50, format="bf16")


# -- error feedback on a synthetic task --------------------------------------------------------------

DIM, ROWS, SYNCS, INNER = 2 * BLOCK, 1024, 30, 5


def synthetic_run(fmt: str) -> tuple[torch.Tensor, float]:
    """Two replicas fit one least-squares model on their own halves of the data: SGD inside, a
    Nesterov outer step every ``INNER`` steps over hivemind; the final weights and full-data loss."""
    gen = torch.Generator().manual_seed(1)
    truth = torch.randn(DIM, generator=gen, dtype=torch.float64)
    data = torch.randn(2, ROWS, DIM, generator=gen, dtype=torch.float64)
    # the halves fit different models: the replicas drift apart between syncs
    truths = truth + 0.3 * torch.randn(2, DIM, generator=gen, dtype=torch.float64)
    targets = torch.einsum("rnd,rd->rn", data, truths) + 0.1 * torch.randn(
        2, ROWS, generator=gen, dtype=torch.float64
    )
    sync = ReplicaSyncConfig(mode="outer", every=INNER, format=fmt, outer_lr=0.7, outer_momentum=0.9)
    params = [torch.nn.Parameter(torch.zeros(DIM, dtype=torch.float64)) for _ in range(2)]
    outers = [OuterStep([p], sync) for p in params]
    grams = [(x.T @ x / ROWS, x.T @ y / ROWS) for x, y in zip(data, targets, strict=True)]

    async def scenario() -> None:
        p2ps = await p2p_group(2)
        try:  # generous silence limits: this test is about the numbers, and CI machines are busy
            members = await averagers(p2ps, sender_timeout=30.0, reducer_timeout=60.0)
            peers = tuple(p.peer_id for p in p2ps)
            for k in range(SYNCS):
                with torch.no_grad():
                    for p, (gram, moment) in zip(params, grams, strict=True):
                        for _ in range(INNER):
                            p -= 0.2 * (gram @ p - moment)
                sent = [o.pseudo_gradient() for o in outers]
                round_ = Round(f"sync-{k}", peers, shares(DIM, [1.0, 1.0]), (1.0, 1.0))
                await asyncio.gather(
                    *(m.average(round_, s, o.format) for m, s, o in zip(members, sent, outers, strict=True))
                )
                for o, s in zip(outers, sent, strict=True):
                    o.apply(s)
        finally:
            for p in p2ps:
                await p.shutdown()

    run(scenario(), timeout=600.0)
    assert torch.equal(params[0], params[1])
    w = params[0].detach()
    loss = float(sum(((x @ w - y) ** 2).mean() for x, y in zip(data, targets, strict=True)) / 2)
    return w, loss


def test_int8_with_error_feedback_converges_to_the_uncompressed_result():
    """Both runs have settled after 30 syncs (60 give the same), 4% away from the least-squares
    optimum (the replicas' drift between syncs). The int8 run's weights stay within 1.2e-3
    (relative) of the fp64 run's, its loss within 2e-4 (measured; 1.4-1.6e-3 without the fed-back
    residual): a noise floor of one sync's rounding, which does not grow. Asserted: 2e-3 and 1e-3."""
    exact, exact_loss = synthetic_run("fp64")
    coarse, coarse_loss = synthetic_run("int8")
    drift = ((coarse - exact).norm() / exact.norm()).item()
    print(f"MEASURED int8+EF vs fp64: weights {drift:.2e}, loss {coarse_loss:.5f} vs {exact_loss:.5f}")
    assert drift < 2e-3 and abs(coarse_loss - exact_loss) / exact_loss < 1e-3


# -- poison ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attack", ["nan", "scaled"])
def test_a_poisoned_pseudo_gradient_is_refused_and_its_sender_named(attack: str):
    """Three replicas sync after one step; one's pseudo-gradient is NaN, or 10^4 times an honest one
    (int8 on the wire). Both honest replicas fail the sync with :class:`ReplicaPoisoned` naming it
    (the offence counted, so the coordinator evicts it, as for poisoned gradients), and neither
    applies anything: their weights stay their own post-step weights."""
    sync = ReplicaSyncConfig(mode="outer", every=1, format="int8")
    config = outer_config(sync, microbatches=3, batch_size=6)
    workers = [make_worker(config, None) for _ in range(3)]

    async def scenario():
        p2ps = await p2p_group(3)
        try:
            members = await averagers(p2ps, sender_timeout=2.0, reducer_timeout=4.0)
            groups = await connected_groups(p2ps, members, [1, 1, 1], "run/1/0")

            async def inner(i: int) -> None:
                compute_step(workers[i], 0, [i])
                s = workers[i].stats
                await groups[i].combine(
                    0, workers[i], StepCounts(s.tokens, s.loss_sum, s.loss_count, 0, 0, False)
                )
                workers[i].optimizer_step(0)

            await asyncio.gather(*(inner(i) for i in range(3)))
            with torch.no_grad():
                for p, anchor in zip(workers[2].parameters(), workers[2].outer.anchor, strict=True):
                    p.copy_(
                        torch.full_like(p, float("nan")) if attack == "nan" else anchor - 1e4 * (anchor - p)
                    )
            before = [weights(w) for w in workers[:2]]
            outcomes = await asyncio.gather(
                *(g.after_step(0, w, False) for g, w in zip(groups, workers, strict=True)),
                return_exceptions=True,
            )
            return outcomes, before, [members[i].offences[p2ps[2].peer_id] for i in range(2)]
        finally:
            for p in p2ps:
                await p.shutdown()

    outcomes, before, offences = run(scenario())
    for outcome in outcomes[:2]:
        assert isinstance(outcome, ReplicaPoisoned) and outcome.peer_node_id == "node2", outcome
    assert offences == [1, 1]
    for worker, mine in zip(workers[:2], before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(weights(worker), mine, strict=True))


def test_a_round_in_a_format_refuses_parts_that_do_not_decode():
    """A member that sends float64 parts (not the round's int8 bytes) is refused as poisoned."""
    numel = 4 * BLOCK
    values = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    async def scenario():
        p2ps = await p2p_group(2)
        try:
            members = await averagers(p2ps, sender_timeout=2.0, reducer_timeout=4.0)
            round_ = Round("r", tuple(p.peer_id for p in p2ps), (1.0, 1.0), (1.0, 1.0))
            return await asyncio.gather(
                members[0].average(round_, [values[0]], sync_format("int8")),
                members[1].average(round_, [values[1]]),  # float64 on the wire
                return_exceptions=True,
            ), p2ps[1].peer_id
        finally:
            for p in p2ps:
                await p.shutdown()

    (honest, _), liar = run(scenario())
    assert isinstance(honest, RoundFailed) and liar in honest.poisoned, honest


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_outer_step_state_is_on_the_parameters_device_and_dtype(device):
    """The weights at the last sync and the momentum live with the parameters (CUDA where they are)."""
    p = torch.nn.Parameter(torch.ones(5, device=device))
    outer = OuterStep([p], ReplicaSyncConfig(mode="outer", format="bf16", outer_momentum=0.5))
    assert outer.anchor[0].device == p.device and outer.momentum[0].dtype == p.dtype
    with torch.no_grad():
        p -= 0.25
    (sent,) = outer.pseudo_gradient()
    outer.apply([sent])
    assert torch.allclose(p.detach().cpu(), torch.full((5,), 1 - 0.7 * 0.25 * 1.5))


def test_a_snapshot_carries_the_outer_state_and_a_restored_replica_steps_on_bit_for_bit():
    """The Nesterov momentum and the error-feedback residual survive a cut: a replica restored from
    the snapshot takes the next outer step exactly as the one that never stopped."""
    config = outer_config(ReplicaSyncConfig(mode="outer", every=1, format="int8", outer_momentum=0.9))

    def train(worker: StageWorker, steps: range) -> None:  # a lone replica: its own average
        for step in steps:
            compute_step(worker, step, [0, 1, 2, 3])
            worker.optimizer_step(step)
            worker.outer = worker.outer or OuterStep(worker.parameters(), config.replica_sync)
            worker.outer.apply(worker.outer.pseudo_gradient())

    original = make_worker(config, None)
    train(original, range(2))
    snapshot = checkpoint.from_bytes(checkpoint.to_bytes(checkpoint.capture(original, 1)))
    assert snapshot["outer"]["momentum"][0].abs().sum() > 0 < snapshot["outer"]["residual"][0].abs().sum()
    restored, forgetful = make_worker(config, None), make_worker(config, None)
    checkpoint.restore(restored, snapshot)
    checkpoint.restore(forgetful, snapshot | {"outer": None})  # a snapshot without it, as before
    for worker in (original, restored, forgetful):
        train(worker, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(weights(original), weights(restored), strict=True))
    assert relative(weights(forgetful), weights(original)) > 1e-3  # the momentum matters
    for bad in ({"momentum": None, "residual": []}, {"momentum": [torch.full((2,), float("nan"))]}):
        with pytest.raises(PayloadError, match="outer-step state"):
            checkpoint.restore(make_worker(config, None), snapshot | {"outer": bad})
