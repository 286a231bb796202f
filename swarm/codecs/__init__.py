"""Boundary codecs.

* ``base.py``: the :class:`TensorFormat` interface, :class:`EncodedTensor`, validation helpers.
* ``floats.py``: raw fp64/fp32/fp16/bf16.
* ``quant.py``: per-row int8, blockwise int8/int4.
* ``topk.py``: top-k sparsification per row. ``lowrank.py``: truncated SVD.
* ``rvq.py``: residual vector quantisation with codebooks synchronised by deltas.
* ``boundary.py``: boundary maps (identity, subspace, MAPL) and :class:`BoundaryCodec`,
  which turns a stage's output into wire frames and back.

:func:`make_format` is the registry: the name that travels on the wire picks the class.
"""

from __future__ import annotations

from collections.abc import Callable

from swarm.codecs.base import EncodedTensor, PayloadError, TensorFormat
from swarm.codecs.floats import BFloat16Format, Float16Format, Float32Format, Float64Format
from swarm.codecs.lowrank import LowRankFormat
from swarm.codecs.quant import BlockwiseFormat, RowInt8Format
from swarm.codecs.rvq import ResidualVQ
from swarm.codecs.topk import TopKFormat
from swarm.core.config import CodecConfig

FormatFactory = Callable[[int, CodecConfig, int], TensorFormat]

FORMATS: dict[str, FormatFactory] = {
    "fp64": lambda width, cfg, seed: Float64Format(),
    "fp32": lambda width, cfg, seed: Float32Format(),
    "fp16": lambda width, cfg, seed: Float16Format(),
    "bf16": lambda width, cfg, seed: BFloat16Format(),
    "int8_row": lambda width, cfg, seed: RowInt8Format(),
    "int8_block": lambda width, cfg, seed: BlockwiseFormat(bits=8),
    "int4_block": lambda width, cfg, seed: BlockwiseFormat(bits=4),
    "topk": lambda width, cfg, seed: TopKFormat(cfg.topk),
    "lowrank": lambda width, cfg, seed: LowRankFormat(cfg.lowrank),
    "rvq": lambda width, cfg, seed: ResidualVQ(width, cfg.rvq_codebooks, cfg.rvq_codebook_size, seed=seed),
}


def make_format(name: str, width: int, config: CodecConfig, seed: int = 0) -> TensorFormat:
    """Build the tensor format ``name`` for matrices of ``width`` columns."""
    try:
        factory = FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tensor format {name!r}; choose from {sorted(FORMATS)}") from None
    return factory(width, config, seed)


__all__ = ["FORMATS", "EncodedTensor", "PayloadError", "TensorFormat", "make_format"]
