"""`swarm plan`: which boundary to train a model with on a given link and device, and why.

For dense and each candidate subspace rank k it estimates, for the whole model split into pipeline
stages (GPipe, a flush per step):

* **tokens/s**: per microbatch each stage's compute (a :class:`~swarm.core.profiles.ComputeProfile`)
  or its boundary's transfer, whichever is slower, ``M + P - 1`` slots per phase plus one round trip
  through the ``P - 1`` hops (the ``paper_scale`` bench's bound);
* **gap** to dense at equal steps, both with one optimizer (``--optimizer``): measured, where the
  ``scaling`` bench ran that width and rank with it on a model of that depth and vocabulary (its
  best parametrisation there, with the lr it ran at, the uncertainty its seeds allow); else, for
  the optimizer the law was fitted on (AdamW), predicted
  by the bench's law ``a + b ln k + c ln d + e ln s`` with its uncertainty (an extrapolation far
  beyond the widths it was fitted on: labelled so);
* **time to dense's final loss**: a run that ends ``g`` above dense needs ``(1 + g)^(1/alpha)`` times
  the steps, ``alpha`` being dense's loss-vs-steps exponent from the same bench with the same
  optimizer. Taken pessimistically:
  ``g`` is the predicted gap plus its uncertainty, and never below zero (no method is credited with
  beating dense per step).

The recommendation is the soonest to dense's loss (so counted) among the methods whose gap is
within ``max_gap``; dense when none is. All of it is an estimate. The embedded default run
(``swarm up``) is this recommendation for its own width (tests/test_plan.py checks it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from swarm.core.config import ModelConfig
from swarm.core.profiles import ComputeProfile

BF16 = 2  # bytes per value on the wire


SEED_NOISE = 0.01  # two scaling runs differing only in seed end ~1% apart


@dataclass(frozen=True)
class Measured:
    """A grid point the ``scaling`` bench ran at ``steps``: the subspace model at width ``d`` and rank
    ``rank`` under its best parametrisation there, at the (base) lr it ran at with ``optimizer``; its
    gap to dense (with the same optimizer) over its seeds and each seed's gap."""

    d: int
    rank: int
    parametrisation: str
    lr: float
    gap: float
    seed_gaps: tuple[float, ...]
    optimizer: str = "adamw"

    @property
    def uncertainty(self) -> float:
        """Half its seeds' spread, at least the seed noise; twice the noise for a single seed."""
        if len(self.seed_gaps) < 2:
            return 2 * SEED_NOISE
        return max((max(self.seed_gaps) - min(self.seed_gaps)) / 2, SEED_NOISE)


@dataclass(frozen=True)
class GapLaw:
    """``gap = a + b ln k + c ln d + e ln s`` with a one-sd ``uncertainty``; ``alpha``: dense's loss ~
    steps^-alpha with the law's optimizer (``alphas``: per optimizer, where the bench ran its dense);
    ``source``: where it was measured; ``measured``: the grid's points (per optimizer),
    at ``steps`` steps, of models with ``layers`` layers and a ``vocab``-token vocabulary; the law
    itself is fitted on ``optimizer``'s runs only (against dense with the same optimizer)."""

    coef: tuple[float, float, float, float]
    uncertainty: float
    alpha: float
    source: str
    measured: tuple[Measured, ...] = ()
    steps: int = 1000
    layers: int = 4
    vocab: int = 4096
    optimizer: str = "adamw"
    alphas: dict[str, float] = field(default_factory=dict, hash=False)

    def exponent(self, optimizer: str | None = None) -> float:
        """Dense's loss-vs-steps exponent with ``optimizer`` (None, or one the bench has no dense
        curve of: the law's own)."""
        return self.alphas.get(optimizer or self.optimizer, self.alpha)

    def gap(self, k: int, d: int, steps: int) -> float:
        a, b, c, e = self.coef
        return a + b * math.log(k) + c * math.log(d) + e * math.log(steps)

    def points(self, model: ModelConfig, steps: int, optimizer: str | None = None) -> dict[int, Measured]:
        """Rank -> the grid point measured at the model's width with ``optimizer`` (None: the law's),
        if the bench ran ``steps`` steps on a model of this depth and vocabulary (else none)."""
        if (model.n_layers, model.vocab_size, steps) != (self.layers, self.vocab, self.steps):
            return {}
        optimizer = optimizer or self.optimizer
        return {m.rank: m for m in self.measured if m.d == model.d_model and m.optimizer == optimizer}

    @classmethod
    def load(cls, path: str | Path) -> GapLaw:
        """A law file (:data:`DEFAULT_LAW`) or a ``scaling`` bench result (``scaling.json``) holding one."""
        data = json.loads(Path(path).read_text())
        law = data.get("law", data)
        if "coef" not in law:
            raise ValueError(f"{path}: no fitted law ({law.get('error', 'no coef')})")
        measured = tuple(
            Measured(
                m["d"],
                m["rank"],
                m["parametrisation"],
                m["lr"],
                m["gap"],
                tuple(m["seed_gaps"]),
                m.get("optimizer", "adamw"),
            )
            for m in law.get("measured", [])
        )
        shape = law.get("shape", {})
        return cls(
            tuple(law["coef"]),
            law["loo_error"],
            law["alpha"],
            law.get("source", str(path)),
            measured,
            law.get("steps", 1000),
            shape.get("n_layers", 4),
            shape.get("vocab_size", 4096),
            law.get("optimizer", "adamw"),
            law.get("alphas", {}),
        )


DEFAULT_LAW = Path(__file__).resolve().parent.parent / "profiles" / "laws" / "subspace-gap.json"


@dataclass(frozen=True)
class Link:
    mbps: float
    rtt_ms: float


@dataclass(frozen=True)
class Candidate:
    name: str
    rank: int  # 0: dense
    tokens_per_s: float
    gap: float
    uncertainty: float
    steps_factor: float  # steps to dense's final loss over dense's (pessimistic gap)
    speedup: float  # dense's time to its final loss over this method's (pessimistic gap)
    measured: Measured | None = None  # the grid point the gap was measured at (None: the law's)


def tokens_per_second(
    model: ModelConfig,
    profile: ComputeProfile,
    link: Link,
    n_stages: int,
    microbatches: int,
    microbatch_tokens: int,
    rank: int,
) -> float:
    """GPipe's tokens/s for the model split evenly into ``n_stages``, boundaries carrying ``rank``
    bf16 values per token each way (0: the dense d)."""
    width = rank or model.d_model
    rate = link.mbps * 1e6 / 8
    layers = [model.n_layers // n_stages + (i < model.n_layers % n_stages) for i in range(n_stages)]
    forward = backward = 0.0
    for i, n in enumerate(layers):
        f, b = profile.stage_seconds(n, microbatch_tokens)
        sides = (i > 0) + (i < n_stages - 1) if rank else 0
        maps = profile.boundary_side_seconds(microbatch_tokens) * sides
        forward, backward = max(forward, f + maps), max(backward, b + maps)
    if n_stages > 1:
        transfer = width * BF16 * microbatch_tokens / rate
        forward, backward = max(forward, transfer), max(backward, transfer)
    step_s = (microbatches + n_stages - 1) * (forward + backward) + (n_stages - 1) * link.rtt_ms / 1e3
    return microbatches * microbatch_tokens / step_s


def plan(
    model: ModelConfig,
    profile: ComputeProfile,
    link: Link,
    law: GapLaw,
    ranks: list[int],
    n_stages: int,
    microbatches: int = 8,
    microbatch_tokens: int = 2048,
    steps: int = 1000,
    optimizer: str = "adamw",
) -> list[Candidate]:
    """Dense, then each rank in ``ranks`` and each the law measured at this width (those below d),
    both trained with ``optimizer``. The law holds for its own optimizer only: with another, only
    the ranks measured with it at this width are candidates. Steps to dense's loss use dense's
    loss-vs-steps exponent with ``optimizer`` (:meth:`GapLaw.exponent`)."""
    d = model.d_model
    dense_tps = tokens_per_second(model, profile, link, n_stages, microbatches, microbatch_tokens, 0)
    out = [Candidate("dense bf16", 0, dense_tps, 0.0, 0.0, 1.0, 1.0)]
    points = law.points(model, steps, optimizer)
    for k in sorted(set(ranks if optimizer == law.optimizer else ()) | set(points)):
        if not 0 < k < d:
            continue
        tps = tokens_per_second(model, profile, link, n_stages, microbatches, microbatch_tokens, k)
        point = points.get(k)
        if point:
            gap, uncertainty = point.gap, point.uncertainty
        else:
            gap, uncertainty = law.gap(k, d, steps), law.uncertainty
        factor = (1 + max(gap + uncertainty, 0.0)) ** (1 / law.exponent(optimizer))
        name = f"subspace k={k} bf16"
        out.append(Candidate(name, k, tps, gap, uncertainty, factor, tps / dense_tps / factor, point))
    return out


def recommend(candidates: list[Candidate], max_gap: float) -> Candidate:
    """The soonest to dense's loss among those whose (measured or predicted) gap is within ``max_gap``."""
    allowed = [c for c in candidates if c.rank == 0 or c.gap <= max_gap]
    return max(allowed, key=lambda c: c.speedup)
