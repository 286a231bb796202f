"""The coordinate check (Tensor Programs V): how activation and update scales move with width.

For each width and parametrisation a model of the scaling grid takes a few AdamW steps on the
same batches; after each, a fixed probe batch goes through it and the root-mean-square of every
coordinate is recorded for the layers' residual writes (attention and MLP outputs) and the logits,
together with how far each moved since initialisation. Under a width-transferable parametrisation
these stay flat as d grows; under the standard one the updates' effect on the logits grows with d
(AdamW moves every one of d inputs by ~lr, so a dot product moves by ~lr * d). The section reports
each quantity's exponent in d (a log-log slope): ~0 is width-stable.
"""

from __future__ import annotations

import math

import torch

from swarm.core.config import CodecConfig, RunConfig, TrainConfig
from swarm.io.data import TokenDataset, batch_ids
from swarm.runtime.pipeline import LocalPipeline

QUANTITIES = ("writes", "logits", "writes_moved", "logits_moved")


def _probe(pipe: LocalPipeline, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every residual write (attention and MLP outputs, concatenated) and the logits, for ``tokens``."""
    writes: list[torch.Tensor] = []
    hooks = [
        module.register_forward_hook(lambda _m, _i, out: writes.append(out.detach().flatten()))
        for w in pipe.workers
        for block in w.stage.layers.values()
        for module in (block.attn, block.mlp)
    ]
    try:
        with torch.no_grad():
            x = None
            for w in pipe.workers:
                x = w.stage(tokens.to(w.device), x)
    finally:
        for h in hooks:
            h.remove()
    return {"writes": torch.cat(writes).float(), "logits": x.detach().flatten().float()}


def _rms(t: torch.Tensor) -> float:
    return t.pow(2).mean().sqrt().item()


def measure(config: RunConfig, dataset: TokenDataset, steps: int) -> list[dict]:
    """The RMS of the writes and logits after 0..``steps`` training steps, and how far each moved."""
    torch.manual_seed(config.train.seed)
    pipe = LocalPipeline(config)
    t = config.train
    probe, _ = dataset.sampler(t.batch_size, t.seq_len, seed=t.seed + 1).next_batch()
    sampler = dataset.sampler(t.batch_size, t.seq_len, seed=t.seed)
    start = _probe(pipe, probe)
    rows = []
    for step in range(steps + 1):
        if step:
            pipe.train_step(step - 1, batch_ids(*sampler.next_batch()))
        now = _probe(pipe, probe)
        rows.append(
            {
                "step": step,
                "writes": _rms(now["writes"]),
                "logits": _rms(now["logits"]),
                "writes_moved": _rms(now["writes"] - start["writes"]),
                "logits_moved": _rms(now["logits"] - start["logits"]),
            }
        )
    return rows


def slope(widths: list[int], values: list[float]) -> float:
    """The least-squares exponent ``a`` of ``value ~ d**a`` (0: the quantity does not move with width)."""
    xs = [math.log(d) for d in widths]
    ys = [math.log(max(v, 1e-30)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def run(
    configs: dict[tuple[str, str, int], RunConfig], dataset: TokenDataset, steps: int
) -> dict[str, list[dict]]:
    """``configs``: (method, parametrisation, width) -> the run; rows per step, and per (method,
    parametrisation) each quantity's exponent in d after the last step."""
    rows = [
        {"method": m, "parametrisation": p, "d": d, **row}
        for (m, p, d), config in configs.items()
        for row in measure(config, dataset, steps)
    ]
    exponents = []
    for m, p in sorted({(m, p) for m, p, _ in configs}):
        last = sorted(
            (r for r in rows if r["method"] == m and r["parametrisation"] == p and r["step"] == steps),
            key=lambda r: r["d"],
        )
        if len(last) > 1:
            widths = [r["d"] for r in last]
            exponents.append(
                {
                    "method": m,
                    "parametrisation": p,
                    **{q: slope(widths, [r[q] for r in last]) for q in QUANTITIES},
                }
            )
    return {"rows": rows, "exponents": exponents}


def check_config(model, lr: float, batch_size: int, seq_len: int, n_stages: int, subspace: bool) -> RunConfig:
    """A short run of ``model`` for the check (no warm-up: the first steps are the ones measured)."""
    train = TrainConfig(steps=8, batch_size=batch_size, seq_len=seq_len, lr=lr, warmup_steps=0)
    codec = CodecConfig(kind="subspace" if subspace else "identity")
    return RunConfig(model=model, train=train, codec=codec, n_stages=n_stages)
