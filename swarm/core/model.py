"""A LLaMA-style decoder, readable top to bottom, splittable into pipeline stages.

RMSNorm -> attention with RoPE -> SwiGLU MLP, pre-norm residual blocks. A
:class:`Stage` holds a contiguous range of layers; stage 0 also owns the trainable part
of the token embedding, the last stage the final norm and the LM head. The full model
is simply the stage that holds every layer.

Subspace Networks enter in exactly two places:

* :class:`ResidualWrite` is the only way a block writes to the residual stream
  (attention output and MLP down projection). With a basis ``U`` (d x k) it computes
  ``h W' U^T``: the matrix ``W = W' U^T`` has its rows in ``col(U)`` by construction.
* :class:`TokenEmbedding` is ``E_fixed[tok] + C[tok] U^T``: a frozen full-rank part
  every stage holds, plus a trainable part in the subspace.

So ``X - E_fixed[tok]`` lies in ``col(U)`` at every layer, which is what lets a stage
boundary send ``k`` coordinates per token instead of ``d``. The last stage's output never
crosses a boundary, so its layers may write at full rank (``ModelConfig.full_rank_layers``).

Why a reparametrisation and not a row-wise AdamW on full ``W``: the constraint then
holds exactly, by construction, after any number of steps of *any* optimizer (AdamW,
Muon, hivemind's averaged optimizers) with no projection fighting its state; and the
parameters, their gradients and the optimizer state shrink from ``in x d`` to
``in x k``. A subspace rotation re-expresses ``W'`` in the new basis
(:func:`swarm.core.subspace.rotate_stage`).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from swarm.core.config import ModelConfig
from swarm.core.precision import basis_product
from swarm.core.width import parameter_scale


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (max_seq_len x head_dim/2) for rotary position embeddings."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of ``x`` (B, H, T, hd) by position-dependent angles."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class ResidualWrite(nn.Module):
    """A linear map into the residual stream, ``in -> d``; rows in ``col(U)`` when a basis is given.

    With ``rank > 0`` the weight is ``W'`` (k x in) and the output is ``(h W'^T) U^T``; with
    ``rank = 0`` it is a plain ``d x in`` weight and the basis is ignored.
    """

    def __init__(self, d_in: int, d_model: int, rank: int):
        super().__init__()
        self.rank = rank
        self.weight = nn.Parameter(torch.empty(rank or d_model, d_in))

    def forward(self, h: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(h, self.weight)
        return basis_product(y, basis) if self.rank and basis is not None else y


class LayerCache:
    """Keys and values (B, H, positions, hd) of one layer's earlier positions."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this call's keys and values; returns all of them."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class KVCache:
    """What incremental decoding keeps of the tokens seen so far, for the layers of one stage."""

    def __init__(self):
        self.length = 0  # positions cached
        self.layers: dict[int, LayerCache] = {}

    def layer(self, index: int) -> LayerCache:
        return self.layers.setdefault(index, LayerCache())


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, write_rank: int):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = ResidualWrite(config.d_model, config.d_model, write_rank)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        basis: torch.Tensor | None,
        cache: LayerCache | None = None,
    ):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # q's dtype: bf16 under autocast
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        past = 0
        if cache is not None:
            past = 0 if cache.k is None else cache.k.shape[2]
            k, v = cache.extend(k, v)
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # query i (position past+i) sees keys 0..past+i
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(B, T, -1), basis)


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig, write_rank: int):
        super().__init__()
        self.gate_up = nn.Linear(config.d_model, 2 * config.d_ff, bias=False)
        self.down = ResidualWrite(config.d_ff, config.d_model, write_rank)

    def forward(self, x: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up, basis)


class Block(nn.Module):
    """Layer ``layer`` of the model (its index decides whether its writes are constrained).

    ``rank``: the width of the basis its constrained writes use (default ``subspace_rank``)."""

    def __init__(self, config: ModelConfig, layer: int, rank: int | None = None):
        super().__init__()
        rank = config.write_rank(layer, rank)
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, rank)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config, rank)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        basis: torch.Tensor | None,
        cache: LayerCache | None = None,
    ):
        x = x + self.attn(self.attn_norm(x), cos, sin, basis, cache)
        return x + self.mlp(self.mlp_norm(x), basis)


class Bottleneck(nn.Module):
    """The residual bottleneck the stream passes on entering layer ``layer`` (ResBM-like).

    ``down`` (k x d) maps ``X - E_fixed[tok]`` to the k numbers that cross the boundary; ``up``
    (d x k) lifts them back onto ``E_fixed[tok]``. A stage holds ``down`` when it ends at the
    bottleneck and ``up`` when it starts there; the whole model holds both. Both start as one
    orthonormal basis (``up = down^T``: a projection onto a random k-dimensional subspace).
    """

    def __init__(self, d_model: int, rank: int, down: bool, up: bool):
        super().__init__()
        self.down = nn.Linear(d_model, rank, bias=False) if down else None
        self.up = nn.Linear(rank, d_model, bias=False) if up else None

    def project(self, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return self.down(x - anchor)

    def lift(self, z: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return anchor + self.up(z)


class TokenEmbedding(nn.Module):
    """``E_fixed[tok] + E_low[tok]``: frozen full-rank part plus a trainable part.

    ``E_low`` is ``C U^T`` (C: V x k) under the subspace constraint, else a full V x d
    table; it starts at zero, so every model starts from the same ``E_fixed``.
    """

    def __init__(self, config: ModelConfig, rank: int | None = None):
        super().__init__()
        rank = (rank or config.subspace_rank) if config.constrained else 0
        self.low = nn.Parameter(torch.zeros(config.vocab_size, rank or config.d_model))

    def forward(self, tokens: torch.Tensor, fixed: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
        low = F.embedding(tokens, self.low)
        return fixed[tokens] + (low if basis is None else basis_product(low, basis))


class Stage(nn.Module):
    """Layers ``[start, end)`` of the model, plus the embedding (first stage) or head (last stage).

    ``basis`` is used (and required) only when ``config.constrained``; its width sets the rank
    of the constrained parameters (``subspace_rank``, or more once the rank has grown).
    ``forward(tokens, x)`` takes the token ids (B x T) and, except on the first stage,
    the residual stream entering the stage (B x T x d); it returns the residual stream
    leaving it, or the logits on the last stage. With a :class:`KVCache` the tokens are the
    positions after those already cached (incremental decoding), and are cached in turn.
    ``head=False`` returns the residual stream on the last stage too (its norm and LM head
    then run elsewhere, e.g. on a generation client).
    """

    def __init__(
        self,
        config: ModelConfig,
        start: int,
        end: int,
        fixed_embedding: torch.Tensor,
        basis: torch.Tensor | None,
        seed: int,
    ):
        super().__init__()
        if not 0 <= start < end <= config.n_layers:
            raise ValueError(f"invalid layer range [{start}, {end}) for {config.n_layers} layers")
        if config.constrained and basis is None:
            raise ValueError("a subspace-constrained stage needs its basis")
        self.config, self.start, self.end = config, start, end
        self.is_first, self.is_last = start == 0, end == config.n_layers
        self.register_buffer("fixed_embedding", fixed_embedding, persistent=False)
        self.register_buffer("basis", basis.clone() if config.constrained else None)
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        rank = basis.shape[1] if config.constrained else None  # the basis' width: it may have grown
        self.embed = TokenEmbedding(config, rank) if self.is_first else None
        self.layers = nn.ModuleDict({str(i): Block(config, i, rank) for i in range(start, end)})
        self.norm = RMSNorm(config.d_model, config.norm_eps) if self.is_last else None
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False) if self.is_last else None
        self.bottleneck = nn.ModuleDict(
            {
                str(b): Bottleneck(
                    config.d_model, config.bottleneck_rank, down=start < b <= end, up=start <= b < end
                )
                for b in config.bottleneck_layers
                if start <= b <= end
            }
        )
        init_parameters(self, seed)

    def forward(
        self,
        tokens: torch.Tensor,
        x: torch.Tensor | None = None,
        cache: KVCache | None = None,
        head: bool = True,
    ) -> torch.Tensor:
        past = cache.length if cache is not None else 0
        T = tokens.shape[1]
        if self.config.max_seq_len < past + T:
            raise ValueError(f"sequence length {past + T} exceeds max_seq_len={self.config.max_seq_len}")
        anchor = self.fixed_embedding[tokens] if len(self.bottleneck) else None
        if self.embed is not None:
            x = self.embed(tokens, self.fixed_embedding, self.basis)
        elif x is None:
            raise ValueError(f"stage [{self.start}, {self.end}) needs the incoming residual stream")
        elif str(self.start) in self.bottleneck:  # the k numbers that crossed the boundary
            x = self.bottleneck[str(self.start)].lift(x, anchor.to(x.dtype))
        cos, sin = self.rope_cos[past : past + T].to(x.dtype), self.rope_sin[past : past + T].to(x.dtype)
        for i, block in self.layers.items():
            x = block(x, cos, sin, self.basis, cache.layer(int(i)) if cache is not None else None)
            if str(int(i) + 1) in self.bottleneck:
                bottleneck = self.bottleneck[str(int(i) + 1)]
                x = bottleneck.project(x, anchor.to(x.dtype))
                if bottleneck.up is not None:  # inside this stage: straight through to the next layer
                    x = bottleneck.lift(x, anchor.to(x.dtype))
        if cache is not None:
            cache.length += T
        if self.head is not None and head:
            x = self.head(self.norm(x))
        return x

    def compile_layers(self) -> None:
        """Compile each layer in place with ``torch.compile`` (parameter names stay as they are);
        the first call of each layer per shape and mode (training, evaluation) compiles."""
        for block in self.layers.values():
            block.compile()

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy of the last stage's ``logits`` (computed in fp32)."""
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def init_parameters(stage: Stage, seed: int) -> None:
    """Initialise every parameter from a generator seeded by (run seed, global parameter name).

    Names carry global layer indices, so a stage initialises exactly like the same
    layers of the full model: nodes need no initial weights, only the seed. Scales follow the
    model's parametrisation (:mod:`swarm.core.width`).
    """
    config = stage.config
    write_std = config.init_std / math.sqrt(2 * config.n_layers)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            gen = torch.Generator().manual_seed(name_seed(seed, name))
            kind, rank = parameter_kind(stage, name)
            if name.startswith("bottleneck."):  # both halves from one orthonormal basis per bottleneck
                p.copy_(_bottleneck_basis(stage, name, seed).to(p.dtype).reshape(p.shape))
                continue
            if kind in ("vector", "embedding"):  # norms start at one, the trainable embedding at zero
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
                continue
            sigma = (write_std if kind == "write" else config.init_std) * parameter_scale(
                config, kind, rank
            ).init
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * sigma)


def _bottleneck_basis(stage: Stage, name: str, seed: int) -> torch.Tensor:
    """The orthonormal d x k basis a bottleneck starts from, as ``name`` holds it (down: k x d)."""
    layer = name.split(".")[1]
    gen = torch.Generator().manual_seed(name_seed(seed, f"bottleneck.{layer}"))
    q, r = torch.linalg.qr(
        torch.randn(stage.config.d_model, stage.config.bottleneck_rank, generator=gen, dtype=torch.float64)
    )
    q = q * torch.sign(torch.diagonal(r))
    return q.T if ".down." in name else q


def parameter_kind(stage: Stage, name: str) -> tuple[str, int]:
    """What parameter ``name`` of ``stage`` is, for :func:`swarm.core.width.parameter_scale`, and
    the rank of the basis it lives in (the run's first rank; 0: not constrained). A bottleneck's
    ``down`` (fan-in d) is hidden; its ``up`` (fan-in k, fixed) trains like a vector."""
    config = stage.config
    if name.startswith("bottleneck."):
        return ("hidden" if ".down." in name else "vector"), 0
    if name == "embed.low":
        return "embedding", config.subspace_rank if config.constrained else 0
    if name == "head.weight":
        return "head", 0
    if name.endswith("norm.weight"):
        return "vector", 0
    owner = _owner(stage, name)
    if isinstance(owner, ResidualWrite):
        return "write", config.subspace_rank if owner.rank else 0
    return "hidden", 0


def parameter_kinds(stage: Stage) -> dict[str, str]:
    """Each parameter's kind (:func:`parameter_kind`), by name."""
    return {name: parameter_kind(stage, name)[0] for name, _ in stage.named_parameters()}


def lr_multipliers(stage: Stage) -> dict[str, float]:
    """Each parameter's learning-rate multiplier under the model's parametrisation, by name."""
    return {
        name: parameter_scale(stage.config, *parameter_kind(stage, name)).lr
        for name, _ in stage.named_parameters()
    }


def _owner(module: nn.Module, param_name: str) -> nn.Module:
    return module.get_submodule(param_name.rpartition(".")[0])


def fixed_embedding(vocab_size: int, d_model: int, seed: int, norm_width: int | None = None) -> torch.Tensor:
    """The frozen full-rank token embedding ``E_fixed`` (V x d), entries of std ``1/sqrt(norm_width)``
    (default ``d``: rows of expected unit norm; see :func:`swarm.core.width.fixed_embedding_width`)."""
    gen = torch.Generator().manual_seed(name_seed(seed, "fixed_embedding"))
    table = torch.randn(vocab_size, d_model, generator=gen, dtype=torch.float64)
    return (table / math.sqrt(norm_width or d_model)).float()


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (CPU, contiguous): the content address of an artifact."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
