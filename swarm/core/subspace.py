"""The shared subspace ``U``: its construction, boundary statistics and Grassmann rotations.

* :func:`random_basis` builds the initial orthonormal ``U`` (d x k) from a seed.
* :class:`BoundaryStatistic` accumulates, from the activation gradients ``G`` seen at a
  boundary, the d x k matrix ``sum G^T (G U)`` (never the d x d ``G^T G``) and the
  off-subspace energy ``||(I - P) G||^2 / ||G||^2``.
* :func:`grassmann_step` moves ``U`` along the Grassmann geodesic that increases
  ``tr(U^T M U)``, ``M = sum G^T G``: the subspace turns toward where the gradients live.
* :func:`grow_basis` appends to ``U`` the off-subspace directions the gradients lean on most:
  a rank that grows.
* :class:`SubspaceRotation` is the versioned object the coordinator broadcasts: the new
  basis (turned, or grown by some columns) and the optimizer step at which every stage
  switches to it.
* :func:`rotate_stage` re-expresses a stage's constrained parameters (and their AdamW
  state) in the new basis: ``W <- W P'``, ``C <- C U^T U'``; a grown basis extends ``W'``
  with zero rows and ``C`` with zero columns, which changes no output.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from swarm.codecs.base import PayloadError
from swarm.core.config import RotationConfig, RunConfig
from swarm.core.model import ResidualWrite, Stage, fixed_embedding, name_seed
from swarm.core.width import fixed_embedding_width

if TYPE_CHECKING:
    from swarm.core.optim import StageOptimizer


def random_basis(d: int, k: int, seed: int) -> torch.Tensor:
    """An orthonormal d x k basis (float64) from the QR of a seeded Gaussian.

    Kept in float64 so a stage cast to float64 sees ``U^T U = I`` to float64 precision.
    """
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, k, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def off_subspace_energy(grad: torch.Tensor, basis: torch.Tensor) -> tuple[float, float]:
    """(``||(I-P)G||^2``, ``||G||^2``) for gradient rows ``G`` (n x d) and ``P = U U^T``."""
    g = grad.reshape(-1, grad.shape[-1]).double()
    inside = (g @ basis.double()).pow(2).sum().item()
    total = g.pow(2).sum().item()
    return max(total - inside, 0.0), total


class BoundaryStatistic:
    """Accumulates ``sum G^T (G U)`` and the off-subspace energy of boundary gradients."""

    def __init__(self, basis: torch.Tensor):
        self.basis = basis
        self.lifetime_off, self.lifetime_total = 0.0, 0.0  # never reset: for rates between reads
        self.reset()

    def reset(self) -> None:
        self.gram_times_basis = torch.zeros(self.basis.shape, dtype=torch.float64, device=self.basis.device)
        self.off_energy = 0.0
        self.total_energy = 0.0
        self.count = 0

    def add(self, grad: torch.Tensor) -> None:
        g = grad.reshape(-1, grad.shape[-1]).double()
        gu = g @ self.basis.double()
        self.gram_times_basis += g.T @ gu
        total = g.pow(2).sum().item()
        self.total_energy += total
        off = max(total - gu.pow(2).sum().item(), 0.0)
        self.off_energy += off
        self.lifetime_off += off
        self.lifetime_total += total
        self.count += g.shape[0]

    @property
    def off_fraction(self) -> float:
        """``||(I-P)G|| / ||G||`` over everything accumulated since the last reset."""
        return (self.off_energy / self.total_energy) ** 0.5 if self.total_energy > 0 else 0.0


def grassmann_step(basis: torch.Tensor, gram_times_basis: torch.Tensor, max_angle: float) -> torch.Tensor:
    """One geodesic step on the Grassmannian toward larger ``tr(U^T M U)``.

    ``gram_times_basis`` is ``M U``. The direction is ``D = (I - P) M U`` with thin SVD
    ``D = Q S V^T``; the step is ``U' = U V cos(S t) V^T + Q sin(S t) V^T``. The step
    length ``t = min(max_angle / S_max, 1 / lambda_max(U^T M U))`` is scale-free: for a
    gradient direction at angle ``phi`` to the subspace it turns by about ``tan(phi)``,
    so the step shrinks as the subspace catches the gradients, and ``max_angle`` (radians)
    caps the largest principal angle between ``U`` and ``U'``. Returns ``U`` unchanged
    when ``D`` vanishes.
    """
    u = basis.double()
    mu = gram_times_basis.double()
    direction = mu - u @ (u.T @ mu)
    q, s, vh = torch.linalg.svd(direction, full_matrices=False)
    if s[0] <= 1e-12 * max(mu.norm().item(), 1e-300):
        return basis.clone()
    in_subspace = torch.linalg.eigvalsh(u.T @ mu).max().clamp_min(1e-300)
    t = min(max_angle / s[0], 1.0 / in_subspace)
    v = vh.T
    new = u @ v @ torch.diag(torch.cos(s * t)) @ vh + q @ torch.diag(torch.sin(s * t)) @ vh
    # Re-orthonormalise against accumulated rounding; the sign fix keeps columns continuous.
    qn, r = torch.linalg.qr(new)
    return (qn * torch.sign(torch.diagonal(r))).to(basis.dtype)


def grow_basis(basis: torch.Tensor, gram_times_basis: torch.Tensor, extra: int, seed: int) -> torch.Tensor:
    """``[U, Q]``: ``U`` kept column for column, plus ``extra`` orthonormal columns ``Q``.

    ``Q`` are the leading left singular vectors of ``D = (I - P) M U`` (``gram_times_basis`` is
    ``M U``): the off-subspace directions the boundary gradients couple to the subspace most,
    the very directions a Grassmann step would turn toward. Directions ``D`` does not supply
    (``extra`` above its rank, or vanishing gradients) come from a seeded Gaussian, so every
    stage and the coordinator compute the same columns.
    """
    u = basis.double()
    d, k = u.shape
    if not 0 < extra <= d - k:
        raise ValueError(f"cannot grow a {d}x{k} basis by {extra} columns")
    mu = gram_times_basis.double()
    direction = mu - u @ (u.T @ mu)
    q, s, _ = torch.linalg.svd(direction, full_matrices=False)
    keep = int((s > 1e-8 * max(s.max().item(), 1e-300)).sum()) if s.numel() else 0
    gen = torch.Generator().manual_seed(seed)
    fill = torch.randn(d, extra, generator=gen, dtype=torch.float64)
    candidates = torch.cat([q[:, : min(keep, extra)], fill], dim=1)[:, :extra]
    for _ in range(2):  # project out U twice: one pass leaves rounding-level components
        candidates = candidates - u @ (u.T @ candidates)
    qn, r = torch.linalg.qr(candidates)
    return torch.cat([u, qn * torch.sign(torch.diagonal(r))], dim=1).to(basis.dtype)


@dataclass(frozen=True)
class SubspaceRotation:
    """A new basis and the optimizer step from which it is in force (version increments by one).

    The basis travels in float64 (d*k*8 bytes, once per rotation interval), so every stage,
    whatever its compute dtype, casts the very same numbers.
    """

    version: int
    effective_step: int
    basis: torch.Tensor

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    def to_bytes(self) -> bytes:
        b = self.basis.detach().cpu().double().contiguous()
        header = struct.pack("<QQII", self.version, self.effective_step, *b.shape)
        return header + b.numpy().tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> SubspaceRotation:
        if len(data) < 24:
            raise PayloadError("rotation message shorter than its header")
        version, step, d, k = struct.unpack_from("<QQII", data)
        if not 0 < k <= d:
            raise PayloadError(f"rotation basis shape {d}x{k} is not a d x k basis with 0 < k <= d")
        if len(data) != 24 + 8 * d * k:
            raise PayloadError(
                f"rotation for a {d}x{k} basis must be {24 + 8 * d * k} bytes, got {len(data)}"
            )
        basis = torch.frombuffer(bytearray(data[24:]), dtype=torch.float64).view(d, k).clone()
        if not bool(torch.isfinite(basis).all()):
            raise PayloadError("rotation basis holds non-finite values")
        err = (basis.double().T @ basis.double() - torch.eye(k, dtype=torch.float64)).abs().max().item()
        if err > 1e-4:
            raise PayloadError(f"rotation basis is not orthonormal (max |U^T U - I| = {err:.2e})")
        return cls(version, step, basis)


def _rotate_adam_state(state: dict, transform, transform_sq) -> None:
    """AdamW's moments (first like the parameter, second through squares), or Muon's momentum."""
    if "exp_avg" in state:
        state["exp_avg"] = transform(state["exp_avg"]).contiguous()
        state["exp_avg_sq"] = transform_sq(state["exp_avg_sq"]).clamp_min(0).contiguous()
    if "momentum_buffer" in state:
        state["momentum_buffer"] = transform(state["momentum_buffer"]).contiguous()


def _replace(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``tensor`` new contents, possibly of a new shape, keeping the object: optimizers, maps
    and statistics that hold it follow."""
    if value.shape == tensor.shape:
        tensor.copy_(value)
    else:
        tensor.data = value.contiguous()
        if isinstance(tensor, torch.nn.Parameter):
            tensor.grad = None


@torch.no_grad()
def rotate_stage(
    stage: Stage, new_basis: torch.Tensor, optimizer: torch.optim.Optimizer | StageOptimizer | None = None
) -> None:
    """Switch ``stage`` to ``new_basis``: ``W' <- R^T W'`` and ``C <- C R`` with ``R = U^T U'``.

    This is ``W <- W P'`` (the part of each row outside the new subspace is dropped).
    AdamW's first moment (and Muon's momentum) is transformed exactly like its parameter; the second moment,
    which has no exact image, maps through the squared entries of ``R`` (the variance of
    a sum of independent coordinates).

    A grown basis (``U' = [U, Q]``, :func:`grow_basis`) extends instead: ``W'`` and ``C`` get
    zero entries for the new columns (no output changes), so does AdamW's first moment,
    and the second moment of a new column starts at the mean over the old ones, so the
    first updates of the new coordinates are not inflated by an empty variance estimate.
    """
    old = stage.basis
    if old is None:
        raise ValueError("rotate_stage needs a subspace-constrained stage")
    new_basis = new_basis.to(device=old.device, dtype=old.dtype)
    k_old, k_new = old.shape[1], new_basis.shape[1]
    if k_new > k_old and torch.equal(new_basis[:, :k_old], old):
        rows = _grow_rows(k_new - k_old)
    elif k_new == k_old:
        rows = _turn_rows(old.T @ new_basis)
    else:
        raise ValueError(f"a {old.shape[0]}x{k_new} basis neither turns nor grows the {k_old}-column one")
    _map_constrained(stage, rows, optimizer.state if optimizer is not None else {}, k_new)
    _replace(old, new_basis)


@torch.no_grad()
def resize_rank(stage: Stage, rank: int) -> None:
    """Give a stage's constrained parameters and basis the shapes of a ``rank``-column basis (zeros),
    so that a snapshot taken after the rank grew loads into a stage built at the run's first rank."""
    if stage.basis is None:
        raise ValueError("resize_rank needs a subspace-constrained stage")
    _map_constrained(stage, lambda m, sq=False: m.new_zeros(rank, m.shape[1]), {}, rank)
    _replace(stage.basis, stage.basis.new_zeros(stage.basis.shape[0], rank))


def _turn_rows(r: torch.Tensor):
    """The map of rows in coordinates of ``U`` to coordinates of ``U'`` (``R^T m``; ``R^2`` for variances)."""
    r_sq = r * r
    return lambda m, sq=False: (r_sq if sq else r).T @ m


def _grow_rows(extra: int):
    """Append ``extra`` rows: zeros, or (for variances) the mean of the existing rows."""

    def rows(m: torch.Tensor, sq: bool = False) -> torch.Tensor:
        new = m.mean(0, keepdim=True).expand(extra, -1) if sq else m.new_zeros(extra, m.shape[1])
        return torch.cat([m, new], dim=0)

    return rows


def _map_constrained(stage: Stage, rows, state: dict, rank: int) -> None:
    """Apply a map of coordinate rows to every constrained parameter of ``stage`` (``W'``: rows;
    ``C``: columns) and its AdamW moments in ``state``; the writes then have ``rank`` rows."""
    for module in stage.modules():
        if isinstance(module, ResidualWrite) and module.rank:
            _transform(module.weight, state, rows)
            module.rank = rank
    if stage.embed is not None:
        _transform(stage.embed.low, state, lambda m, sq=False: rows(m.T, sq).T)


def _transform(param: torch.nn.Parameter, state: dict, rows) -> None:
    """Apply the row map to a parameter (k x n) or an embedding's transposed view, and its AdamW moments."""
    _replace(param, rows(param))
    if param in state:
        _rotate_adam_state(state[param], rows, lambda v: rows(v, True))


def next_rotation(
    basis: torch.Tensor,
    statistics: list[torch.Tensor],
    version: int,
    effective_step: int,
    config: RotationConfig,
) -> SubspaceRotation:
    """The change that follows ``version``, computed from the summed boundary statistics: the basis
    grows by :meth:`RotationConfig.grows` columns, or else turns by one Grassmann step."""
    total = torch.stack([s.double().cpu() for s in statistics]).sum(0)
    u = basis.detach().cpu().double()
    extra = config.grows(u.shape[1])
    if extra:
        new_basis = grow_basis(u, total, extra, seed=version + 1)
    else:
        new_basis = grassmann_step(u, total, config.max_angle)
    return SubspaceRotation(version + 1, effective_step, new_basis)


def initial_basis(config: RunConfig) -> torch.Tensor | None:
    """The version-0 subspace basis of a run (None without a subspace), regenerated from its seed."""
    m = config.model
    return (
        random_basis(m.d_model, m.subspace_rank, name_seed(config.train.seed, "basis"))
        if m.subspace_rank
        else None
    )


def initial_artifacts(config: RunConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The frozen token embedding and the version-0 basis every stage of a run starts from."""
    m = config.model
    fixed = fixed_embedding(m.vocab_size, m.d_model, config.train.seed, fixed_embedding_width(m))
    return fixed, initial_basis(config)
