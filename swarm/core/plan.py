"""`swarm plan`: which boundary to train a model with on a given link and device, and why.

For dense and each candidate subspace rank k it estimates, for the whole model split into pipeline
stages (GPipe, a flush per step):

* **tokens/s**: per microbatch each stage's compute (a :class:`~swarm.core.profiles.ComputeProfile`)
  or its boundary's transfer, whichever is slower, ``M + P - 1`` slots per phase plus one round trip
  through the ``P - 1`` hops (the ``paper_scale`` bench's bound);
* **predicted gap** to dense at equal steps: the ``scaling`` bench's law ``a + b ln k + c ln d + e ln s``
  with its uncertainty (an extrapolation far beyond the widths it was fitted on: labelled so);
* **time to dense's final loss**: a run that ends ``g`` above dense needs ``(1 + g)^(1/alpha)`` times
  the steps, ``alpha`` being dense's loss-vs-steps exponent from the same bench. Taken pessimistically:
  ``g`` is the predicted gap plus its uncertainty, and never below zero (no method is credited with
  beating dense per step).

The recommendation is the soonest to dense's loss (so counted) among the methods whose predicted
gap is within ``max_gap``; dense when none is. All of it is an estimate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from swarm.core.config import ModelConfig
from swarm.core.profiles import ComputeProfile

BF16 = 2  # bytes per value on the wire


@dataclass(frozen=True)
class GapLaw:
    """``gap = a + b ln k + c ln d + e ln s`` with a one-sd ``uncertainty``; ``alpha``: dense's loss ~
    steps^-alpha; ``source``: where it was measured."""

    coef: tuple[float, float, float, float]
    uncertainty: float
    alpha: float
    source: str

    def gap(self, k: int, d: int, steps: int) -> float:
        a, b, c, e = self.coef
        return a + b * math.log(k) + c * math.log(d) + e * math.log(steps)

    @classmethod
    def load(cls, path: str | Path) -> GapLaw:
        """A law file (:data:`DEFAULT_LAW`) or a ``scaling`` bench result (``scaling.json``) holding one."""
        data = json.loads(Path(path).read_text())
        law = data.get("law", data)
        if "coef" not in law:
            raise ValueError(f"{path}: no fitted law ({law.get('error', 'no coef')})")
        return cls(tuple(law["coef"]), law["loo_error"], law["alpha"], law.get("source", str(path)))


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
) -> list[Candidate]:
    """Dense, then each rank in ``ranks`` (those below d)."""
    dense_tps = tokens_per_second(model, profile, link, n_stages, microbatches, microbatch_tokens, 0)
    out = [Candidate("dense bf16", 0, dense_tps, 0.0, 0.0, 1.0, 1.0)]
    for k in ranks:
        if not 0 < k < model.d_model:
            continue
        tps = tokens_per_second(model, profile, link, n_stages, microbatches, microbatch_tokens, k)
        gap = law.gap(k, model.d_model, steps)
        factor = (1 + max(gap + law.uncertainty, 0.0)) ** (1 / law.alpha)
        out.append(
            Candidate(f"subspace k={k} bf16", k, tps, gap, law.uncertainty, factor, tps / dense_tps / factor)
        )
    return out


def recommend(candidates: list[Candidate], max_gap: float) -> Candidate:
    """The soonest to dense's loss among those whose predicted gap is within ``max_gap``."""
    allowed = [c for c in candidates if c.rank == 0 or c.gap <= max_gap]
    return max(allowed, key=lambda c: c.speedup)
