"""One pipeline stage of a trained model, serving generation sessions (see ``inference.proto``).

:class:`InferenceStage` runs the stage's layers on the new positions of a session with
its :class:`~swarm.model.KVCache`: token ids in on the first stage, a boundary frame in
on the others; a boundary frame out (the same codecs as training: ``subspace`` sends k
coordinates per token, ``dense`` the full residual stream), or the last position's
logits on the last stage. Frames carry the new positions' token ids (plus one padding
id where training frames carry the next target), so the receiver can lift coordinates.
"""

from __future__ import annotations

import dataclasses

import torch

from swarm.codecs import make_format
from swarm.codecs.base import PayloadError
from swarm.codecs.boundary import BoundaryCodec, IdentityMap, SubspaceMap
from swarm.config import stage_layer_ranges
from swarm.generate import refuse_mapl
from swarm.model import KVCache
from swarm.model_io import TrainedModel
from swarm.wire import ActivationFrame

BOUNDARIES = ("subspace", "dense")
FORMATS = ("fp32", "bf16", "int8_row")


class InferenceStage:
    """Stage ``index`` of ``trained`` for generation; ``boundary``: what crosses stage boundaries."""

    def __init__(
        self,
        trained: TrainedModel,
        index: int,
        boundary: str = "subspace",
        tensor_format: str = "bf16",
        device: torch.device | str = "cpu",
    ):
        refuse_mapl(trained, "generation")
        config = trained.config
        if not 0 <= index < config.n_stages:
            raise ValueError(f"stage {index} is not one of the run's {config.n_stages} stages")
        if boundary not in BOUNDARIES or tensor_format not in FORMATS:
            raise ValueError(f"boundary must be one of {BOUNDARIES}, format one of {FORMATS}")
        if boundary == "subspace" and "basis" not in trained.tensors:
            raise ValueError("a model without a subspace basis can only send dense boundaries")
        start, end = stage_layer_ranges(config.model.n_layers, config.n_stages)[index]
        self.config, self.index, self.version = config, index, trained.subspace_version
        self.device = torch.device(device)
        self.stage = trained.build(self.device, start, end)
        self.is_first, self.is_last = self.stage.is_first, self.stage.is_last
        self.boundary, self.tensor_format = boundary, tensor_format
        self.inbound = self._codec() if not self.is_first else None
        self.outbound = self._codec() if not self.is_last else None

    def _codec(self) -> BoundaryCodec:
        m, stage = self.config.model, self.stage
        bmap = (
            SubspaceMap(stage.fixed_embedding, stage.basis)
            if self.boundary == "subspace"
            else IdentityMap(m.d_model)
        )
        codec_config = dataclasses.replace(self.config.codec, forward_format=self.tensor_format, zstd_level=0)
        fmt = make_format(self.tensor_format, bmap.width, codec_config)
        return BoundaryCodec(bmap, fmt, fmt, m.vocab_size, m.max_seq_len)

    @torch.no_grad()
    def run(
        self, cache: KVCache, position: int, token_ids: list[int] | None, frame: ActivationFrame | None
    ) -> ActivationFrame | bytes:
        """The new positions through this stage: the output frame, or the last stage's logits (float32)."""
        if position != cache.length:
            raise PayloadError(
                f"request starts at position {position}, the session has cached {cache.length}"
            )
        if self.is_first:
            if not token_ids or not all(0 <= t < self.config.model.vocab_size for t in token_ids):
                raise PayloadError("the first stage needs token ids inside the vocabulary")
            tokens, x = torch.tensor([token_ids], device=self.device), None
        else:
            if frame is None:
                raise PayloadError(f"stage {self.index} needs the previous stage's frame")
            z, ids = self.inbound.decode_activation(frame, self.version, self.device, torch.float32)
            if z.shape[0] != 1:
                raise PayloadError("one sequence per session")
            tokens = ids[:, :-1]
            x = self.inbound.map.lift(z, tokens)
        if cache.length + tokens.shape[1] > self.config.model.max_seq_len:
            raise PayloadError(f"the session would exceed the context of {self.config.model.max_seq_len}")
        out = self.stage(tokens, x, cache)
        if self.is_last:
            return out[0, -1].float().cpu().numpy().tobytes()
        z = self.outbound.map.project(out, tokens)
        padded = torch.cat([tokens, torch.zeros_like(tokens[:, :1])], dim=1)
        return self.outbound.encode_activation(z, padded, 0, 0, self.version)

    def frame_accounting(self, frame: ActivationFrame) -> int:
        """What the codec says a frame holds: payload plus packed token id bytes."""
        return len(frame.payload.data) + len(frame.token_ids)
