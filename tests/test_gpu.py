"""The codecs, the compressed pipeline and MAPL+RVQ training on CUDA (``pytest -m gpu``; skipped without it).

Formats whose encoder is elementwise arithmetic must give the same bytes on either device; low-rank
(an SVD) and RVQ (a nearest-codeword search) are float algorithms whose last bits depend on the
device, so for them the CUDA round trip is held to the CPU one's error instead.
"""

from __future__ import annotations

import pytest
import torch

from swarm.codecs import FORMATS, make_format
from swarm.codecs.rvq import ResidualVQ
from swarm.core.config import CodecConfig
from swarm.io.data import TokenDataset
from swarm.runtime.train import train
from tests.helpers import random_batch, tiny_config
from tests.test_pipeline import max_relative_error, pipeline_gradients, reference_gradients

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
ROWS, COLS = 48, 40
CODEC = CodecConfig(topk=5, lowrank=3, rvq_codebooks=3, rvq_codebook_size=64)
DEVICE_DEPENDENT = {"lowrank", "rvq"}


@pytest.fixture
def no_tf32():
    """Full-precision fp32 matmuls and cuDNN kernels (no TF32) for one test."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, allow_tf32=False):
        yield
    torch.set_float32_matmul_precision(precision)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.usefixtures("no_tf32")
def test_format_round_trip_on_cuda(name: str) -> None:
    fmt = make_format(name, COLS, CODEC)
    x = randn(ROWS, COLS)
    on_cpu, on_cuda = fmt.encode(x), fmt.encode(x.to(CUDA))
    back = fmt.decode(on_cuda, device=CUDA)
    assert (back.device.type, back.dtype) == ("cuda", torch.float32)
    assert fmt.decode(on_cuda, device=CUDA, dtype=torch.bfloat16).dtype == torch.bfloat16
    reference = fmt.decode(on_cpu)
    # decoding one payload on either device gives the same matrix
    torch.testing.assert_close(fmt.decode(on_cpu, device=CUDA).cpu(), reference, rtol=1e-6, atol=1e-6)
    if name in DEVICE_DEPENDENT:
        assert on_cuda.nbytes == on_cpu.nbytes
        assert (back.cpu() - x).norm() <= 1.1 * (reference - x).norm() + 1e-4 * x.norm()
    else:
        assert on_cuda == on_cpu
        assert torch.equal(back.cpu(), reference)
    # the in-process hand-over stays on the GPU and is what the CUDA payload decodes to there
    carried = fmt.roundtrip(x.to(CUDA))
    assert carried.device.type == "cuda" and fmt.encoded_size(ROWS, COLS) == on_cuda.nbytes
    assert torch.equal(carried, fmt.decode(on_cuda, device=CUDA, dtype=carried.dtype))


def test_rvq_learns_on_the_cpu_from_a_cuda_batch() -> None:
    on_cpu, on_cuda = ResidualVQ(COLS, 2, 32, seed=3), ResidualVQ(COLS, 2, 32, seed=3)
    for step in range(3):
        batch = randn(64, COLS, seed=step)
        on_cpu.update(batch)
        on_cuda.update(batch.to(CUDA))
    assert on_cuda.codebooks.device.type == "cpu"
    assert on_cuda.version == on_cpu.version > 0
    assert torch.equal(on_cuda.codebooks, on_cpu.codebooks)


@pytest.mark.parametrize("kind", ["subspace", "identity"])
@pytest.mark.usefixtures("no_tf32")
def test_compressed_pipeline_gradients_equal_single_process_on_cuda(kind: str) -> None:
    config = tiny_config(kind=kind, rank=8 if kind == "subspace" else 0)
    ids = random_batch(config).to(CUDA)
    ref_loss, ref = reference_gradients(config, ids, torch.float32, CUDA)
    loss, got = pipeline_gradients(config, ids, torch.float32, CUDA)
    assert all(g.device.type == "cuda" for g in got.values())
    assert abs(loss - ref_loss) / ref_loss < 1e-5
    assert max_relative_error(got, ref) < 1e-5


def test_mapl_rvq_training_on_cuda() -> None:
    config = tiny_config(kind="mapl", rank=0, forward_format="rvq", backward_format="bf16", steps=6)
    tokens = torch.randint(0, config.model.vocab_size, (20_000,), generator=torch.Generator().manual_seed(0))
    dataset = TokenDataset(tokens, config.model.vocab_size)
    summary = train(config, device="cuda", dataset=dataset, progress=False, eval_batches=2)
    assert summary.device.startswith("cuda") and len(summary.losses) == config.train.steps
    assert all(torch.isfinite(torch.tensor(summary.losses)))
    assert torch.isfinite(torch.tensor(summary.final_val_loss))
