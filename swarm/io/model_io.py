"""The trained model as one folder: consolidated weights, configuration, tokenizer, manifest.

Written by ``swarm train --out`` and by the coordinator (from a run's latest complete
checkpoint cut, automatically at the end of a run and with ``swarm-coordinator
export``), so local and swarm runs produce interchangeable models::

    model.safetensors   every parameter of the full model under the single-process names
                        (``embed.low``, ``layers.<i>.attn.qkv.weight``, ..., ``head.weight``),
                        the subspace ``basis`` and the frozen ``fixed_embedding``; a MAPL run
                        adds each boundary's maps as ``mapl.<boundary>.<name>``
    run.json            the run configuration (its hash is in the manifest)
    tokenizer.json      the run's tokenizer in Hugging Face ``tokenizers`` format
    manifest.json       format, step, subspace version, config hash, embedding digest and
                        the sha256 of every other file (checked on load)

Files are written to a temporary folder and renamed into place, so a reader never sees
half a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers

from swarm.core.config import RunConfig, config_hash
from swarm.core.mapl import TRAINING_ONLY
from swarm.core.model import Stage, tensor_digest
from swarm.io.data import BpeTokenizer, ByteTokenizer, Tokenizer, run_tokenizer
from swarm.runtime.worker import StageWorker

MODEL_FORMAT = 1
WEIGHTS, RUN, TOKENIZER, MANIFEST = "model.safetensors", "run.json", "tokenizer.json", "manifest.json"


class ModelFormatError(ValueError):
    """A model folder that is incomplete, corrupt or of another format."""


@dataclass
class TrainedModel:
    config: RunConfig
    tensors: dict[str, torch.Tensor]
    step: int  # the last optimizer step these weights include
    subspace_version: int
    tokenizer_json: str

    def build(self, device: torch.device | str = "cpu", start: int = 0, end: int | None = None) -> Stage:
        """Layers ``[start, end)`` (default: the full model, embedding and head) with these weights,
        in eval mode."""
        m = self.config.model
        end = m.n_layers if end is None else end
        basis = self.tensors.get("basis")
        model = Stage(m, start, end, self.tensors["fixed_embedding"], basis, self.config.train.seed)
        wanted = model.state_dict().keys()
        model.load_state_dict({k: v for k, v in self.tensors.items() if k in wanted})
        return model.to(device).eval()

    def tokenizer(self) -> BpeTokenizer:
        return BpeTokenizer.from_json(self.tokenizer_json)


def consolidate(stage_states: Sequence[dict], mapl_states: Sequence[dict], fixed: torch.Tensor) -> dict:
    """One tensor dict from every stage's model state (and MAPL boundary states by side).

    ``stage_states[i]``: stage i's ``Stage.state_dict()``; ``mapl_states[i]``: its
    ``{"in"|"out": MaplBoundary.state_dict()}``. Each boundary is taken from its sender's
    copy (both sides are kept identical); every stage's basis must be the same.
    """
    tensors: dict[str, torch.Tensor] = {"fixed_embedding": fixed}
    for index, (state, mapl) in enumerate(zip(stage_states, mapl_states, strict=True)):
        for name, value in state.items():
            if name in tensors and not torch.equal(tensors[name], value):
                raise ModelFormatError(f"stage {index} disagrees with an earlier stage on {name}")
            tensors[name] = value
        for name, value in mapl.get("out", {}).items():
            if name not in TRAINING_ONLY:
                tensors[f"mapl.{index}.{name}"] = value
    return {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in tensors.items()}


def from_workers(workers: Sequence[StageWorker], step: int) -> TrainedModel:
    """The model held by a run's stage workers (e.g. a :class:`~swarm.runtime.pipeline.LocalPipeline`'s)."""
    config = workers[0].config
    tensors = consolidate(
        [w.stage.state_dict() for w in workers],
        [{side: b.state_dict() for side, b in w.mapl.items()} for w in workers],
        workers[0].stage.fixed_embedding,
    )
    return TrainedModel(config, tensors, step, workers[0].version, tokenizer_json(config))


def tokenizer_json(config: RunConfig) -> str:
    """The run's tokenizer as a Hugging Face ``tokenizer.json`` (bytes as tokens 0-255 for "byte")."""
    return _hf_json(run_tokenizer(config))


def _hf_json(tokenizer: Tokenizer) -> str:
    if isinstance(tokenizer, BpeTokenizer):
        return tokenizer.to_json()
    if not isinstance(tokenizer, ByteTokenizer):
        raise TypeError(f"no tokenizer.json for {type(tokenizer).__name__}")
    # Byte-level BPE with no merges whose vocabulary is the 256 byte symbols in byte order.
    table = _byte_symbols()
    vocab = {table[b]: b for b in range(256)}
    hf = HfTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    return hf.to_str()


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table (what ``ByteLevel`` maps each byte to)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def save(model: TrainedModel, out_dir: str | Path) -> dict:
    """Write ``model`` to ``out_dir`` (replacing a previous model there); returns the manifest."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(model.tensors, tmp / WEIGHTS, metadata={"format": f"subspace-swarm/{MODEL_FORMAT}"})
        (tmp / RUN).write_text(model.config.to_json())
        (tmp / TOKENIZER).write_text(model.tokenizer_json)
        manifest = {
            "format": MODEL_FORMAT,
            "step": model.step,
            "subspace_version": model.subspace_version,
            "config_hash": config_hash(model.config),
            "embedding_digest": tensor_digest(model.tensors["fixed_embedding"]),
            "mapl": any(k.startswith("mapl.") for k in model.tensors),
            "files": {name: _sha256(tmp / name) for name in (WEIGHTS, RUN, TOKENIZER)},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        for name in (WEIGHTS, RUN, TOKENIZER, MANIFEST):
            with (tmp / name).open("rb") as f:
                os.fsync(f.fileno())
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def load(model_dir: str | Path) -> TrainedModel:
    """Read a model folder, checking its format and every file's hash (:class:`ModelFormatError`)."""
    folder = Path(model_dir)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{folder} is not a model folder (no readable {MANIFEST}): {e}") from None
    if manifest.get("format") != MODEL_FORMAT:
        raise ModelFormatError(f"{folder}: model format {manifest.get('format')!r}, expected {MODEL_FORMAT}")
    for name, expected in manifest["files"].items():
        if not (folder / name).is_file() or _sha256(folder / name) != expected:
            raise ModelFormatError(f"{folder / name} is missing or does not match its manifest hash")
    config = RunConfig.from_dict(json.loads((folder / RUN).read_text()))
    if config_hash(config) != manifest["config_hash"]:
        raise ModelFormatError(f"{folder / RUN} does not hash to the manifest's config hash")
    return TrainedModel(
        config,
        load_file(folder / WEIGHTS),
        manifest["step"],
        manifest["subspace_version"],
        (folder / TOKENIZER).read_text(),
    )
