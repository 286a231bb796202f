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
    # One subspace boundary's maps per token: project on the sender and lift on the receiver,
    # forward and backward together (0: not measured, or a dense boundary that has none).
    boundary_us_per_token: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward_us_per_token_layer", "backward_us_per_token_layer", "boundary_us_per_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"compute profile {self.name!r}: {name}={value} must be a finite time >= 0")

    def stage_seconds(self, layers: int, tokens: int) -> tuple[float, float]:
        """Forward and backward seconds of ``layers`` layers on ``tokens`` tokens."""
        scale = layers * tokens * 1e-6
        return self.forward_us_per_token_layer * scale, self.backward_us_per_token_layer * scale

    def boundary_side_seconds(self, tokens: int) -> float:
        """Forward (and, equally, backward) seconds of one side of a boundary's maps on ``tokens`` tokens.

        The measured total is split evenly four ways: project and lift are the same size of matrix
        product (tokens x d x k), each forward the same as its backward.
        """
        return self.boundary_us_per_token * tokens * 1e-6 / 4

    def tokens_per_second(self, layers: int, boundary_sides: int = 0) -> float:
        """The rate of a stage of ``layers`` layers doing forward and backward, with nothing else;
        ``boundary_sides``: the subspace boundary maps it runs too (1 on an end stage, 2 in the middle)."""
        per_token = (self.forward_us_per_token_layer + self.backward_us_per_token_layer) * 1e-6 * layers
        per_token += 2 * self.boundary_side_seconds(1) * boundary_sides
        return 1.0 / per_token if per_token > 0 else math.inf

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


def boundary_sides(codec_kind: str, first: bool, last: bool) -> int:
    """The subspace boundary maps a stage runs: a lift unless it is the first stage, a project unless
    it is the last (none for a dense boundary, which has no maps)."""
    return int(not first) + int(not last) if codec_kind == "subspace" else 0


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
