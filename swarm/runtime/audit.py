"""Checking that a stage computed what it claims: commitments, an unpredictable draw, recomputation.

* **Commitments.** A boundary frame's payload is bound to where it belongs (run, epoch, step,
  microbatch, stage, weight version, direction) by ``sha256(key || sha256(payload))``; the sender
  keeps what it sent for a window of steps (:class:`CommitLog`), so it cannot later claim it sent
  something else, and a payload whose commitment does not match is refused (:class:`CommitmentError`).
* **The draw.** Which microbatches of a step are audited is ``HMAC(secret, step/stage/microbatch)``
  below ``rate``: a secret the coordinator reveals only after the step's commitments, so a node
  cannot tell in advance which of its microbatches will be checked (:func:`drawn`).
* **Recomputation.** An auditor holding the stage's weights at that version recomputes its output
  (forward) and its input gradient (backward) from the committed inputs and compares them with the
  claimed ones by relative L2 error and cosine (:func:`compare`) against a tolerance for the pair
  of devices and precisions involved (:data:`TOLERANCES`). A sign flip is a relative error of 2, noise
  of the same norm ~1.4; the tolerances are orders of magnitude below.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import asdict, dataclass

import torch

from swarm.runtime.wire import ActivationFrame, GradientFrame

DIRECTIONS = ("forward", "backward")


class CommitmentError(ValueError):
    """A payload that was not committed, or differs from what was."""


@dataclass(frozen=True)
class FrameKey:
    """Where a boundary payload belongs; ``stage`` is its sender."""

    run: str
    epoch: int
    step: int
    microbatch: int
    stage: int
    version: int  # the sender's weight version (its optimizer steps so far)
    direction: str

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction {self.direction!r} must be one of {DIRECTIONS}")

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


def commitment(key: FrameKey, payload: bytes) -> str:
    """The hex commitment of ``payload`` at ``key``."""
    return hashlib.sha256(key.encode() + b"\0" + hashlib.sha256(payload).digest()).hexdigest()


def tensor_payload(t: torch.Tensor) -> bytes:
    """A tensor's bytes with its dtype and shape (what a commitment over a decoded tensor covers)."""
    t = t.detach().contiguous().cpu()
    head = json.dumps({"dtype": str(t.dtype), "shape": list(t.shape)}).encode()
    return struct.pack("<I", len(head)) + head + t.view(torch.uint8).numpy().tobytes()


class CommitLog:
    """What one node committed to (and kept), for the last ``window`` steps."""

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.window = window
        self._kept: dict[FrameKey, tuple[str, bytes]] = {}

    def commit(self, key: FrameKey, payload: bytes) -> str:
        """Commit to ``payload`` at ``key`` (once: a second, different payload is refused)."""
        digest = commitment(key, payload)
        if key in self._kept and self._kept[key][0] != digest:
            raise CommitmentError(f"{key} was already committed to another payload")
        self._kept[key] = (digest, payload)
        return digest

    def verify(self, key: FrameKey, payload: bytes, digest: str) -> None:
        """Refuse ``payload`` unless it is what ``digest`` committed to at ``key``."""
        if commitment(key, payload) != digest:
            raise CommitmentError(f"the payload of {key} does not match its commitment")

    def payload(self, key: FrameKey) -> bytes:
        """The kept payload of ``key`` (for an auditor); KeyError once pruned or never committed."""
        return self._kept[key][1]

    def prune(self, step: int) -> None:
        """Forget what is older than the window ending at ``step``."""
        self._kept = {k: v for k, v in self._kept.items() if k.step > step - self.window}

    def __len__(self) -> int:
        return len(self._kept)


def drawn(secret: bytes, step: int, stage: int, microbatches: int, rate: float) -> list[int]:
    """The microbatches of ``stage`` at ``step`` to audit: each independently with probability
    ``rate``, a function of the coordinator's ``secret`` (unknown to the nodes until revealed)."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"audit rate {rate} must lie in [0, 1]")
    out = []
    for mb in range(microbatches):
        mac = hmac.new(secret, f"{step}/{stage}/{mb}".encode(), hashlib.sha256).digest()
        if int.from_bytes(mac[:8], "big") < rate * 2**64:
            out.append(mb)
    return out


@dataclass(frozen=True)
class Tolerance:
    max_rel_l2: float
    min_cosine: float


# How far an auditor's recomputation may be from an honest node's output, by whether both compute
# the same way (same device class and precision: the same kernels on the same shapes, bit-identical
# on CPU, GPU reductions may reorder to ~1e-6) and the honest node's precision against an fp32
# auditor's. Measured on the tiny preset (bench verification): an honest bf16 stage is at most
# 1.2e-3 from its fp32 recomputation (cosine >= 0.999999); a skipped layer is >= 1.5e-2 away, a
# sign flip 2, noise of the same norm 1.4.
TOLERANCES: dict[tuple[bool, str], Tolerance] = {
    (True, "fp32"): Tolerance(1e-5, 1 - 1e-9),
    (True, "bf16"): Tolerance(1e-5, 1 - 1e-9),
    (False, "fp32"): Tolerance(1e-4, 1 - 1e-7),
    (False, "bf16"): Tolerance(1e-2, 1 - 1e-4),
}


@dataclass(frozen=True)
class Comparison:
    rel_l2: float
    cosine: float

    def within(self, tolerance: Tolerance) -> bool:
        return self.rel_l2 <= tolerance.max_rel_l2 and self.cosine >= tolerance.min_cosine


def compare(reference: torch.Tensor, claimed: torch.Tensor) -> Comparison:
    """How far ``claimed`` is from the auditor's ``reference`` (NaN or a shape mismatch: infinitely)."""
    if reference.shape != claimed.shape:
        return Comparison(float("inf"), -1.0)
    r, c = reference.detach().double().flatten(), claimed.detach().double().flatten().to(reference.device)
    if not bool(torch.isfinite(c).all()):
        return Comparison(float("inf"), -1.0)
    norm = r.norm().clamp_min(1e-30)
    cosine = float(torch.dot(r, c) / (norm * c.norm().clamp_min(1e-30)))
    return Comparison(float((r - c).norm() / norm), cosine)


def recompute(
    stage: torch.nn.Module,
    tokens: torch.Tensor,
    x_in: torch.Tensor | None,
    grad_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A (not last) stage's output for ``tokens`` and its incoming stream ``x_in`` (``None`` on the
    first stage) with the weights it holds, and, given the output's gradient, the gradient of ``x_in``."""
    x = None if x_in is None else x_in.detach().requires_grad_(grad_out is not None)
    with torch.enable_grad() if grad_out is not None else torch.no_grad():
        out = stage(tokens, x)
        grad_in = None
        if grad_out is not None and x is not None:
            (grad_in,) = torch.autograd.grad(out, x, grad_out)
    return out.detach(), grad_in


def frame_digest(boundary: int, frame: ActivationFrame | GradientFrame) -> int:
    """A boundary frame's commitment as an integer: SHA-256 over where it belongs (boundary,
    direction, step, microbatch, weight version) and every byte it carries."""
    p = frame.payload
    if isinstance(frame, ActivationFrame):
        head = ["forward", frame.batch, frame.seq_len, frame.cut, hashlib.sha256(frame.token_ids).hexdigest()]
    else:
        head = ["backward"]
    head += [
        boundary,
        frame.step,
        frame.microbatch,
        frame.subspace_version,
        frame.zstd,
        p.format,
        p.rows,
        p.cols,
    ]
    h = hashlib.sha256(json.dumps(head).encode() + b"\0" + hashlib.sha256(p.data).digest())
    return int.from_bytes(h.digest(), "big")


@dataclass
class FrameTally:
    """The commitments of one step's frames across one boundary in one direction, as one node saw
    them: summed mod 2^256 (a sum commutes, so the hosts of a stage, whichever microbatches each
    handled, add up to the stage's), and counted."""

    boundary: int
    direction: str
    sent: int = 0
    received: int = 0
    sent_frames: int = 0
    received_frames: int = 0

    def add(self, sent: int, received: int, sent_frames: int, received_frames: int) -> None:
        """Add commitments (summed mod 2^256) and frame counts: one frame's, or a node's tally."""
        self.sent, self.received = (self.sent + sent) % 2**256, (self.received + received) % 2**256
        self.sent_frames += sent_frames
        self.received_frames += received_frames


class CommitmentTally:
    """What a node's boundary streams sent and received, step by step (:func:`frame_digest`)."""

    def __init__(self) -> None:
        self._steps: dict[int, dict[tuple[int, str], FrameTally]] = {}

    def record(self, side: str, boundary: int, frame: ActivationFrame | GradientFrame) -> None:
        """A frame ``side`` ("sent" or "received") on ``boundary``."""
        direction = "forward" if isinstance(frame, ActivationFrame) else "backward"
        key = (boundary, direction)
        tally = self._steps.setdefault(frame.step, {}).setdefault(key, FrameTally(boundary, direction))
        digest = frame_digest(boundary, frame)
        if side == "sent":
            tally.add(digest, 0, 1, 0)
        else:
            tally.add(0, digest, 0, 1)

    def take(self, step: int) -> list[FrameTally]:
        """The tallies of ``step`` (forgetting it and every earlier step: they will not be reported)."""
        taken = self._steps.pop(step, {})
        for old in [s for s in self._steps if s < step]:
            del self._steps[old]
        return sorted(taken.values(), key=lambda t: (t.boundary, t.direction))
