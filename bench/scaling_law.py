"""A law of the compressed model's gap to dense in rank k, width d and steps s, fitted on the grid.

    gap(k, d, s) = a + b ln k + c ln d + e ln s

(the gap is ``loss / dense loss - 1`` at equal steps, dense being the best dense run at that width).
Linear in the logarithms so that a negative gap (noise around zero) fits like any other. Points are
every evaluation from ``MIN_STEP`` on, of every grid point (d, k); the check leaves out one grid
point at a time, fits the rest and predicts the left-out point's final gap. A prediction's
uncertainty is the larger of the fit's standard error at that point and the leave-out error (points
of one curve are correlated, so the standard error alone is too small).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from bench.quality import loss_at

MIN_STEP = 200  # earlier evaluations are dominated by warm-up


@dataclass(frozen=True)
class Point:
    d: int
    k: int
    step: int
    gap: float  # over the seeds' mean losses
    seed_gaps: tuple[float, ...] = ()  # each shared seed's own gap (empty: the sides share no seed)

    @property
    def standard_error(self) -> float | None:
        """The gap's standard error from its seeds' spread (None: fewer than two seeds)."""
        if len(self.seed_gaps) < 2:
            return None
        return statistics.stdev(self.seed_gaps) / math.sqrt(len(self.seed_gaps))


def seed_means(runs: list[dict]) -> list[dict]:
    """The runs with every seed of one configuration (width, kind, rank, optimizer, parametrisation,
    lr) merged into one: its ``curve`` and ``final`` the seeds' means (a single seed's gap can be
    off by several points; the mean halves that), ``seeds`` each seed's curve. A run listed twice
    counts once; diverged runs are left out, and so is a seed evaluated at other steps than the
    lowest seed."""
    groups: dict[tuple, dict[int, dict]] = {}  # configuration -> seed -> its run
    for r in runs:
        if r["curve"] and math.isfinite(r["final"]):
            key = (r["d"], r["kind"], r["rank"], r.get("optimizer"), r["parametrisation"], r["lr"])
            groups.setdefault(key, {})[r["seed"]] = r
    merged = []
    for by_seed in groups.values():
        first = by_seed[min(by_seed)]
        steps = [s for s, _ in first["curve"]]
        curves = {seed: r["curve"] for seed, r in by_seed.items() if [s for s, _ in r["curve"]] == steps}
        curve = mean_curve(list(curves.values()))
        merged.append(first | {"curve": curve, "final": curve[-1][1], "seeds": curves})
    return merged


def mean_curve(curves: list[list]) -> list[list]:
    """The step-by-step mean of curves evaluated at the same steps."""
    return [[step, sum(c[i][1] for c in curves) / len(curves)] for i, (step, _) in enumerate(curves[0])]


def points(runs: list[dict], kind: str = "subspace") -> list[Point]:
    """Every evaluation of the ``kind`` runs (seeds merged: :func:`seed_means`), each grid point
    (d, k) at its best final loss under either parametrisation, against the best dense run of its
    width at the same step, over the seeds both ran (all of each where they share none)."""
    best: dict[tuple[int, int], dict] = {}
    for r in seed_means(runs):
        if r["kind"] not in (kind, "dense"):
            continue
        key = (r["d"], r["rank"] if r["kind"] == kind else 0)
        if key not in best or r["final"] < best[key]["final"]:
            best[key] = r
    out = []
    for (d, k), r in sorted(best.items()):
        dense = best.get((d, 0))
        if k == 0 or dense is None:
            continue
        shared = sorted(set(r["seeds"]) & set(dense["seeds"]))
        ours, theirs = r["curve"], dense["curve"]
        if shared:
            ours = mean_curve([r["seeds"][s] for s in shared])
            theirs = mean_curve([dense["seeds"][s] for s in shared])
        for step, loss in ours:
            if step >= MIN_STEP:
                seeds = tuple(
                    loss_at(r["seeds"][s], step) / loss_at(dense["seeds"][s], step) - 1 for s in shared
                )
                out.append(Point(d, k, step, loss / loss_at(theirs, step) - 1, seeds))
    return out


def _features(d: float, k: float, s: float) -> list[float]:
    return [1.0, math.log(k), math.log(d), math.log(s)]


@dataclass
class Law:
    coef: list[float]  # a, b, c, e
    sigma: float  # the residuals' standard deviation
    inverse: torch.Tensor  # (X^T X)^-1, for a prediction's standard error
    loo_error: float  # the largest leave-one-grid-point-out error at the final step (0: not checked)

    def predict(self, d: float, k: float, s: float) -> tuple[float, float]:
        """The predicted gap and its uncertainty (one standard deviation, at least the leave-out error)."""
        x = torch.tensor(_features(d, k, s), dtype=torch.float64)
        mean = float(x @ torch.tensor(self.coef, dtype=torch.float64))
        se = self.sigma * math.sqrt(1 + float(x @ self.inverse @ x))
        return mean, max(se, self.loo_error)

    def formula(self) -> str:
        a, b, c, e = self.coef
        return f"gap = {a:+.4f} {b:+.4f} ln k {c:+.4f} ln d {e:+.4f} ln s"


def fit(pts: list[Point]) -> Law:
    """Least squares over ``pts``; needs at least two widths and two ranks."""
    if len({p.d for p in pts}) < 2 or len({p.k for p in pts}) < 2:
        raise ValueError("the law needs points at two widths and two ranks at least")
    x = torch.tensor([_features(p.d, p.k, p.step) for p in pts], dtype=torch.float64)
    y = torch.tensor([p.gap for p in pts], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y[:, None]).solution[:, 0]
    residual = y - x @ coef
    dof = max(len(pts) - x.shape[1], 1)
    return Law(coef.tolist(), math.sqrt(float(residual @ residual) / dof), torch.linalg.inv(x.T @ x), 0.0)


def check(pts: list[Point]) -> tuple[Law, list[dict]]:
    """The law on all points, its leave-one-grid-point-out errors at each point's final step (each
    row with the measured gap's own standard error from its seeds: no law can be checked closer)."""
    law = fit(pts)
    rows = []
    for d, k in sorted({(p.d, p.k) for p in pts}):
        rest = [p for p in pts if (p.d, p.k) != (d, k)]
        final = max((p for p in pts if (p.d, p.k) == (d, k)), key=lambda p: p.step)
        try:
            predicted, _ = fit(rest).predict(d, k, final.step)
        except ValueError:  # the rest spans one width or one rank: this point cannot be left out
            continue
        rows.append(
            {
                "d": d,
                "k": k,
                "step": final.step,
                "gap": final.gap,
                "predicted": predicted,
                "standard_error": final.standard_error,
            }
        )
    law.loo_error = max((abs(r["gap"] - r["predicted"]) for r in rows), default=0.0)
    return law, rows


def dense_exponent(runs: list[dict]) -> float:
    """Dense's ``alpha`` in loss ~ steps^-alpha from ``MIN_STEP`` on, averaged over its widths (each
    width's best dense run, seeds merged)."""
    best: dict[int, dict] = {}
    for r in seed_means(runs):
        if r["kind"] == "dense" and (r["d"] not in best or r["final"] < best[r["d"]]["final"]):
            best[r["d"]] = r
    slopes = []
    for r in best.values():
        pts = [(math.log(s), math.log(loss)) for s, loss in r["curve"] if s >= MIN_STEP]
        if len(pts) > 1:
            mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
            slopes.append(-sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts))
    if not slopes:
        raise ValueError("no dense curve to take the loss-vs-steps exponent from")
    return sum(slopes) / len(slopes)
