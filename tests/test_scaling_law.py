"""The scaling bench's gap law: seeds merged before fitting, gaps against the best dense of a width,
the fit and its leave-one-grid-point-out check on points of a known law."""

import math

import pytest

from bench.scaling_law import check, dense_exponent, fit, points, seed_means


def entry(d: int, kind: str, rank: int, seed: int, losses: list[float], lr: float = 1e-3) -> dict:
    """A grid run as the bench records it, evaluated every 200 steps (no losses: diverged)."""
    curve = [[200 * (i + 1), loss] for i, loss in enumerate(losses)]
    final = losses[-1] if losses else math.inf
    key = {"d": d, "kind": kind, "rank": rank, "parametrisation": "mup", "lr": lr, "seed": seed}
    return key | {"curve": curve, "final": final}


def test_seeds_of_one_configuration_are_merged_once_each_and_diverged_runs_left_out():
    seed0 = entry(128, "subspace", 8, 0, [5.0, 4.6])
    seed1 = entry(128, "subspace", 8, 1, [5.2, 5.0])
    diverged = entry(128, "subspace", 8, 2, [])
    other_lr = entry(128, "subspace", 8, 0, [6.0, 5.5], lr=2e-3)
    merged = seed_means([seed0, seed0, seed1, diverged, other_lr])  # seed 0 listed twice
    by_lr = {m["lr"]: m for m in merged}
    assert set(by_lr) == {1e-3, 2e-3}
    assert by_lr[1e-3]["final"] == pytest.approx(4.8)  # (4.6 + 5.0) / 2, not weighted 2:1
    assert by_lr[1e-3]["curve"] == [[200, pytest.approx(5.1)], [400, pytest.approx(4.8)]]
    assert by_lr[2e-3]["final"] == 5.5


def test_optimizers_are_never_merged_and_gaps_compare_the_seeds_both_ran():
    adamw = entry(128, "subspace", 8, 0, [5.0, 4.6])
    muon = entry(128, "subspace", 8, 0, [5.0, 4.2]) | {"optimizer": "muon"}
    assert sorted(m["final"] for m in seed_means([adamw, muon])) == [4.2, 4.6]
    runs = [
        entry(128, "dense", 0, 0, [5.0, 4.0]),
        entry(128, "dense", 0, 1, [5.0, 4.4]),  # a lucky seed 0: its mean is 4.2
        entry(128, "subspace", 8, 0, [5.0, 4.1]),  # one seed: against dense's seed 0 alone
        entry(256, "dense", 0, 0, [5.0, 4.0]),
        entry(256, "subspace", 8, 1, [5.0, 4.2]),  # no seed in common: the means
    ]
    finals = {p.d: p.gap for p in points(runs) if p.step == 400}
    assert finals == {128: pytest.approx(4.1 / 4.0 - 1), 256: pytest.approx(4.2 / 4.0 - 1)}


def test_a_grid_point_is_its_best_configuration_against_the_best_dense_of_its_width():
    runs = [
        entry(128, "dense", 0, 0, [5.0, 4.0], lr=1e-3),
        entry(128, "dense", 0, 0, [5.5, 4.4], lr=2e-3),  # the worse dense: not the reference
        entry(128, "subspace", 8, 0, [5.5, 4.2], lr=1e-3),
        entry(128, "subspace", 8, 0, [5.2, 4.1], lr=2e-3),  # the better lr is the point
        entry(256, "subspace", 8, 0, [5.0, 4.0]),  # no dense at 256: no point
    ]
    pts = points(runs)
    assert [(p.d, p.k, p.step) for p in pts] == [(128, 8, 200), (128, 8, 400)]
    assert [p.gap for p in pts] == [pytest.approx(5.2 / 5.0 - 1), pytest.approx(4.1 / 4.0 - 1)]


def test_the_fit_recovers_a_known_law_and_predicts_what_it_leaves_out():
    a, b, c, e = 0.1, -0.02, -0.01, 0.003
    runs = []
    for d in (128, 256, 512):
        dense = [6.0 - 0.1 * i for i in range(5)]
        runs.append(entry(d, "dense", 0, 0, dense))
        for k in (8, 16, 32):
            gaps = [a + b * math.log(k) + c * math.log(d) + e * math.log(200 * (i + 1)) for i in range(5)]
            runs.append(entry(d, "subspace", k, 0, [x * (1 + g) for x, g in zip(dense, gaps, strict=True)]))
    pts = points(runs)
    law = fit(pts)
    assert law.coef == pytest.approx([a, b, c, e], abs=1e-9)
    law, left_out = check(pts)
    assert len(left_out) == 9 and law.loo_error < 1e-9  # an exact law predicts every point it leaves out
    gap, uncertainty = law.predict(4096, 40, 1000)
    assert gap == pytest.approx(a + b * math.log(40) + c * math.log(4096) + e * math.log(1000))
    assert uncertainty < 1e-6


def test_one_width_or_one_rank_cannot_be_fitted():
    runs = [entry(128, "dense", 0, 0, [5.0, 4.0]), entry(128, "subspace", 8, 0, [5.1, 4.1])]
    with pytest.raises(ValueError, match="two widths and two ranks"):
        fit(points(runs))


def test_dense_exponent_is_the_loss_vs_steps_slope():
    losses = [5.0 * (200 * (i + 1)) ** -0.1 for i in range(5)]
    assert dense_exponent([entry(128, "dense", 0, 0, losses)]) == pytest.approx(0.1)


def test_each_point_carries_its_seeds_own_gaps_and_their_standard_error():
    """The leave-out check is only as good as the measured gaps: each point keeps every shared seed's
    gap, and the check reports the final point's standard error (none from one seed)."""
    runs = [
        entry(128, "dense", 0, 0, [5.0, 4.0]),
        entry(128, "dense", 0, 1, [5.0, 4.4]),
        entry(128, "subspace", 8, 0, [5.0, 4.2]),
        entry(128, "subspace", 8, 1, [5.0, 4.4]),
        entry(256, "dense", 0, 0, [5.0, 4.0]),
        entry(256, "subspace", 8, 0, [5.0, 4.1]),
        entry(128, "subspace", 16, 0, [5.0, 4.1]),
        entry(256, "subspace", 16, 0, [5.0, 4.0]),
    ]
    final = {(p.d, p.k): p for p in points(runs) if p.step == 400}
    two = final[128, 8]
    assert two.seed_gaps == (pytest.approx(0.05), pytest.approx(0.0))
    assert two.standard_error == pytest.approx(0.025)  # sample sd 0.0354 over sqrt(2) seeds
    assert final[256, 8].standard_error is None
    _, left_out = check(points(runs))
    by_point = {(r["d"], r["k"]): r["standard_error"] for r in left_out}
    assert by_point[128, 8] == pytest.approx(0.025) and by_point[256, 8] is None
