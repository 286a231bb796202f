"""Round trips, sizes and malformed-payload handling for every tensor format."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch

from swarm.codecs.base import MAX_COLS, MAX_ROWS, EncodedTensor, PayloadError, TensorFormat
from swarm.codecs.floats import BFloat16Format, Float16Format, Float32Format, Float64Format
from swarm.codecs.lowrank import LowRankFormat
from swarm.codecs.quant import BlockwiseFormat, RowInt8Format, fp16_scale
from swarm.codecs.rvq import ResidualVQ
from swarm.codecs.topk import TopKFormat

ROWS, COLS = 12, 40  # 480 values: not a multiple of the 64-value block, so padding is exercised
K, RANK = 5, 3
FP16_NAN, BF16_NAN, FP32_NAN, FP64_NAN = (
    b"\x00\x7e",
    b"\xc0\x7f",
    struct.pack("<f", math.nan),
    struct.pack("<d", math.nan),
)


@dataclass(frozen=True)
class Case:
    fmt: TensorFormat
    nbytes: Callable[[int, int], int]  # expected payload size for rows x cols
    nan_at: Callable[[int, int], int]  # byte offset of a float field in the payload
    nan: bytes  # that field's NaN encoding


def _blocks(rows: int, cols: int) -> int:
    return -(-rows * cols // 64)


CASES = [
    Case(Float64Format(), lambda r, c: 8 * r * c, lambda r, c: 0, FP64_NAN),
    Case(Float32Format(), lambda r, c: 4 * r * c, lambda r, c: 0, FP32_NAN),
    Case(Float16Format(), lambda r, c: 2 * r * c, lambda r, c: 0, FP16_NAN),
    Case(BFloat16Format(), lambda r, c: 2 * r * c, lambda r, c: 0, BF16_NAN),
    Case(RowInt8Format(), lambda r, c: r * (c + 2), lambda r, c: 0, FP16_NAN),
    Case(BlockwiseFormat(8), lambda r, c: _blocks(r, c) * 66, lambda r, c: 0, FP16_NAN),
    Case(BlockwiseFormat(4), lambda r, c: _blocks(r, c) * 34, lambda r, c: 0, FP16_NAN),
    Case(TopKFormat(K), lambda r, c: 4 * r * min(K, c), lambda r, c: 2 * r * min(K, c), FP16_NAN),
    Case(LowRankFormat(RANK), lambda r, c: 2 + 2 * min(RANK, r, c) * (r + c), lambda r, c: 2, FP16_NAN),
    Case(ResidualVQ(COLS, n_codebooks=3, codebook_size=200), lambda r, c: r * 5, lambda r, c: 0, FP16_NAN),
]


@pytest.fixture(params=CASES, ids=lambda case: case.fmt.name)
def case(request: pytest.FixtureRequest) -> Case:
    return request.param


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- generic contract -----------------------------------------------------------------


@pytest.mark.parametrize("rows", [0, 1, ROWS])
def test_nbytes_and_shape(case: Case, rows: int) -> None:
    payload = case.fmt.encode(randn(rows, COLS))
    assert (payload.format, payload.rows, payload.cols) == (case.fmt.name, rows, COLS)
    assert payload.nbytes == case.nbytes(rows, COLS)
    out = case.fmt.decode(payload)
    assert out.shape == (rows, COLS) and out.dtype == torch.float32


@pytest.mark.parametrize("rows", [0, 1, ROWS])
def test_round_trip_without_bytes_is_the_decoded_payload(case: Case, rows: int) -> None:
    """What stages in one process hand over: bit for bit what the receiver decodes, in the decoded
    dtype, counted at exactly the bytes the payload has."""
    x = randn(rows, COLS, seed=rows)
    payload = case.fmt.encode(x)
    assert case.fmt.encoded_size(rows, COLS) == payload.nbytes == case.nbytes(rows, COLS)
    carried = case.fmt.roundtrip(x)
    decoded = case.fmt.decode(payload, dtype=carried.dtype)
    assert carried.dtype == (torch.float64 if case.fmt.name == "fp64" else torch.float32)
    assert torch.equal(carried, decoded)
    if rows:
        assert carried.data_ptr() != x.data_ptr()  # a new tensor, even where the format is lossless


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_round_trip_without_bytes_rejects_non_finite(case: Case, bad: float) -> None:
    x = randn(ROWS, COLS)
    x[3, 7] = bad
    with pytest.raises(PayloadError, match="non-finite"):
        case.fmt.roundtrip(x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_decode_device_and_dtype(case: Case, dtype: torch.dtype) -> None:
    payload = case.fmt.encode(randn(ROWS, COLS))
    wide = case.fmt.decode(payload, device=torch.device("cpu"), dtype=torch.float64)
    out = case.fmt.decode(payload, device="cpu", dtype=dtype)
    assert (out.device.type, out.dtype) == ("cpu", dtype)
    assert torch.equal(out, wide.to(dtype))
    assert torch.equal(wide.float(), case.fmt.decode(payload))


def test_no_tensor_lands_on_the_default_device(case: Case) -> None:
    """Every tensor a format makes follows its input or the device asked for: with the default device
    set to ``meta``, one made without an explicit device lands there and breaks the round trip, as a
    tensor hard-coded to the CPU breaks on CUDA."""
    x = randn(ROWS, COLS)
    payload = case.fmt.encode(x)
    with torch.device("meta"):
        assert case.fmt.encode(x) == payload
        out = case.fmt.decode(payload, device="cpu")
    assert torch.equal(out, case.fmt.decode(payload))


@pytest.mark.parametrize(
    "edit", [lambda d: d[:-1], lambda d: d + b"\0", lambda d: b""], ids=["short", "long", "empty"]
)
def test_wrong_size_rejected(case: Case, edit: Callable[[bytes], bytes]) -> None:
    payload = case.fmt.encode(randn(ROWS, COLS))
    with pytest.raises(PayloadError):
        case.fmt.decode(replace(payload, data=edit(payload.data)))


def test_other_rows_rejected(case: Case) -> None:
    payload = case.fmt.encode(randn(ROWS, COLS))
    with pytest.raises(PayloadError):
        case.fmt.decode(replace(payload, rows=ROWS + 1))


def test_wrong_format_name_rejected(case: Case) -> None:
    payload = case.fmt.encode(randn(ROWS, COLS))
    with pytest.raises(PayloadError, match="given to decoder"):
        case.fmt.decode(replace(payload, format="fp32" if case.fmt.name != "fp32" else "fp16"))


@pytest.mark.parametrize("shape", [(-1, COLS), (MAX_ROWS + 1, COLS), (ROWS, 0), (ROWS, MAX_COLS + 1)])
def test_absurd_shape_rejected(case: Case, shape: tuple[int, int]) -> None:
    with pytest.raises(PayloadError, match="outside"):
        case.fmt.decode(EncodedTensor(case.fmt.name, *shape, b"\0" * 64))


@pytest.mark.parametrize("shape", [(COLS,), (2, ROWS, COLS), (MAX_ROWS + 1, 1)])
def test_encode_rejects_bad_shapes(case: Case, shape: tuple[int, ...]) -> None:
    with pytest.raises(PayloadError):
        case.fmt.encode(torch.zeros(shape))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encode_rejects_non_finite(case: Case, bad: float) -> None:
    x = randn(ROWS, COLS)
    x[3, 4] = bad
    with pytest.raises(PayloadError, match="non-finite"):
        case.fmt.encode(x)


def test_decode_rejects_nan_bytes(case: Case) -> None:
    payload = case.fmt.encode(randn(ROWS, COLS))
    at = case.nan_at(ROWS, COLS)
    data = payload.data[:at] + case.nan + payload.data[at + len(case.nan) :]
    with pytest.raises(PayloadError, match="non-finite"):
        case.fmt.decode(replace(payload, data=data))


# -- raw floats -------------------------------------------------------------------------


def test_fp32_exact() -> None:
    x = randn(ROWS, COLS) * 1e30
    assert torch.equal(Float32Format().decode(Float32Format().encode(x)), x)


def test_fp64_exact_in_float64() -> None:
    x = randn(ROWS, COLS).double() / 3
    out = Float64Format().decode(Float64Format().encode(x), dtype=torch.float64)
    assert torch.equal(out, x)


@pytest.mark.parametrize(
    ("fmt", "rtol", "atol"), [(Float16Format(), 2**-11, 2**-25), (BFloat16Format(), 2**-8, 0)]
)
def test_half_precision_error(fmt: TensorFormat, rtol: float, atol: float) -> None:
    x = randn(64, 64) * torch.logspace(-6, 3, 64)  # columns span fp16's subnormals to its upper range
    out = fmt.decode(fmt.encode(x))
    assert bool(((out - x).abs() <= atol + rtol * x.abs()).all())


def test_fp16_overflow_rejected_on_encode() -> None:
    with pytest.raises(PayloadError, match="float16"):
        Float16Format().encode(torch.full((1, 4), 1e5))


def test_payload_is_little_endian() -> None:
    assert Float32Format().encode(torch.tensor([[1.0]])).data == struct.pack("<f", 1.0)
    assert BFloat16Format().encode(torch.tensor([[1.0]])).data == b"\x80\x3f"


# -- integer quantisation ---------------------------------------------------------------


def _awkward_rows(cols: int) -> torch.Tensor:
    """Random rows at very different magnitudes, including zero and sub-fp16-subnormal rows."""
    x = randn(8, cols) * torch.tensor([1.0, 1e-3, 1e3, 0.0, 1e-9, 5e-6, 7.0, 1e5])[:, None]
    x[6, 3] = 500.0  # an outlier
    return x


def test_fp16_scale_rounds_up_tightly() -> None:
    s = torch.logspace(-12, 6, 500)
    stored = fp16_scale(s).float()
    assert bool((stored >= s)[s <= 65504].all()) and bool((stored[s > 65504] == 65504).all())
    normal = (s >= 2**-14) & (s <= 65504)
    assert bool((stored[normal] <= s[normal] * (1 + 2**-10)).all())
    assert fp16_scale(torch.zeros(1)).item() == 0


def test_row_int8_error_within_half_scale() -> None:
    x = _awkward_rows(COLS)
    out = RowInt8Format().decode(RowInt8Format().encode(x))
    scale = fp16_scale(x.abs().amax(dim=1) / 127).float()
    assert bool(((out - x).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all())
    assert bool((out[3] == 0).all())


@pytest.mark.parametrize("bits", [8, 4])
def test_blockwise_error_within_half_scale(bits: int) -> None:
    fmt, qmax = BlockwiseFormat(bits), (1 << (bits - 1)) - 1
    x = _awkward_rows(COLS)  # 320 values = 5 blocks, spanning row boundaries
    out = fmt.decode(fmt.encode(x))
    blocks = torch.cat([x.reshape(-1), x.new_zeros(-x.numel() % 64)]).view(-1, 64)
    scale = fp16_scale(blocks.abs().amax(dim=1) / qmax).float()
    bound = scale.repeat_interleave(64)[: x.numel()].view_as(x) / 2
    assert bool(((out - x).abs() <= bound * (1 + 1e-6)).all())


def test_blockwise_int4_is_half_of_int8() -> None:
    x = randn(ROWS, COLS)
    assert BlockwiseFormat(4, block=128).encode(x).nbytes == 4 * (2 + 64)
    assert BlockwiseFormat(8, block=128).encode(x).nbytes == 4 * (2 + 128)


def test_blockwise_rejects_bad_config() -> None:
    for bits, block in [(2, 64), (4, 3), (8, 0)]:
        with pytest.raises(ValueError):
            BlockwiseFormat(bits, block)


@pytest.mark.parametrize(
    ("fmt", "offset", "byte"),
    [(RowInt8Format(), 2 * ROWS, 0x80), (BlockwiseFormat(8), 2 * 8, 0x80), (BlockwiseFormat(4), 2 * 8, 0x10)],
    ids=["int8_row", "int8_block", "int4_block"],
)
def test_quantised_value_out_of_range_rejected(fmt: TensorFormat, offset: int, byte: int) -> None:
    payload = fmt.encode(randn(ROWS, COLS))
    data = bytearray(payload.data)
    data[offset] = byte  # -128, or a zero nibble (-8): never produced by a symmetric encoder
    with pytest.raises(PayloadError, match="outside"):
        fmt.decode(replace(payload, data=bytes(data)))


# -- top-k ------------------------------------------------------------------------------


def test_topk_keeps_largest_exactly() -> None:
    x = randn(ROWS, COLS).half().float()  # fp16-representable, so kept values survive exactly
    out = TopKFormat(K).decode(TopKFormat(K).encode(x))
    kept = torch.zeros_like(x, dtype=torch.bool).scatter_(1, x.abs().topk(K, dim=1).indices, True)
    assert torch.equal(out[kept], x[kept])
    assert bool((out[~kept] == 0).all())


def test_topk_k_above_cols_is_lossless() -> None:
    x = randn(ROWS, COLS).half().float()
    payload = TopKFormat(100).encode(x)
    assert payload.nbytes == 4 * ROWS * COLS
    assert torch.equal(TopKFormat(100).decode(payload), x)


@pytest.mark.parametrize(("index", "match"), [(COLS, "index >="), (None, "increasing")])
def test_topk_bad_indices_rejected(index: int | None, match: str) -> None:
    payload = TopKFormat(K).encode(randn(ROWS, COLS))
    data = bytearray(payload.data)
    # Overwrite row 0's last index: out of range, or a copy of its first (a duplicate).
    data[2 * (K - 1) : 2 * K] = data[0:2] if index is None else struct.pack("<H", index)
    with pytest.raises(PayloadError, match=match):
        TopKFormat(K).decode(replace(payload, data=bytes(data)))


# -- low rank ---------------------------------------------------------------------------


def test_lowrank_exact_on_low_rank_matrix() -> None:
    x = randn(ROWS, RANK, seed=1) @ randn(RANK, COLS, seed=2)
    out = LowRankFormat(RANK).decode(LowRankFormat(RANK).encode(x))
    assert (out - x).norm() <= 1e-3 * x.norm()


def test_lowrank_error_is_tail_singular_values() -> None:
    x = randn(30, 20)
    out = LowRankFormat(5).decode(LowRankFormat(5).encode(x))
    tail = torch.linalg.svdvals(x)[5:].norm()
    assert abs((out - x).norm() - tail) <= 1e-2 * tail


def test_lowrank_rank_capped_by_shape() -> None:
    x = randn(4, COLS).half().float()
    payload = LowRankFormat(10).encode(x)
    assert payload.data[:2] == struct.pack("<H", 4) and payload.nbytes == 2 + 2 * 4 * (4 + COLS)
    assert (LowRankFormat(10).decode(payload) - x).norm() <= 1e-3 * x.norm()


def test_lowrank_header_rank_out_of_range_rejected() -> None:
    payload = LowRankFormat(RANK).encode(randn(ROWS, COLS))
    with pytest.raises(PayloadError, match="exceeds"):
        LowRankFormat(RANK).decode(replace(payload, data=struct.pack("<H", ROWS + 1) + payload.data[2:]))
    with pytest.raises(PayloadError, match="expected"):
        LowRankFormat(RANK).decode(replace(payload, data=struct.pack("<H", RANK + 1) + payload.data[2:]))


# -- residual VQ ------------------------------------------------------------------------

DIM = 16


def clustered(n: int, seed: int, n_clusters: int = 12) -> torch.Tensor:
    """Rows near coarse + fine cluster centres (structure for a second codebook), at varied magnitudes."""
    coarse, fine = randn(n_clusters, DIM, seed=123), 0.3 * randn(n_clusters, DIM, seed=124)
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(n_clusters, (2, n), generator=g)
    x = coarse[a] + fine[b] + 0.02 * torch.randn(n, DIM, generator=g)
    return x * torch.rand(n, 1, generator=g).add(0.5)


def rel_error(vq: ResidualVQ, x: torch.Tensor) -> float:
    return float((vq.decode(vq.encode(x)) - x).norm() / x.norm())


def trained(n_codebooks: int, steps: int = 5, seed: int = 0) -> ResidualVQ:
    vq = ResidualVQ(DIM, n_codebooks=n_codebooks, codebook_size=32, seed=seed)
    for step in range(steps):
        vq.update(clustered(256, seed=step))
    return vq


def test_rvq_error_falls_with_training() -> None:
    test = clustered(512, seed=99)
    errors = [rel_error(trained(3, steps), test) for steps in (0, 1, 5)]
    assert errors[0] > 2 * errors[1] and errors[1] > errors[2]


def test_rvq_error_falls_with_codebooks() -> None:
    test = clustered(512, seed=99)
    errors = [rel_error(trained(n), test) for n in (1, 2, 3)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 0.5 * errors[0]


def test_rvq_zero_rows_decode_to_zero() -> None:
    vq = trained(2)
    assert torch.equal(vq.decode(vq.encode(torch.zeros(3, DIM))), torch.zeros(3, DIM))


def test_rvq_is_deterministic() -> None:
    a, b = trained(2), trained(2)
    assert torch.equal(a.codebooks, b.codebooks) and a.version == b.version == 5
    assert not torch.equal(a.codebooks, trained(2, seed=1).codebooks)


def test_rvq_code_out_of_range_rejected() -> None:
    vq = ResidualVQ(DIM, n_codebooks=2, codebook_size=200)
    payload = vq.encode(randn(4, DIM))
    data = bytearray(payload.data)
    data[2 * 4] = 200
    with pytest.raises(PayloadError, match="code >="):
        vq.decode(replace(payload, data=bytes(data)))


def test_rvq_wrong_dimension_rejected() -> None:
    vq = ResidualVQ(DIM)
    with pytest.raises(PayloadError, match="dimension"):
        vq.encode(randn(4, DIM + 1))
    with pytest.raises(PayloadError, match="dimension"):
        vq.decode(EncodedTensor("rvq", 4, DIM + 1, b"\0" * 24))


def test_rvq_deltas_make_follower_identical() -> None:
    owner, follower = ResidualVQ(DIM, 2, 32, seed=7), ResidualVQ(DIM, 2, 32, seed=7)
    assert torch.equal(owner.codebooks, follower.codebooks)
    for step in range(4):
        owner.update(clustered(128, seed=step))
        follower.apply_delta(owner.delta_since(follower.version))
        assert torch.equal(owner.codebooks, follower.codebooks) and follower.version == owner.version
    x = clustered(64, seed=50)
    assert torch.equal(follower.decode(owner.encode(x)), owner.decode(owner.encode(x)))

    late = ResidualVQ(DIM, 2, 32, seed=7)  # missed every delta: one catches it up
    late.apply_delta(owner.delta_since(0))
    assert torch.equal(late.codebooks, owner.codebooks) and late.version == owner.version


def test_rvq_delta_carries_only_changed_rows() -> None:
    owner = trained(2)
    version = owner.version
    owner.update(clustered(3, seed=77))  # three rows touch at most three codewords per level
    delta = owner.delta_since(version)
    n_rows = struct.unpack_from("<QQI", delta)[2]
    assert 0 < n_rows <= 6 and len(delta) == 20 + n_rows * (3 + 4 * DIM)
    assert len(delta) < len(owner.snapshot()) == 13 + 4 * 2 * 32 * DIM
    assert len(owner.delta_since(owner.version)) == 20


def test_rvq_stale_delta_rejected() -> None:
    owner, follower = trained(2), ResidualVQ(DIM, 2, 32)
    with pytest.raises(PayloadError, match="stale codebook version"):
        follower.apply_delta(owner.delta_since(2))
    with pytest.raises(PayloadError, match="cannot build a delta"):
        owner.delta_since(owner.version + 1)


def test_rvq_malformed_delta_rejected() -> None:
    owner = trained(2)
    delta = owner.delta_since(0)
    for bad in [delta[:10], delta[:-1], delta + b"\0"]:
        with pytest.raises(PayloadError):
            ResidualVQ(DIM, 2, 32).apply_delta(bad)
    out_of_range = bytearray(delta)
    out_of_range[20 + 1 : 20 + 3] = struct.pack("<H", 32)  # first entry's row index
    with pytest.raises(PayloadError, match="out of range"):
        ResidualVQ(DIM, 2, 32).apply_delta(bytes(out_of_range))
    nan_row = bytearray(delta)
    nan_row[20 + 3 : 20 + 7] = struct.pack("<f", math.nan)
    with pytest.raises(PayloadError, match="non-finite"):
        ResidualVQ(DIM, 2, 32).apply_delta(bytes(nan_row))


def test_rvq_snapshot_for_newcomer() -> None:
    owner = trained(2)
    newcomer = ResidualVQ(DIM, 2, 32, seed=1234)
    newcomer.load_snapshot(owner.snapshot())
    assert torch.equal(newcomer.codebooks, owner.codebooks) and newcomer.version == owner.version
    version = owner.version
    owner.update(clustered(64, seed=8))
    newcomer.apply_delta(owner.delta_since(version))
    assert torch.equal(newcomer.codebooks, owner.codebooks)
    with pytest.raises(PayloadError, match="does not match"):
        ResidualVQ(DIM, 3, 32).load_snapshot(owner.snapshot())
    with pytest.raises(PayloadError):
        newcomer.load_snapshot(owner.snapshot()[:-4])


def test_a_value_that_overflows_the_compute_dtype_is_refused():
    """Found by the fuzzer: a finite fp64 payload value beyond float32's range became inf when
    cast for the stage; the decoder now checks finiteness after the cast."""
    fmt = Float64Format()
    payload = fmt.encode(torch.tensor([[1.0, 2.0, 1e300, 3.0]], dtype=torch.float64))
    assert torch.isfinite(fmt.decode(payload, dtype=torch.float64)).all()
    with pytest.raises(PayloadError, match="non-finite"):
        fmt.decode(payload, dtype=torch.float32)
