"""How initial scales and learning rates follow the model's width: the parametrisation.

Three parametrisations, the same dense model at ``d_model == base_width`` (a constrained one differs
there only by the rank factor ``s`` below):

* ``standard``: every matrix starts at ``init_std`` (residual writes ``init_std / sqrt(2L)``),
  every group trains at ``lr``, the fixed embedding's rows have unit norm. What the project
  used before widths were compared; hyperparameters tuned at one width do not carry over.
* ``mup`` (muP for Adam, Tensor Programs V, with ``m = d_model / base_width``):

  ============================  ==========================  ==========================
  parameter                     initial std                 AdamW lr
  ============================  ==========================  ==========================
  hidden (qkv, gate_up)         ``std / sqrt(m)``           ``lr / m``
  residual write (dense)        ``write_std / sqrt(m)``     ``lr / m``
  residual write ``W'`` (k x in) ``write_std / sqrt(m) * s`` ``lr / m * s``
  trainable embedding ``C``     0                           ``lr * s``
  LM head                       ``std / m``                 ``lr / m``
  norms, dense embedding        as standard                 ``lr``
  fixed embedding               entries ``1/sqrt(base)``    (frozen)
  ============================  ==========================  ==========================

  ``s = sqrt(d/k)`` (1 for dense writes): a constrained write reaches the residual stream
  through ``U`` (d x k, orthonormal), so with the same per-entry scale its output and an
  AdamW step on it would move the residual stream by ``sqrt(k)`` where a dense write moves
  it by ``sqrt(d)``; ``s`` restores the dense write's norm at every width and rank. The
  fixed embedding keeps its per-coordinate scale (so its share of the residual stream does
  not fade against the writes as ``d`` grows). Fan-ins (``d`` and ``d_ff``) grow with ``d``,
  so one ``m`` serves both. The head count grows with ``d`` at a fixed head size, so the
  attention scale needs no change.
* ``mup-anchored``: muP with ``s = sqrt(d / base_width)``, i.e. ``sqrt(d/k)`` divided by its value
  ``sqrt(base_width/k)`` at the base width. At ``d_model == base_width`` it is the standard model
  for every rank (the base model is the one tuned there, as muP prescribes); away from it, at a
  fixed rank, every scale moves with ``d`` exactly as under ``mup``. ``mup``'s factor also
  multiplies a constrained model's write and embedding lr by ``sqrt(base_width/k)`` over the
  hidden matrices' at the base width (4x at d=128, k=8), a ratio no global lr can tune away.

Scales only: the subspace property, exact gradients and rotations do not depend on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarm.core.config import ModelConfig


@dataclass(frozen=True)
class Scale:
    """Multipliers of one parameter: of the base init std and of the base learning rate."""

    init: float
    lr: float


def is_mup(model: ModelConfig) -> bool:
    """Whether the model follows one of the muP rules (``mup`` or ``mup-anchored``)."""
    return model.parametrisation != "standard"


def width_multiplier(model: ModelConfig) -> float:
    """``m = d_model / base_width`` under muP; 1 under the standard parametrisation."""
    return model.d_model / model.base_width if is_mup(model) else 1.0


def subspace_factor(model: ModelConfig, rank: int) -> float:
    """For a constrained write or embedding of rank ``k``: ``sqrt(d/k)`` under ``mup``,
    ``sqrt(d/base_width)`` under ``mup-anchored``; 1 under the standard parametrisation or
    for a dense one (``rank`` 0)."""
    if not rank or not is_mup(model):
        return 1.0
    anchor = model.base_width if model.parametrisation == "mup-anchored" else rank
    return math.sqrt(model.d_model / anchor)


def parameter_scale(model: ModelConfig, kind: str, rank: int = 0) -> Scale:
    """The multipliers of a parameter of ``kind`` (``hidden``, ``write``, ``embedding``, ``head``,
    ``vector``); ``rank``: the width of its basis when it is a constrained write or embedding."""
    m = width_multiplier(model)
    s = subspace_factor(model, rank)
    if kind in ("hidden", "write"):
        return Scale(s / math.sqrt(m), s / m)
    if kind == "head":
        return Scale(1 / m, 1 / m)
    if kind == "embedding":
        return Scale(1.0, s)
    if kind == "vector":
        return Scale(1.0, 1.0)
    raise ValueError(f"unknown parameter kind {kind!r}")


def fixed_embedding_width(model: ModelConfig) -> int:
    """The frozen embedding's entries have std ``1/sqrt(this)``: ``base_width`` under muP (a constant
    per-coordinate scale), ``d_model`` under the standard parametrisation (rows of unit norm)."""
    return model.base_width if is_mup(model) else model.d_model
