"""The trained model: model folders, export to transformers' LLaMA, and local generation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from swarm.core.config import MODEL_PRESETS, CodecConfig, DataConfig, RunConfig, TrainConfig
from swarm.io import model_io
from swarm.io.hf_export import export_hf
from swarm.runtime.train import train
from swarm.serve.generate import Sampling, generate, generate_ids

transformers = pytest.importorskip("transformers")
TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler — héllo wörld 😀"


def trained(folder: Path, tokenizer: str = "byte", codec: str = "subspace", rank: int | None = None) -> Path:
    """A tiny model trained a few steps (so every parameter, the embedding's C included, moved)."""
    model = (
        MODEL_PRESETS["tiny"]
        if rank is None
        else dataclasses.replace(MODEL_PRESETS["tiny"], subspace_rank=rank)
    )
    config = RunConfig(
        model=dataclasses.replace(model, constrain_writes=codec == "subspace"),
        codec=CodecConfig(kind=codec),
        train=TrainConfig(steps=4, batch_size=4, seq_len=32, microbatches=2, lr=1e-2, warmup_steps=1),
        data=DataConfig(tokenizer=tokenizer),
        n_stages=2,
    )
    train(config, device="cpu", progress=False, out_dir=folder)
    return folder / "model"


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory) -> Path:
    return trained(tmp_path_factory.mktemp("byte"))


@pytest.mark.parametrize(("tokenizer", "codec"), [("bpe", "subspace"), ("byte", "identity")])
def test_transformers_llama_gives_our_logits_and_tokens(tmp_path, tokenizer, codec):
    ours = model_io.load(trained(tmp_path, tokenizer, codec, rank=None if codec == "subspace" else 0))
    assert ours.tensors["embed.low"].abs().max() > 0  # trained: C moved away from zero
    export_hf(ours, tmp_path / "hf")
    llama = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.model.vocab_size, (2, ours.config.model.max_seq_len))
    with torch.no_grad():
        difference = (ours.build()(ids) - llama(ids).logits).abs().max().item()
    assert difference < 1e-4, difference
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tokenizer.encode(TEXT, add_special_tokens=False) == ours.tokenizer().encode(TEXT)
    assert hf_tokenizer.decode(ours.tokenizer().encode(TEXT)) == TEXT


def test_a_wrong_rope_layout_would_be_caught(byte_model, tmp_path):
    """Undo the q permutation and the logits move past the tolerance: the comparison above can fail."""
    ours = model_io.load(byte_model)
    export_hf(ours, tmp_path / "hf")
    llama = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        right = (ours.build()(ids) - llama(ids).logits).abs().max()
        for layer in llama.model.layers:
            q = layer.self_attn.q_proj.weight
            q.copy_(q.view(ours.config.model.n_heads, 2, -1, q.shape[1]).transpose(1, 2).reshape(q.shape))
        wrong = (ours.build()(ids) - llama(ids).logits).abs().max()
    assert wrong > 1e-4 and wrong > 100 * right, (wrong, right)


def test_mapl_models_are_refused_with_a_reason(tmp_path):
    mapl = model_io.load(trained(tmp_path, codec="mapl", rank=0))
    assert any(name.startswith("mapl.") for name in mapl.tensors)  # kept in the model folder
    with pytest.raises(ValueError, match="MAPL"):
        export_hf(mapl, tmp_path / "hf")
    with pytest.raises(ValueError, match="MAPL"):
        generate(mapl, "To be", Sampling(max_new_tokens=4))


def test_a_corrupt_or_foreign_folder_is_refused(byte_model, tmp_path):
    copy = tmp_path / "model"
    model_io.save(model_io.load(byte_model), copy)
    weights = copy / model_io.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(model_io.ModelFormatError, match="manifest hash"):
        model_io.load(copy)
    with pytest.raises(model_io.ModelFormatError, match="not a model folder"):
        model_io.load(tmp_path)


def test_greedy_generation_is_deterministic_and_the_cache_changes_nothing(byte_model):
    model = model_io.load(byte_model).build()
    prompt = list(b"To be, or not")
    greedy = Sampling(max_new_tokens=40, temperature=0)
    first = generate_ids(model, prompt, greedy)
    assert len(first) == 40 and first == generate_ids(model, prompt, greedy)
    assert first == generate_ids(model, prompt, greedy, use_cache=False)
    sampled = Sampling(max_new_tokens=40, temperature=1.0, top_p=0.9, seed=7)
    drawn = generate_ids(model, prompt, sampled)
    assert drawn == generate_ids(model, prompt, sampled, use_cache=False)
    assert drawn != generate_ids(model, prompt, dataclasses.replace(sampled, seed=8))
    # The context bounds the output; an empty or out-of-vocabulary prompt is refused.
    context = model.config.max_seq_len
    assert len(generate_ids(model, prompt, Sampling(max_new_tokens=1000, temperature=0))) == context - len(
        prompt
    )
    for bad in ([], [model.config.vocab_size], [1] * context):
        with pytest.raises(ValueError, match="prompt"):
            generate_ids(model, bad, greedy)
