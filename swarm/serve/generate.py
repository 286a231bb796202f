"""Text from a trained model: greedy or nucleus sampling, with a KV cache.

``swarm generate --model DIR --prompt TEXT`` samples from a model folder
(:mod:`swarm.io.model_io`). With temperature 0 it is greedy and deterministic; otherwise
tokens are drawn (temperature, top-p) from a generator seeded by ``seed``, so the same
call gives the same text. The KV-cached path (default) feeds one token per step after
the prompt; the uncached path recomputes the whole sequence each step and gives the
same tokens (a test checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarm.core.model import KVCache, Stage
from swarm.io.model_io import TrainedModel


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.8  # 0: greedy
    top_p: float = 0.95  # nucleus: the smallest set of tokens holding this much probability
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 0 or self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"invalid sampling settings {self}")


def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token from the last position's logits (V,)."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / sampling.temperature, dim=-1).cpu()
    sorted_probs, order = probs.sort(descending=True)
    keep = sorted_probs.cumsum(0) - sorted_probs < sampling.top_p  # always keeps the most likely
    sorted_probs = sorted_probs * keep
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return int(order[choice])


def check_prompt(prompt_ids: list[int], vocab_size: int, max_seq_len: int) -> None:
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt_ids) >= max_seq_len:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {max_seq_len}")
    if not all(0 <= t < vocab_size for t in prompt_ids):
        raise ValueError(f"the prompt holds token ids outside the vocabulary (size {vocab_size})")


def sample(
    prompt_ids: list[int],
    sampling: Sampling,
    max_seq_len: int,
    logits_after: Callable[[list[int]], torch.Tensor],
) -> list[int]:
    """The decoding loop: ``logits_after(new_ids)`` feeds the next tokens (the prompt first, then one
    at a time) to a model that remembers the earlier ones, and returns the last position's logits."""
    generator = torch.Generator().manual_seed(sampling.seed)
    budget = min(sampling.max_new_tokens, max_seq_len - len(prompt_ids))
    out: list[int] = []
    if budget <= 0:
        return out
    logits = logits_after(prompt_ids)
    while True:
        out.append(pick_token(logits, sampling, generator))
        if len(out) == budget:
            return out
        logits = logits_after(out[-1:])


@torch.no_grad()
def generate_ids(
    model: Stage, prompt_ids: list[int], sampling: Sampling, use_cache: bool = True
) -> list[int]:
    """The generated token ids (not the prompt), at most up to the model's context length."""
    m = model.config
    check_prompt(prompt_ids, m.vocab_size, m.max_seq_len)
    device = next(model.parameters()).device
    cache, seen = KVCache(), []

    def logits_after(new_ids: list[int]) -> torch.Tensor:
        if use_cache:
            return model(torch.tensor([new_ids], device=device), cache=cache)[0, -1]
        seen.extend(new_ids)  # no cache: the whole sequence again
        return model(torch.tensor([seen], device=device))[0, -1]

    return sample(prompt_ids, sampling, m.max_seq_len, logits_after)


def refuse_mapl(trained: TrainedModel, what: str) -> None:
    if trained.config.codec.kind == "mapl":
        raise ValueError(
            f"{what} is not available for a MAPL-trained model: its learned boundary maps (rank "
            f"{trained.config.codec.mapl_rank} projections between stages) are part of the function it "
            "computes, and this model folder's full-model path does not apply them"
        )


def generate(trained: TrainedModel, prompt: str, sampling: Sampling, device: str = "cpu") -> str:
    """``prompt`` followed by the generated text."""
    refuse_mapl(trained, "generation")
    tokenizer = trained.tokenizer()
    ids = generate_ids(trained.build(device), tokenizer.encode(prompt), sampling)
    return prompt + tokenizer.decode(ids)
