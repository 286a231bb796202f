"""MAPL boundaries: Stiefel constraint under training, identical copies on both sides, RVQ sync."""

from __future__ import annotations

import struct

import pytest
import torch

from swarm.codecs.base import PayloadError
from swarm.core.mapl import pack_gradients, unpack_gradients
from swarm.core.optim import StiefelSGD, qr_retraction
from swarm.runtime.pipeline import LocalPipeline
from tests.helpers import random_batch, tiny_config


def test_stiefel_constraint_and_copies_after_100_steps():
    config = tiny_config(kind="mapl", rank=0, stiefel_lr=0.01)
    pipe = LocalPipeline(config)
    for step in range(100):
        pipe.train_step(step, random_batch(config, seed=step))
    for sender, receiver in zip(pipe.workers, pipe.workers[1:], strict=False):
        a_out, a_in = sender.mapl["out"].projection, receiver.mapl["in"].projection
        eye = torch.eye(a_out.shape[1])
        assert (a_out.T @ a_out - eye).norm().item() < 1e-5
        assert torch.equal(a_out, a_in)
        assert torch.equal(sender.mapl["out"].anchor_map, receiver.mapl["in"].anchor_map)


def test_mapl_projection_moves_and_gradient_of_boundary_is_summed():
    config = tiny_config(kind="mapl", rank=0)
    pipe = LocalPipeline(config)
    start = pipe.workers[0].mapl["out"].projection.detach().clone()
    pipe.forward_backward(0, random_batch(config))
    share_out = pipe.workers[0].boundary_gradients("out")["projection"]
    share_in = pipe.workers[1].boundary_gradients("in")["projection"]
    assert share_out.norm() > 0 and share_in.norm() > 0
    pipe.exchange_boundary_state()
    total = pipe.workers[0].mapl["out"].projection.grad
    assert torch.allclose(total, share_out + share_in)
    for w in pipe.workers:
        w.optimizer_step(0)
    assert not torch.equal(start, pipe.workers[0].mapl["out"].projection.detach())


def test_stiefel_sgd_minimises_on_the_manifold():
    """Maximise tr(A^T M A): the optimum spans M's top eigenvectors."""
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(20, 20, generator=gen))
    m = q @ torch.diag(torch.linspace(1, 10, 20)) @ q.T
    a = torch.nn.Parameter(qr_retraction(torch.randn(20, 3, generator=gen)))
    opt = StiefelSGD([a], lr=0.02)
    for _ in range(400):
        opt.zero_grad()
        (-torch.trace(a.T @ m @ a)).backward()
        opt.step()
    top = q[:, -3:]
    assert torch.linalg.svdvals(top.T @ a.detach()).min() > 0.99
    assert (a.T @ a - torch.eye(3)).abs().max() < 1e-5


def test_rvq_codebooks_stay_in_sync_across_the_boundary():
    config = tiny_config(kind="mapl", rank=0, forward_format="rvq", backward_format="bf16")
    pipe = LocalPipeline(config)
    results = [pipe.train_step(step, random_batch(config, seed=step)) for step in range(5)]
    assert all(r.bytes_sync > 0 for r in results)
    for sender, receiver in zip(pipe.workers, pipe.workers[1:], strict=False):
        mine, theirs = sender.outbound.forward_format, receiver.inbound.forward_format
        assert mine.version == theirs.version > 0
        assert torch.equal(mine.codebooks, theirs.codebooks)
    tokens = config.train.batch_size * config.train.seq_len
    ids_bytes = config.train.batch_size * (config.train.seq_len + 1) * 2
    assert results[-1].bytes_forward == [tokens * (config.codec.rvq_codebooks + 2) + ids_bytes] * 3


def test_gradient_share_sends_only_the_touched_anchor_rows_and_round_trips_exactly():
    config = tiny_config(kind="mapl", rank=0)
    pipe = LocalPipeline(config)
    pipe.train_step(0, random_batch(config, seed=0))  # the anchor map starts at zero: no anchor gradient
    batch = random_batch(config, seed=1)
    pipe.forward_backward(1, batch)
    boundary = pipe.workers[0].mapl["out"]
    share = pipe.workers[0].boundary_gradients("out")
    packed = pack_gradients(share)
    back = unpack_gradients(packed, boundary)
    assert all(torch.equal(back[name], share[name]) for name in share)
    touched = int((share["anchor_tokens"] != 0).any(dim=1).sum())
    assert 0 < touched <= len(batch.unique())  # the sender's anchor rows of this step's input tokens
    dense = 4 * sum(g.numel() for g in share.values())
    vocab, anchor = share["anchor_tokens"].shape
    assert len(packed) == dense - 4 * vocab * anchor + 4 + touched * (4 + 4 * anchor)


def test_malformed_gradient_shares_are_rejected():
    config = tiny_config(kind="mapl", rank=0)
    pipe = LocalPipeline(config)
    pipe.train_step(0, random_batch(config, seed=0))
    pipe.forward_backward(1, random_batch(config, seed=1))
    boundary = pipe.workers[0].mapl["out"]
    share = pipe.workers[0].boundary_gradients("out")
    good = pack_gradients(share)
    head = 4 * share["projection"].numel()  # the anchor table's row count follows the projection
    vocab = share["anchor_tokens"].shape[0]
    count = struct.unpack_from("<I", good, head)[0]
    rows = list(struct.unpack_from(f"<{count}I", good, head + 4))

    def with_rows(new_rows: list[int]) -> bytes:
        return good[: head + 4] + struct.pack(f"<{count}I", *new_rows) + good[head + 4 + 4 * count :]

    cases = {
        "ends inside": good[:-3],
        "trailing": good + b"\0\0\0\0",
        "rows for a": good[:head] + struct.pack("<I", vocab + 1) + good[head + 4 :],
        "out of range": with_rows([*rows[:-1], vocab]),
        "not increasing": with_rows([rows[1], rows[0], *rows[2:]]),
        "non-finite": pack_gradients({**share, "projection": share["projection"] * float("nan")}),
    }
    for expected, data in cases.items():
        with pytest.raises(PayloadError, match=expected):
            unpack_gradients(data, boundary)
