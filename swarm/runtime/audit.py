"""Checking that a stage computed what it claims: commitments, an unpredictable draw, recomputation.

* **Commitments.** A boundary frame is bound to where it belongs (boundary, direction, step,
  microbatch, weight version) and every byte it carries by :func:`frame_digest`; each node sums the
  digests of what its streams sent and received per step (:class:`CommitmentTally`), the
  coordinator compares senders' and receivers' sums, and nodes keep the frames themselves for a
  window of steps, for auditors.
* **The draw.** Each microbatch is audited independently with probability ``rate``, drawn by its
  auditor from randomness the audited node never sees (:mod:`swarm.node.auditor`), so a node
  cannot tell which of its microbatches will be checked.
* **Recomputation.** An auditor holding the stage's weights as they stood when the step began
  (:class:`StageState`: a sibling replica, whose weights are the same every step) recomputes its
  output (forward) and its input gradient (backward) from the frames its neighbours kept
  (:class:`Evidence`) and compares them with the claimed ones by relative L2 error and cosine
  (:func:`compare`, :class:`StageAuditor`) against a tolerance for the pair of devices and
  precisions involved (:data:`TOLERANCES`). A sign flip is a relative error of 2, noise of the same
  norm ~1.4; the tolerances are orders of magnitude below.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass

import torch

from swarm.core.subspace import SubspaceRotation
from swarm.runtime.wire import ActivationFrame, GradientFrame
from swarm.runtime.worker import StageWorker

DIRECTIONS = ("forward", "backward")
SIDES = ("sent", "received")  # which end of a stream saw a frame


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


# The unit roundoff of the float wire formats (audits run only with these: ``RunConfig.audits``).
# Frames carry values rounded to the format, so an auditor whose recomputation differs from the
# honest node's in the last fp32 bits can round an element to the neighbouring value: at most one
# unit per element, a relative L2 error of at most the roundoff. Measured live (tiny preset, 1344
# honest recomputations across processes): fp32 frames at most 1.3e-6 off, bf16 frames 7.1e-4.
WIRE_ROUNDOFF = {"fp64": 0.0, "fp32": 0.0, "fp16": 2.0**-11, "bf16": 2.0**-8}


def audit_tolerance(precision: str, forward_format: str, backward_format: str) -> Tolerance:
    """How far an honest sibling may be when nothing is known of its device: the cross-device
    compute tolerance for ``precision`` plus the coarser wire format's roundoff."""
    base = TOLERANCES[(False, precision)]
    rel = base.max_rel_l2 + max(WIRE_ROUNDOFF[forward_format], WIRE_ROUNDOFF[backward_format])
    return Tolerance(rel, min(base.min_cosine, 1 - rel**2))


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
    """What a node's boundary streams sent and received, step by step (:func:`frame_digest`), and
    the frames themselves for the last ``window`` steps (0: none kept), for auditors
    (:meth:`kept`; ``Stage.FetchEvidence``)."""

    def __init__(self, window: int = 0) -> None:
        self.window = window
        self._steps: dict[int, dict[tuple[int, str], FrameTally]] = {}
        self._frames: dict[tuple[int, int, str, int, str], ActivationFrame | GradientFrame] = {}
        self._newest = -1

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
        if self.window:
            self._frames[(frame.step, boundary, direction, frame.microbatch, side)] = frame
            if frame.step > self._newest:
                self._newest = frame.step
                self._frames = {k: f for k, f in self._frames.items() if k[0] > frame.step - self.window}

    def kept(
        self, step: int, boundary: int, direction: str, microbatch: int, side: str
    ) -> ActivationFrame | GradientFrame | None:
        """The frame kept for these coordinates (None: never seen, or older than the window)."""
        return self._frames.get((step, boundary, direction, microbatch, side))

    def new_epoch(self) -> None:
        """Forget the kept frames: a new plan epoch may run the same step numbers again."""
        self._frames.clear()
        self._newest = -1

    def take(self, step: int) -> list[FrameTally]:
        """The tallies of ``step`` (forgetting it and every earlier step: they will not be reported)."""
        taken = self._steps.pop(step, {})
        for old in [s for s in self._steps if s < step]:
            del self._steps[old]
        return sorted(taken.values(), key=lambda t: (t.boundary, t.direction))


# -- recomputing a sibling's microbatch ---------------------------------------------------------


@dataclass(frozen=True)
class StageState:
    """A stage's weights as they stood when a step began (before the step's pending rotation):
    what every replica of it computed that step's microbatches with."""

    step: int
    weights: dict[str, torch.Tensor]
    version: int
    pending_rotation: SubspaceRotation | None

    @classmethod
    def capture(cls, worker: StageWorker, step: int) -> StageState:
        weights = {k: v.detach().clone() for k, v in worker.stage.state_dict().items()}
        return cls(step, weights, worker.version, worker.pending_rotation)


@dataclass(frozen=True)
class Evidence:
    """What one microbatch of a stage crossed its boundaries with, as its neighbours kept it:
    ``inputs`` (the activation it received; None on stage 0), ``output`` (the activation it sent;
    None on the last stage, whose token ids come from ``inputs``), ``grad_out`` (the gradient it
    received; None on the last stage) and ``grad_in`` (the gradient it sent; None on stage 0)."""

    inputs: ActivationFrame | None
    output: ActivationFrame | None
    grad_out: GradientFrame | None
    grad_in: GradientFrame | None


@dataclass(frozen=True)
class Verdict:
    """An audit's outcome: the forward and backward comparisons (None: not checked) against ``tolerance``."""

    forward: Comparison | None
    backward: Comparison | None
    tolerance: Tolerance

    @property
    def matches(self) -> bool:
        return all(c.within(self.tolerance) for c in (self.forward, self.backward) if c is not None)

    @property
    def deciding(self) -> tuple[str, Comparison | None]:
        """The direction that failed (or, on a match, the first checked) and its comparison."""
        checked = [(d, c) for d, c in zip(DIRECTIONS, (self.forward, self.backward), strict=True) if c]
        failed = [(d, c) for d, c in checked if not c.within(self.tolerance)]
        return (failed or checked or [("", None)])[0]


class StageAuditor:
    """A private copy of stage ``index`` that recomputes a sibling's microbatch at a
    :class:`StageState` from :class:`Evidence` and compares with what the sibling sent.

    ``tolerance``: how far an honest sibling may be (:data:`TOLERANCES`; auditors do not know the
    audited node's device, so nodes use the cross-device one for their precision)."""

    def __init__(self, config, index: int, fixed_embedding, basis, device, dtype, tolerance: Tolerance):
        self.worker = StageWorker(config, index, fixed_embedding, basis, device, dtype)
        self.tolerance = tolerance
        self._lock = threading.Lock()  # one recomputation at a time on the private copy

    def check(self, state: StageState, microbatch: int, evidence: Evidence) -> Verdict:
        """Recompute the microbatch: its output (not on the last stage) and, given the gradient it
        received, its input gradient (not on stage 0). Malformed evidence raises ``PayloadError``.
        Thread-safe (checks run one at a time)."""
        with self._lock:
            return self._check(state, microbatch, evidence)

    def _check(self, state: StageState, microbatch: int, evidence: Evidence) -> Verdict:
        w = self._at(state)
        step, version = state.step, w.version
        if w.is_first:
            if evidence.output is None:
                raise ValueError("stage 0's audit needs its output frame (the token ids ride on it)")
            _, source = w.outbound.decode_activation(evidence.output, version, w.device, w.dtype)
        else:
            if evidence.inputs is None:
                raise ValueError(f"stage {w.index}'s audit needs its input frame")
            source = evidence.inputs
        backward = not w.is_first and evidence.grad_in is not None
        backward = backward and (w.is_last or evidence.grad_out is not None)
        out = w.forward(step, microbatch, source, train=backward)
        forward = None
        if not w.is_last and evidence.output is not None:
            ref, _ = w.outbound.decode_activation(out, version, w.device, w.dtype)
            claimed, _ = w.outbound.decode_activation(evidence.output, version, w.device, w.dtype)
            forward = compare(ref, claimed)
        grads = None
        if backward:
            mine = w.backward(step, microbatch, None if w.is_last else evidence.grad_out)
            inputs = evidence.inputs
            shape = torch.Size([inputs.batch, inputs.seq_len, w.inbound.map.width])
            ref = w.inbound.decode_gradient(mine, version, shape, w.device, w.dtype)
            claimed = w.inbound.decode_gradient(evidence.grad_in, version, shape, w.device, w.dtype)
            grads = compare(ref, claimed)
        return Verdict(forward, grads, self.tolerance)

    def _at(self, state: StageState) -> StageWorker:
        """The private worker at ``state``, ready for the step's microbatches."""
        w = self.worker
        with torch.no_grad():
            w.stage.load_state_dict(state.weights)
        w.stage.zero_grad(set_to_none=True)
        w.version, w.pending_rotation = state.version, state.pending_rotation
        w.begin_step(state.step)
        return w
