"""Mixed precision: tokens/s and model FLOP utilisation of the single-process trainer, fp32 against bf16.

The same run trains with ``train.precision`` fp32 and bf16 side by side on this machine's device
(CUDA when present), as one stage and as several (the default codec: subspace, bf16 both ways),
on random token batches; the first steps warm up kernels and allocators and are left out of the
timing. Model FLOPs per token are those of the layers' and the head's matrix products, forward
and backward (3x the forward), with the attention scores counted at full length (PaLM's
``6N + 12 L d T`` convention) and a subspace-constrained write as its two thin products
(``W'`` then ``U^T``). MFU divides the achieved FLOP/s by the device's dense bf16 peak, the same
peak for both precisions; it is left empty where the peak is unknown (every CPU). With
``compiled``, the rows with no serialisation are measured again with ``train.compile`` (each layer
compiled by torch.compile; the compile time falls in the warm-up steps, reported apart).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from swarm.core.config import ModelConfig, RunConfig, TrainConfig
from swarm.core.device import pick_device
from swarm.runtime.pipeline import LocalPipeline

# Dense bf16 tensor-core peaks (TFLOP/s) from NVIDIA's data sheets; the first name contained in
# the device's name wins, so the PCIe part comes before the SXM one.
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100": 989.0, "H200": 989.0, "A100": 312.0}


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    model: ModelConfig
    train: TrainConfig
    stage_counts: tuple[int, ...] = (1, 4)
    warmup_steps: int = 1
    steps: int = 3  # timed
    compiled: bool = True  # also measure with each layer compiled (where nothing is serialised)


def flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one token's forward and backward pass through every layer and the head."""
    d, f = model.d_model, model.d_ff

    def write(d_in: int, layer: int) -> int:  # a residual write: W (d x in), or W' (k x in) then U^T
        rank = model.write_rank(layer)
        return 2 * (d_in * rank + rank * d) if rank else 2 * d_in * d

    layers = sum(
        2 * d * 3 * d + 4 * seq_len * d + write(d, i) + 2 * d * 2 * f + write(f, i)
        for i in range(model.n_layers)
    )
    return 3.0 * (layers + 2 * d * model.vocab_size)


def peak_bf16_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s; None where this module does not know it."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for part, tflops in PEAK_BF16_TFLOPS.items() if part in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    config: RunConfig, device: torch.device, warmup_steps: int, steps: int, frames: bool = False
) -> dict:
    """Steady-state tokens/s of :class:`LocalPipeline` training ``config`` on ``device`` (``frames``:
    every boundary crossing serialised and decoded, as on the wire, instead of carried)."""
    pipe = LocalPipeline(config, device=device, frames=frames)
    gen = torch.Generator().manual_seed(config.train.seed)
    shape = (config.train.batch_size, config.train.seq_len + 1)
    seconds, warmup, tokens, loss = [], 0.0, 0, float("nan")
    for step in range(warmup_steps + steps):
        ids = torch.randint(0, config.model.vocab_size, shape, generator=gen)
        _sync(device)
        t0 = time.perf_counter()
        result = pipe.train_step(step, ids)
        _sync(device)
        if step >= warmup_steps:
            seconds.append(time.perf_counter() - t0)
            tokens += result.tokens
        else:
            warmup += time.perf_counter() - t0
        loss = result.loss
    return {
        "tokens_per_s": tokens / sum(seconds),
        "step_seconds": seconds,
        "warmup_seconds": warmup,
        "final_loss": loss,
    }


def _modes(plan: PrecisionPlan, n_stages: int) -> list[tuple[str, bool]]:
    """(boundaries, compiled) of the rows for ``n_stages``; serialised boundaries run eager only."""
    boundaries = ("carried", "serialised") if n_stages > 1 else ("none",)
    compiled = (False, True) if plan.compiled else (False,)
    return [(b, c) for b in boundaries for c in compiled if not (c and b == "serialised")]


def run(plan: PrecisionPlan, device: str = "auto") -> dict:
    """fp32 and bf16 rows for every stage count (several stages: boundaries carried on the device and,
    side by side, serialised; eager and compiled layers), with model TFLOP/s, MFU and the ratios
    between rows."""
    dev = pick_device(device)
    peak = peak_bf16_flops(dev)
    per_token = flops_per_token(plan.model, plan.train.seq_len)
    rows = []
    for n_stages in plan.stage_counts:
        for boundaries, compiled in _modes(plan, n_stages):
            for precision in ("fp32", "bf16"):
                train = dataclasses.replace(plan.train, precision=precision, compile=compiled)
                config = RunConfig(model=plan.model, train=train, n_stages=n_stages)
                row = {
                    "n_stages": n_stages,
                    "boundaries": boundaries,
                    "compiled": compiled,
                    "precision": precision,
                }
                row |= measure(config, dev, plan.warmup_steps, plan.steps, frames=boundaries == "serialised")
                row["model_tflops_per_s"] = row["tokens_per_s"] * per_token / 1e12
                row["mfu"] = row["tokens_per_s"] * per_token / peak if peak else None
                rows.append(row)

    def tokens_per_s(**match) -> float:
        return next(r["tokens_per_s"] for r in rows if all(r[k] == v for k, v in match.items()))

    for row in rows:
        n, b, c, p = row["n_stages"], row["boundaries"], row["compiled"], row["precision"]
        row["speedup_vs_fp32"] = row["tokens_per_s"] / tokens_per_s(
            n_stages=n, boundaries=b, compiled=c, precision="fp32"
        )
        row["speedup_vs_eager"] = row["tokens_per_s"] / tokens_per_s(
            n_stages=n, boundaries=b, compiled=False, precision=p
        )
        row["vs_first_stage_count"] = row["tokens_per_s"] / tokens_per_s(
            n_stages=plan.stage_counts[0], compiled=c, precision=p
        )
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "peak_bf16_tflops": peak / 1e12 if peak else None,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "flops_per_token": per_token,
        "rows": rows,
    }
