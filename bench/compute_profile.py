"""Measure a compute profile: one transformer layer's forward and backward time per token on a device.

``python -m bench.compute_profile --preset 2b-8layer --device cuda --out my-gpu.json`` times
one :class:`swarm.core.model.Block` of the preset (subspace-constrained as the preset says) on
``--seq-len`` tokens per sequence, and one subspace boundary's maps (project on the sender,
lift on the receiver, forward and backward), medians of ``--repeats`` after warm-up, and
writes a :class:`swarm.core.profiles.ComputeProfile` that ``emulation.profile`` accepts by path.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from swarm.codecs.boundary import SubspaceMap
from swarm.core.config import MODEL_PRESETS, ModelConfig
from swarm.core.device import pick_device
from swarm.core.model import Block, fixed_embedding, rope_tables
from swarm.core.profiles import ComputeProfile
from swarm.core.subspace import random_basis


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    model: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    seq_len: int,
    batch: int = 1,
    repeats: int = 5,
) -> tuple[float, float, float]:
    """Median seconds on ``batch x seq_len`` tokens of one layer's forward, its backward, and one
    subspace boundary's maps (0 for an unconstrained model): the sender's project and the receiver's
    lift (``E_fixed`` gathers and d x k products), forward and backward together."""
    torch.manual_seed(0)
    block = Block(model, 0).to(device, dtype)
    basis = (
        random_basis(model.d_model, model.subspace_rank, 0).to(device, dtype) if model.constrained else None
    )
    cos, sin = (t[:seq_len].to(device, dtype) for t in rope_tables(model.head_dim, seq_len, model.rope_theta))
    x = torch.randn(batch, seq_len, model.d_model, device=device, dtype=dtype, requires_grad=True)
    forward, backward = _median_times(lambda: block(x, cos, sin, basis), [block, x], device, repeats)
    if basis is None:
        return forward, backward, 0.0
    bmap = SubspaceMap(fixed_embedding(model.vocab_size, model.d_model, 0).to(device, dtype), basis)
    tokens = torch.randint(0, model.vocab_size, (batch, seq_len), device=device)
    maps = _median_times(lambda: bmap.lift(bmap.project(x, tokens), tokens), [x], device, repeats)
    return forward, backward, sum(maps)


def _median_times(
    run: Callable[[], torch.Tensor], reset: list, device: torch.device, repeats: int
) -> tuple[float, float]:
    """Median seconds of ``run()`` and of its backward; ``reset``: modules and leaves whose gradients
    are cleared between rounds. The first round warms up kernels and allocators and is not counted."""
    forward, backward = [], []
    for i in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        y = run()
        _sync(device)
        t1 = time.perf_counter()
        y.backward(torch.ones_like(y))
        _sync(device)
        t2 = time.perf_counter()
        if i:
            forward.append(t1 - t0)
            backward.append(t2 - t1)
        for r in reset:
            if isinstance(r, torch.nn.Module):
                r.zero_grad(set_to_none=True)
            else:
                r.grad = None
    return statistics.median(forward), statistics.median(backward)


def profile(preset: str, device: str, seq_len: int, batch: int, repeats: int) -> ComputeProfile:
    model, dev = MODEL_PRESETS[preset], pick_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    fwd, bwd, maps = measure(model, dev, dtype, seq_len, batch, repeats)
    tokens = batch * seq_len
    name = (
        torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    )
    return ComputeProfile(
        name=f"{preset}-{dev.type}",
        model=preset,
        device=name,
        source=(
            f"measured by `python -m bench.compute_profile --preset {preset} --device {device} "
            f"--seq-len {seq_len} --batch {batch}`: one layer and one subspace boundary's maps "
            f"in {dtype}, median of {repeats}, torch {torch.__version__}"
        ),
        forward_us_per_token_layer=fwd / tokens * 1e6,
        backward_us_per_token_layer=bwd / tokens * 1e6,
        seq_len=seq_len,
        boundary_us_per_token=maps / tokens * 1e6,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="2b-8layer", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = profile(args.preset, args.device, args.seq_len, args.batch, args.repeats)
    result.save(args.out)
    print(
        f"{result.name}: forward {result.forward_us_per_token_layer:.2f} us/token/layer, "
        f"backward {result.backward_us_per_token_layer:.2f}, boundary maps "
        f"{result.boundary_us_per_token:.2f} us/token; written to {args.out}"
    )


if __name__ == "__main__":
    main()
