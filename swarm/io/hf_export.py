"""Export a model folder to Hugging Face ``transformers``: a plain ``LlamaForCausalLM``.

The subspace parametrisation is materialised (transformers is not needed to export,
only to load the result):

* ``model.embed_tokens`` = ``E_fixed + C Uᵀ`` (V x d);
* ``o_proj`` and ``down_proj`` = ``U W'`` (d x in), full matrices;
* the fused ``qkv`` splits into ``q_proj``/``k_proj``/``v_proj`` and ``gate_up`` into
  ``gate_proj``/``up_proj``;
* ``q_proj``/``k_proj`` rows are permuted per head from this model's interleaved RoPE
  pairs (channels 2i, 2i+1) to LLaMA's half-split pairs (i, i + head_dim/2): attention
  scores are unchanged because queries and keys move together;
* norms and the LM head copy over; ``tie_word_embeddings`` is false.

A MAPL-trained model is refused: its boundary maps are lossy projections that a plain
LLaMA cannot express.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from swarm.io.model_io import TrainedModel
from swarm.serve.generate import refuse_mapl


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection (d x in) from interleaved RoPE pairs to LLaMA's rotate-half layout."""
    d, d_in = w.shape
    return w.view(n_heads, d // n_heads // 2, 2, d_in).transpose(1, 2).reshape(d, d_in)


def llama_state_dict(trained: TrainedModel) -> dict[str, torch.Tensor]:
    m, t = trained.config.model, trained.tensors
    basis = t.get("basis")

    def residual_write(name: str, layer: int) -> torch.Tensor:
        return basis @ t[name] if m.write_rank(layer) else t[name]

    embed = t["fixed_embedding"] + (t["embed.low"] if basis is None else t["embed.low"] @ basis.T)
    out = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": t["norm.weight"],
        "lm_head.weight": t["head.weight"],
    }
    for i in range(m.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = t[src + "attn.qkv.weight"].chunk(3, dim=0)
        gate, up = t[src + "mlp.gate_up.weight"].chunk(2, dim=0)
        out |= {
            dst + "input_layernorm.weight": t[src + "attn_norm.weight"],
            dst + "self_attn.q_proj.weight": interleaved_to_half(q, m.n_heads),
            dst + "self_attn.k_proj.weight": interleaved_to_half(k, m.n_heads),
            dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": residual_write(src + "attn.out.weight", i),
            dst + "post_attention_layernorm.weight": t[src + "mlp_norm.weight"],
            dst + "mlp.gate_proj.weight": gate,
            dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": residual_write(src + "mlp.down.weight", i),
        }
    return {k: v.contiguous().clone() for k, v in out.items()}


def llama_config(trained: TrainedModel) -> dict:
    m = trained.config.model
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "subspace_swarm": {"step": trained.step, "subspace_version": trained.subspace_version},
    }


def export_hf(trained: TrainedModel, out_dir: str | Path) -> Path:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer files to ``out_dir``."""
    refuse_mapl(trained, "export to a plain LLaMA")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(llama_state_dict(trained), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(llama_config(trained), indent=1))
    (out / "tokenizer.json").write_text(trained.tokenizer_json)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": trained.config.model.max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    return out
