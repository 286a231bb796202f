"""Compute profiles: a device's per-layer forward/backward time per token, kept as JSON.

A profile is what :mod:`swarm.runtime.emulation` turns into waits, and what the paper-scale
benchmarks read. This module is torch-free, so the run configuration can check a profile's name.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"


@dataclass(frozen=True)
class ComputeProfile:
    """One device's compute time per token for one transformer layer of a model preset."""

    name: str
    model: str  # the preset the times were measured (or derived) for
    device: str
    source: str  # where the numbers come from: a measurement command, or a derivation
    forward_us_per_token_layer: float
    backward_us_per_token_layer: float
    seq_len: int  # the sequence length the times hold for (attention grows with it)

    def __post_init__(self) -> None:
        for name in ("forward_us_per_token_layer", "backward_us_per_token_layer"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"compute profile {self.name!r}: {name}={value} must be a finite time >= 0")

    def stage_seconds(self, layers: int, tokens: int) -> tuple[float, float]:
        """Forward and backward seconds of ``layers`` layers on ``tokens`` tokens."""
        scale = layers * tokens * 1e-6
        return self.forward_us_per_token_layer * scale, self.backward_us_per_token_layer * scale

    def tokens_per_second(self, layers: int) -> float:
        """The rate of a stage of ``layers`` layers doing forward and backward, with nothing else."""
        per_token = (self.forward_us_per_token_layer + self.backward_us_per_token_layer) * 1e-6 * layers
        return 1.0 / per_token if per_token > 0 else math.inf

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


def load_profile(name_or_path: str) -> ComputeProfile:
    """A bundled profile by name (``swarm/profiles/NAME.json``) or a JSON file by path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILE_DIR / f"{name_or_path}.json"
    if not path.is_file():
        bundled = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
        raise ValueError(f"no compute profile {name_or_path!r}: not a file, nor one of {bundled}")
    fields = json.loads(path.read_text())
    try:
        return ComputeProfile(**fields)
    except TypeError as e:
        raise ValueError(f"compute profile {path}: {e}") from None
