"""The codec line-up of the benchmarks: each entry a named boundary codec configuration."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.core.config import CodecConfig


@dataclass(frozen=True)
class CodecCase:
    name: str
    codec: CodecConfig
    constrained: bool  # needs the subspace-constrained model
    rotate: bool = False

    @property
    def kind(self) -> str:
        return self.codec.kind


def codec_cases(rank: int, mapl_rank: int, topk: int, lowrank: int) -> list[CodecCase]:
    """Uncompressed, the paper's ablation baselines, subspace variants and MAPL variants."""

    def case(name: str, kind: str, fwd: str, bwd: str | None = None, zstd: int = 0, **kw) -> CodecCase:
        codec = CodecConfig(
            kind=kind,
            forward_format=fwd,
            backward_format=bwd or fwd,
            zstd_level=zstd,
            mapl_rank=mapl_rank,
            topk=topk,
            lowrank=lowrank,
        )
        return CodecCase(name, codec, constrained=kind == "subspace", **kw)

    return [
        case("dense fp32", "identity", "fp32"),
        case("dense bf16", "identity", "bf16"),
        case("int8 blockwise", "identity", "int8_block"),
        case("int4 blockwise", "identity", "int4_block"),
        case(f"top-k (k={topk})", "identity", "topk"),
        case(f"low-rank SVD (r={lowrank})", "identity", "lowrank"),
        case("subspace fp32", "subspace", "fp32"),
        case("subspace bf16", "subspace", "bf16"),
        case("subspace bf16 + rotation", "subspace", "bf16", rotate=True),
        case("subspace int8/token", "subspace", "int8_row", "bf16"),
        case("subspace int8/token + zstd", "subspace", "int8_row", "bf16", zstd=3),
        case(f"MAPL bf16 (r={mapl_rank})", "mapl", "bf16"),
        case("MAPL + RVQ (4x256)", "mapl", "rvq", "bf16"),
    ]
