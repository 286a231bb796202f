"""The benchmarks' learning-rate rule: a factor-2 sweep extended until its best point is interior,
with lrs one seed cannot rank (within ``SEED_NOISE`` of the best) ranked on two seeds' mean.

Shared by the ``scaling`` grid (every method at every width it tunes) and the ``quality`` section
(every variant at its own lr), so both compare variants each at the best lr of the same rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable

LR_FACTOR = 2.0  # the spacing of the learning-rate grid
SEED_NOISE = 0.02  # two seeds of one variant end ~1% apart: closer lrs need a second seed
MAX_POINTS = 8  # a sweep stops extending at this many lrs (a factor 2^7 between its ends)

Loss = Callable[[float, int], float]  # (lr, seed) -> final validation loss; inf: diverged, NaN: not run


def scores(loss: Loss, lrs: list[float], seed: int, tie_seed: int | None) -> dict[float, float]:
    """lr -> ``seed``'s final loss, or (with ``tie_seed``) the mean with ``tie_seed``'s where it is
    within ``SEED_NOISE`` of the best; lrs not run (NaN) are left out."""
    first = {lr: loss(lr, seed) for lr in lrs}
    first = {lr: x for lr, x in first.items() if not math.isnan(x)}
    if not first:
        return {}
    floor = min(first.values())
    close = [lr for lr, x in first.items() if math.isfinite(x) and x <= floor * (1 + SEED_NOISE)]
    if tie_seed is None or len(close) < 2:
        return first
    for lr in close:
        second = loss(lr, tie_seed)
        if not math.isnan(second):
            first[lr] = (first[lr] + second) / 2
    return first


def search(
    loss: Loss, start: float, seed: int, tie_seed: int | None, partial: bool = False
) -> tuple[float, dict[float, float]]:
    """The best lr on the factor-2 grid around ``start`` and the scores it was chosen on: first on
    ``seed`` until the best point has worse neighbours on both sides, then again with the points
    within ``SEED_NOISE`` of the best ranked with ``tie_seed`` too (None: one seed only).
    A sweep that diverged at every lr it tried extends downwards only; one that reached
    ``MAX_POINTS`` lrs stops (its best may then be an edge: :func:`interior` says),
    and so does one whose runs are not all there (``partial``: a cached-only report).
    ``(start, {})`` when no run is there."""
    lrs = {start / LR_FACTOR, start, start * LR_FACTOR}
    best, found = start, {}
    for tie in (None, tie_seed) if tie_seed is not None else (None,):
        while True:
            found = scores(loss, sorted(lrs), seed, tie)
            if not found:
                return start, {}
            best = min(found, key=found.get)
            neighbours = (best / LR_FACTOR, best * LR_FACTOR)
            if not any(math.isfinite(x) for x in found.values()):
                neighbours = (min(lrs) / LR_FACTOR,)  # diverged at every lr tried: lower ones
            missing = {lr for lr in neighbours if not any(math.isclose(lr, x) for x in lrs)}
            if not missing or (partial and len(found) < len(lrs)) or len(lrs) >= MAX_POINTS:
                break
            lrs |= missing
    return best, found


def interior(best: float, found: dict[float, float]) -> bool:
    """Whether ``best`` is finite with both neighbours measured (worse): a sweep that ended properly."""
    lrs = list(found)
    return math.isfinite(found.get(best, math.inf)) and all(
        any(math.isclose(best * f, x) for x in lrs) for f in (1 / LR_FACTOR, LR_FACTOR)
    )
