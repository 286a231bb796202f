"""One pipeline stage of a trained model, serving generation sessions (see ``inference.proto``).

:class:`InferenceStage` runs the stage's layers on the new positions of a session with
its :class:`~swarm.core.model.KVCache`: token ids in on the first stage, a boundary frame in
on the others; a boundary frame out (the same codecs as training: ``subspace`` sends k
coordinates per token, ``dense`` the full residual stream). The last stage sends its
output frame too: the client applies the final norm and LM head itself
(:class:`ClientHead`), as Petals clients do, so the last hop carries k coordinates per
token rather than a vocabulary's worth of logits. Frames carry the new positions' token
ids (plus one padding id where training frames carry the next target), so the receiver
can lift coordinates.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from swarm.codecs import make_format
from swarm.codecs.base import PayloadError
from swarm.codecs.boundary import BoundaryCodec, IdentityMap, SubspaceMap
from swarm.core.config import stage_layer_ranges
from swarm.core.model import KVCache, RMSNorm
from swarm.io.model_io import TrainedModel
from swarm.runtime.wire import ActivationFrame
from swarm.serve.generate import refuse_mapl

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
        # The stage's own embedding and basis: on its device.
        tensors = {"fixed_embedding": self.stage.fixed_embedding, "basis": self.stage.basis}
        self.inbound = (
            inference_codec(trained, boundary, tensor_format, tensors) if not self.is_first else None
        )
        out_boundary = head_boundary(trained, boundary) if self.is_last else boundary
        self.outbound = inference_codec(trained, out_boundary, tensor_format, tensors)

    @torch.no_grad()
    def run(
        self, cache: KVCache, position: int, token_ids: list[int] | None, frame: ActivationFrame | None
    ) -> ActivationFrame:
        """The new positions through this stage: its output frame."""
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
        out = self.stage(tokens, x, cache, head=False)
        z = self.outbound.map.project(out, tokens)
        padded = torch.cat([tokens, torch.zeros_like(tokens[:, :1])], dim=1)
        return self.outbound.encode_activation(z, padded, 0, 0, self.version)

    def frame_accounting(self, frame: ActivationFrame) -> int:
        """What the codec says a frame holds: payload plus packed token id bytes."""
        return len(frame.payload.data) + len(frame.token_ids)


def head_boundary(trained: TrainedModel, boundary: str) -> str:
    """What the last stage sends the client: its layers may write at full rank
    (``model.full_rank_layers``), whose output has no exact subspace coordinates."""
    return "dense" if trained.config.model.full_rank_layers else boundary


def inference_codec(
    trained: TrainedModel, boundary: str, tensor_format: str, tensors: dict[str, torch.Tensor] | None = None
) -> BoundaryCodec:
    """The codec of every boundary of a served model (both sides build the same one); ``tensors``:
    the embedding and basis to use (default: the model's, on the CPU)."""
    m, t = trained.config.model, tensors or trained.tensors
    if m.bottleneck_rank:
        raise ValueError("generation through a swarm does not serve bottleneck models yet: generate locally")
    subspace = boundary == "subspace"
    bmap = SubspaceMap(t["fixed_embedding"], t["basis"]) if subspace else IdentityMap(m.d_model)
    codec_config = dataclasses.replace(trained.config.codec, forward_format=tensor_format, zstd_level=0)
    fmt = make_format(tensor_format, bmap.width, codec_config)
    return BoundaryCodec(bmap, fmt, fmt, m.vocab_size, m.max_seq_len)


class ClientHead:
    """The client's end of the last stage: lift its frame, then the final RMSNorm and the LM head."""

    def __init__(self, trained: TrainedModel, boundary: str = "subspace", tensor_format: str = "bf16"):
        m = trained.config.model
        self.codec = inference_codec(trained, head_boundary(trained, boundary), tensor_format)
        self.version = trained.subspace_version
        self.norm = RMSNorm(m.d_model, m.norm_eps)
        self.norm.load_state_dict({"weight": trained.tensors["norm.weight"]})
        self.head = trained.tensors["head.weight"]

    @torch.no_grad()
    def logits(self, frame: ActivationFrame) -> torch.Tensor:
        """The last position's logits (V,) from the last stage's output frame."""
        z, ids = self.codec.decode_activation(frame, self.version, torch.device("cpu"), torch.float32)
        x = self.codec.map.lift(z[:, -1:], ids[:, -2:-1])[0, 0]
        return F.linear(self.norm(x), self.head)
