"""Boundary streams in one process: a real grpc.aio ``StageService`` on loopback, real ``dial``, runners."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import pytest
import torch
from swarm.node import stage_service
from swarm.node.links import BadFrameError, LinkError, PlannedPeer, RunIdentity, StageLink, dial, hello
from swarm.node.schedule import StageRunner
from swarm.node.snapshot_server import serving_cap
from swarm.node.stage_host import connect_local
from swarm.node.stage_service import StageService

from swarm._proto.swarm.v1 import common_pb2, stage_pb2, stage_pb2_grpc
from swarm.codecs.base import EncodedTensor, StaleVersionError
from swarm.core.config import config_hash
from swarm.net.channel import open_channel, server_options
from swarm.net.frames import to_message
from swarm.net.shaper import LinkProfile
from swarm.net.tls import INSECURE, Security
from swarm.net.uplink import UplinkMeter
from swarm.ops.metrics import Metrics
from swarm.runtime.pipeline import LocalPipeline
from swarm.runtime.wire import ActivationFrame, GradientFrame
from tests.helpers import random_batch, tiny_config

CONFIG = tiny_config(n_stages=2)
EPOCH = 3
SERVER = RunIdentity("run-1", config_hash(CONFIG), "node-down", EPOCH)
CLIENT = RunIdentity("run-1", config_hash(CONFIG), "node-up", EPOCH)
SECRET = "boundary-0-epoch-3-secret"  # what the coordinator gives both ends of boundary 0
UP_PEER = PlannedPeer(0, CLIENT.node_id, SECRET)  # what the server's plan puts upstream of boundary 0
DOWN_PEER = PlannedPeer(1, SERVER.node_id, SECRET)  # what the dialler's plan puts downstream of boundary 0
Attach = Callable[[int, StageLink], Awaitable[None]]


def run(coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def rejected(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("swarm_rejected_messages_total", {"reason": reason}) or 0.0


def rejections(metrics: Metrics) -> dict[str, float]:
    """Every non-zero ``rejected`` count, by reason."""
    (family,) = metrics.rejected.collect()
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total") and s.value}


@dataclass
class Acceptor:
    """One plan epoch's accepting side: boundary 0, this node hosting stage 1, ``UP_PEER`` dialling."""

    attach_to: Attach
    identity: RunIdentity = SERVER
    stages: list[int] = field(default_factory=lambda: [1])
    up: PlannedPeer = UP_PEER

    def peers_of(self, boundary: int) -> list[PlannedPeer]:
        return [self.up] if boundary == 0 else []

    def local_stage(self, boundary: int) -> int:
        assert boundary == 0
        return 1

    async def attach(self, boundary: int, node_id: str, link: StageLink) -> None:
        assert node_id == UP_PEER.node_id
        await self.attach_to(boundary, link)


@dataclass
class Server:
    address: str
    metrics: Metrics
    service: StageService


@contextlib.asynccontextmanager
async def stage_server(attach: Attach, security: Security = INSECURE) -> AsyncIterator[Server]:
    """A ``StageService`` accepting boundary 0 for stage 1 on 127.0.0.1, on a free port."""
    metrics = Metrics("node")
    service = StageService(metrics)
    service.acceptor, service.node_id = Acceptor(attach), SERVER.node_id
    server = grpc.aio.server(options=server_options())
    stage_pb2_grpc.add_StageServicer_to_server(service, server)
    port = security.add_port(server, "127.0.0.1:0")
    await server.start()
    try:
        yield Server(f"127.0.0.1:{port}", metrics, service)
    finally:
        await server.stop(grace=None)


async def refuse_all(boundary: int, link: StageLink) -> None:
    raise AssertionError("a refused stream must not be attached")


@pytest.mark.parametrize(
    ("identity", "secret", "boundary", "code", "reason"),
    [
        # another boundary's secret (or an epoch's before): the planned node id is not enough
        (CLIENT, "boundary-1-epoch-3-secret", 0, "UNAUTHENTICATED", "unauthenticated"),
        (replace(CLIENT, config_hash="0" * 64), SECRET, 0, "CONFIG_MISMATCH", "config_mismatch"),
        (replace(CLIENT, run_id="run-2"), SECRET, 0, "CONFIG_MISMATCH", "config_mismatch"),
        (CLIENT, SECRET, 1, "WRONG_BOUNDARY", "wrong_boundary"),
    ],
)
def test_bad_hello_is_refused_and_counted(
    identity: RunIdentity, secret: str, boundary: int, code: str, reason: str
):
    peer = replace(DOWN_PEER, secret=secret)

    async def main() -> None:
        async with stage_server(refuse_all) as server:
            with pytest.raises(LinkError, match=f"ERROR_CODE_{code}"):
                await dial(server.address, identity, boundary, 0, peer, Metrics("node"), timeout=5)
            assert rejected(server.metrics, reason) == 1
            assert rejections(server.metrics) == {reason: 1.0}

    run(main())


async def read_error(call: grpc.aio.StreamStreamCall) -> stage_pb2.Error:
    reply = await asyncio.wait_for(call.read(), 5)
    assert reply.WhichOneof("body") == "error", reply
    return reply.error


async def hold(boundary: int, link: StageLink) -> None:
    """Accept and read the stream until the peer closes it."""
    await link.pump(lambda item: None, lambda error: None)


@pytest.mark.parametrize(
    "identity",
    [
        replace(CLIENT, plan_epoch=EPOCH - 1),
        replace(CLIENT, plan_epoch=EPOCH + 1),
        replace(CLIENT, node_id="node-replaced"),  # right epoch, but not the node the plan names
    ],
    ids=["older_epoch", "newer_epoch", "unplanned_node"],
)
def test_hello_from_another_epoch_or_unplanned_node_is_refused(identity: RunIdentity):
    async def main() -> None:
        async with stage_server(refuse_all) as server:
            channel = open_channel(server.address)
            try:
                call = stage_pb2_grpc.StageStub(channel).Exchange()
                await call.write(hello(identity, 0, 0, SECRET))
                error = await read_error(call)
                assert error.code == stage_pb2.ERROR_CODE_PLAN_EPOCH, error
                assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF  # and the stream closes
            finally:
                await channel.close()
            assert rejections(server.metrics) == {"plan_epoch": 1.0}

    run(main())


def test_a_stream_without_a_hello_is_dropped(monkeypatch):
    monkeypatch.setattr(stage_service, "HELLO_S", 0.3)

    async def main() -> None:
        async with stage_server(refuse_all) as server:
            channel = open_channel(server.address)
            try:
                call = stage_pb2_grpc.StageStub(channel).Exchange()
                assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF  # the server ended it
            finally:
                await channel.close()
            assert rejections(server.metrics) == {"hello_timeout": 1.0}

    run(main())


def test_streams_waiting_for_their_hello_are_capped_per_host():
    async def main() -> None:
        async with stage_server(refuse_all) as server:
            channel = open_channel(server.address)
            try:
                stub = stage_pb2_grpc.StageStub(channel)
                silent = [stub.Exchange() for _ in range(stage_service.MAX_PENDING_PER_HOST)]
                for call in silent:  # opened on the server, and no Hello follows
                    await call.wait_for_connection()
                deadline = asyncio.get_running_loop().time() + 5
                while sum(server.service.pending.values()) < len(silent):
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.02)
                one_more = stub.Exchange()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await asyncio.wait_for(one_more.read(), 5)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert rejections(server.metrics) == {"stream_limit": 1.0}
                for call in silent:
                    call.cancel()
                while server.service.pending:  # the slots come back when the streams end
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.02)
            finally:
                await channel.close()

    run(main())


def test_a_dialler_with_the_newer_plan_waits_for_the_acceptor_to_get_it():
    """The dialler has epoch 4's plan (and its secret) before the acceptor does: the acceptor, still
    at epoch 3, answers PLAN_EPOCH (not UNAUTHENTICATED, which would fail the new epoch at once),
    and the dialler tries again until the acceptor follows epoch 4 too."""
    newer, secret = replace(CLIENT, plan_epoch=EPOCH + 1), "boundary-0-epoch-4-secret"

    async def main() -> None:
        async with stage_server(hold) as server:
            dialling = asyncio.create_task(
                dial(
                    server.address,
                    newer,
                    0,
                    0,
                    replace(DOWN_PEER, secret=secret),
                    Metrics("node"),
                    timeout=10,
                )
            )
            while not rejected(server.metrics, "plan_epoch"):
                assert not dialling.done(), dialling
                await asyncio.sleep(0.05)
            server.service.acceptor = Acceptor(
                hold, replace(SERVER, plan_epoch=EPOCH + 1), up=replace(UP_PEER, secret=secret)
            )
            link, channel = await dialling
            await link.close()
            await channel.close()
            assert "unauthenticated" not in rejections(server.metrics)

    run(main())


def test_service_without_a_plan_refuses_every_stream():
    async def main() -> None:
        async with stage_server(refuse_all) as server:
            server.service.acceptor = None  # between epochs, or before the first plan
            channel = open_channel(server.address)
            try:
                stub = stage_pb2_grpc.StageStub(channel)
                call = stub.Exchange()
                await call.write(hello(CLIENT, 0, 0, SECRET))
                assert (await read_error(call)).code == stage_pb2.ERROR_CODE_PLAN_EPOCH
                pong = await stub.Ping(stage_pb2.PingRequest(nonce=1), timeout=5)
                assert list(pong.stages) == [] and pong.node_id == SERVER.node_id
            finally:
                await channel.close()
            assert rejections(server.metrics) == {"plan_epoch": 1.0}

    run(main())


def test_dial_waits_for_the_peer_to_reach_its_epoch():
    """A peer still at another epoch is retried (not a hard failure) until it catches up or time runs out."""
    ahead = replace(CLIENT, plan_epoch=EPOCH + 1)

    async def main() -> None:
        async with stage_server(hold) as server:
            with pytest.raises(LinkError, match="could not reach"):
                await dial(server.address, ahead, 0, 0, DOWN_PEER, Metrics("node"), timeout=0.5)
            refused = rejected(server.metrics, "plan_epoch")
            assert refused >= 1

            async def catch_up() -> None:
                await asyncio.sleep(0.5)
                server.service.acceptor = Acceptor(hold, identity=replace(SERVER, plan_epoch=EPOCH + 1))

            mover = asyncio.create_task(catch_up())
            link, channel = await dial(server.address, ahead, 0, 0, DOWN_PEER, Metrics("node"), timeout=10)
            await mover
            try:
                assert rejected(server.metrics, "plan_epoch") > refused  # refused until it moved on
                assert isinstance(link, StageLink) and link.boundary == 0
            finally:
                await channel.close()

    run(main())


def test_dialler_refuses_a_peer_the_plan_does_not_name():
    async def main() -> None:
        async with stage_server(hold) as server:
            impostor = PlannedPeer(
                1, "node-other", SECRET
            )  # the dialler's plan names another node downstream
            with pytest.raises(LinkError, match="answered badly"):
                await dial(server.address, CLIENT, 0, 0, impostor, Metrics("node"), timeout=5)

    run(main())


@dataclass
class Pair:
    up: StageRunner  # stage 0, dialled out
    down: StageRunner  # stage 1, accepted by the server
    server: Server


@contextlib.asynccontextmanager
async def connected_pair(workers: list) -> AsyncIterator[Pair]:
    """Stage 0 and stage 1 joined by one real gRPC boundary stream (stage 0 dials, stage 1 accepts)."""
    up = StageRunner(workers[0], Metrics("node"), lambda step: random_batch(CONFIG, seed=step), timeout=20)
    down = StageRunner(workers[1], Metrics("node"), timeout=20)
    attached = asyncio.Event()

    async def attach(boundary: int, link: StageLink) -> None:
        deliver = down.attach(link, "", downstream=False)
        attached.set()
        await link.pump(deliver, down.fail)

    async with stage_server(attach) as server:
        link, channel = await dial(server.address, CLIENT, 0, 0, DOWN_PEER, up.metrics, timeout=5)
        reader = asyncio.create_task(link.pump(up.attach(link, "", downstream=True), up.fail))
        try:
            await asyncio.wait_for(attached.wait(), 5)
            yield Pair(up, down, server)
        finally:
            reader.cancel()
            await channel.close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_runners_over_grpc_match_local_pipeline(schedule):
    config = replace(CONFIG, train=replace(CONFIG.train, schedule=schedule))
    reference = LocalPipeline(CONFIG)
    expected = [reference.train_step(step, random_batch(CONFIG, seed=step)).loss for step in range(3)]
    workers = LocalPipeline(config, frames=True).workers

    async def main() -> list[float]:
        losses = []
        async with connected_pair(workers) as pair:
            for step in range(3):
                first, last = await asyncio.gather(pair.up.run_step(step), pair.down.run_step(step))
                assert first.wire_bytes_forward > 0 and last.wire_bytes_backward > 0
                losses.append(last.stats.loss_sum / last.stats.loss_count)
        return losses

    exact = schedule == "gpipe"  # 1F1B accumulates gradients in another order
    assert run(main()) == pytest.approx(expected, rel=1e-12 if exact else 1e-5, abs=0)
    for mine, theirs in zip(workers, reference.workers, strict=True):
        for a, b in zip(mine.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_stale_subspace_version_is_rejected_on_both_sides():
    workers = LocalPipeline(CONFIG, frames=True).workers
    workers[1].version = 1  # the receiver has moved on; stage 0 still encodes under version 0

    async def main() -> None:
        async with connected_pair(workers) as pair:
            steps = pair.up.run_step(0), pair.down.run_step(0)
            up, down = await asyncio.gather(*steps, return_exceptions=True)
            assert isinstance(down, StaleVersionError), down
            assert isinstance(up, LinkError) and "ERROR_CODE_SUBSPACE_VERSION" in str(up), up
            assert rejected(pair.down.metrics, "subspace_version") == 1
            assert rejected(pair.down.metrics, "bad_payload") == 0

    run(main())


@pytest.mark.parametrize("attack", ["replay", "nan"])
def test_a_bad_frame_fails_the_step_as_the_senders_fault(attack):
    """A replayed microbatch or NaN coordinates: the receiver answers BAD_PAYLOAD, counts it, and its
    step fails with a BadFrameError naming the boundary (the node then reports the sender for
    eviction); nothing reaches the receiver's parameters."""
    workers = LocalPipeline(CONFIG, frames=True).workers
    before = [p.detach().clone() for p in workers[1].parameters()]

    async def main() -> None:
        async with connected_pair(workers) as pair:
            link = pair.up.downstream
            honest_send = link.send

            async def hostile_send(item) -> int:
                if attack == "nan" and isinstance(item, ActivationFrame):
                    bad = bytes(len(item.payload.data) - 2) + b"\xc0\x7f"  # a bf16 NaN at the end
                    item = replace(item, payload=replace(item.payload, data=bad))
                sent = await honest_send(item)
                if attack == "replay" and isinstance(item, ActivationFrame):
                    sent += await honest_send(item)
                return sent

            link.send = hostile_send
            up, down = await asyncio.gather(
                pair.up.run_step(0), pair.down.run_step(0), return_exceptions=True
            )
            assert isinstance(down, BadFrameError) and down.boundary == 0, down
            assert ("replayed" if attack == "replay" else "non-finite") in str(down)
            assert isinstance(up, LinkError) and "ERROR_CODE_BAD_PAYLOAD" in str(up), up
            assert rejected(pair.down.metrics, "bad_payload") == 1

    run(main())
    assert all(torch.equal(a, b) for a, b in zip(workers[1].parameters(), before, strict=True))


def test_a_flooding_peer_fails_the_step_as_the_senders_fault():
    """Frames far beyond a step's worth, before the receiver takes any: bounded, counted, and the
    receiver's step fails with a BadFrameError naming the boundary."""
    workers = LocalPipeline(CONFIG, frames=True).workers
    frame = workers[0].forward(0, 0, random_batch(CONFIG)[:2])

    async def main() -> None:
        async with connected_pair(workers) as pair:
            for _ in range(4 * CONFIG.train.microbatches + 4):
                await pair.up.downstream.send(frame)
            deadline = asyncio.get_running_loop().time() + 5
            while rejected(pair.down.metrics, "flood") == 0:
                assert asyncio.get_running_loop().time() < deadline, "the flood was never noticed"
                await asyncio.sleep(0.01)
            with pytest.raises(BadFrameError, match="boundary 0: the peer sent over"):
                await pair.down.run_step(0)
            assert pair.down._activations.qsize() <= 2 * CONFIG.train.microbatches + 3

    run(main())


def test_malformed_messages_are_answered_counted_and_survived():
    frame = LocalPipeline(CONFIG, frames=True).workers[0].forward(0, 0, random_batch(CONFIG)[:2])
    delivered: list[object] = []
    failures: list[Exception] = []

    async def attach(boundary: int, link: StageLink) -> None:
        await link.pump(delivered.append, failures.append)

    async def main() -> None:
        async with stage_server(attach) as server:
            channel = open_channel(server.address)
            try:
                stub = stage_pb2_grpc.StageStub(channel)
                call = stub.Exchange()
                await call.write(hello(CLIENT, 0, 0, SECRET))
                assert (await asyncio.wait_for(call.read(), 5)).WhichOneof("body") == "hello"

                no_payload = common_pb2.ActivationFrame(step=0, microbatch=0, batch=2, seq_len=16)
                await call.write(stage_pb2.StageMessage(activation=no_payload))
                error = await read_error(call)
                assert error.code == stage_pb2.ERROR_CODE_BAD_PAYLOAD and "no payload" in error.message
                assert rejected(server.metrics, "bad_payload") == 1

                await call.write(hello(CLIENT, 0, 0, SECRET))
                assert (await read_error(call)).code == stage_pb2.ERROR_CODE_UNEXPECTED_MESSAGE
                assert rejected(server.metrics, "unexpected_message") == 1

                # The stream and the server are still up: a good frame is delivered, Ping answers.
                await call.write(to_message(frame))
                for _ in range(100):
                    if delivered:
                        break
                    await asyncio.sleep(0.05)
                assert delivered == [frame] and isinstance(delivered[0], ActivationFrame)
                pong = await stub.Ping(stage_pb2.PingRequest(nonce=7), timeout=5)
                assert pong.nonce == 7 and list(pong.stages) == [1] and pong.node_id == SERVER.node_id

                await call.done_writing()
                for _ in range(100):
                    if failures:
                        break
                    await asyncio.sleep(0.05)
                assert len(failures) == 1 and "closed the stream" in str(failures[0])
            finally:
                await channel.close()

    run(main())


# -- the send queue ---------------------------------------------------------------------------------


def gradient(step: int, nbytes: int = 10_000) -> GradientFrame:
    return GradientFrame(step, 0, 0, EncodedTensor("fp32", nbytes // 4, 1, bytes(nbytes)))


def test_sends_overlap_the_wire_and_a_full_queue_applies_backpressure_without_loss():
    """A 1 Mbit/s emulated link (80 ms per 10 kB frame) behind a 2-message send queue."""

    async def scenario() -> tuple[int, int, list[int], list[int]]:
        written: list[stage_pb2.StageMessage] = []

        async def write(msg: stage_pb2.StageMessage) -> None:
            written.append(msg)

        metrics = Metrics("node")
        link = StageLink(0, asyncio.Event().wait, write, metrics, LinkProfile(mbps=1.0), queue_messages=2)
        await link.send(gradient(0))
        on_wire_after_first_send = len(written)  # send returned while the frame was still in transit
        depths: list[int] = []

        async def sender() -> None:
            for step in range(1, 10):
                await link.send(gradient(step))

        task = asyncio.create_task(sender())
        while not task.done():
            depths.append(link._outbox.qsize())
            await asyncio.sleep(0.01)
        await link.close()
        gauge = metrics.registry.get_sample_value("swarm_send_queue_depth", {"boundary": "0"})
        return on_wire_after_first_send, int(gauge), depths, [m.gradient.step for m in written]

    on_wire, final_depth, depths, steps = run(scenario())
    assert on_wire == 0
    assert max(depths) == 2 and final_depth == 0  # bounded: the sender waited for room
    assert steps == list(range(10))  # nothing lost, nothing reordered


@pytest.mark.parametrize("flush_s", [0.3, 10.0])
def test_closing_after_the_last_step_delivers_everything_queued(flush_s):
    """At 1 Mbit/s four queued 10 kB frames need ~0.3 s: a teardown's short flush loses the tail,
    the end-of-run flush (bounded by the step timeout) delivers it all."""

    async def scenario() -> list[int]:
        written: list[stage_pb2.StageMessage] = []

        async def write(msg: stage_pb2.StageMessage) -> None:
            written.append(msg)

        link = StageLink(0, asyncio.Event().wait, write, Metrics("node"), LinkProfile(mbps=1.0))
        for step in range(5):
            await link.send(gradient(step))
        await link.close(flush_s)
        return [m.gradient.step for m in written]

    steps = run(scenario())
    if flush_s > 1:
        assert steps == list(range(5))
    else:
        assert steps == list(range(len(steps))) and len(steps) < 5  # in order, the tail dropped


def test_a_failed_write_surfaces_on_the_next_send_and_nobody_hangs():
    async def scenario() -> str:
        async def write(msg: stage_pb2.StageMessage) -> None:
            raise grpc.aio.UsageError("stream closed")

        link = StageLink(3, asyncio.Event().wait, write, Metrics("node"), queue_messages=1)
        await link.send(gradient(0))
        with pytest.raises(LinkError) as e:
            for step in range(1, 10):  # the queue keeps draining: no send blocks forever
                await link.send(gradient(step))
                await asyncio.sleep(0.01)
        await link.close()
        return str(e.value)

    assert "boundary 3" in run(scenario(), timeout=10)


# -- schedules --------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_four_stage_schedules_give_the_single_process_gradients(schedule):
    """4 stages, 4 microbatches: 1F1B reorders the work but trains the same model (fp32 1e-5),
    holding at most P - s microbatches on stage s where GPipe holds all of them."""
    config = tiny_config(n_stages=4, batch_size=8, microbatches=4, schedule=schedule)
    reference = LocalPipeline(config)  # GPipe order, one process
    for step in range(3):
        reference.train_step(step, random_batch(config, seed=step))
    workers = LocalPipeline(config, frames=True).workers
    runners = [
        StageRunner(
            w, Metrics("node"), (lambda step: random_batch(config, seed=step)) if w.is_first else None
        )
        for w in workers
    ]
    for up, down in itertools.pairwise(runners):
        connect_local(up, down, "")

    async def main() -> list[list[int]]:
        peaks = []
        for step in range(3):
            outcomes = await asyncio.gather(*(r.run_step(step) for r in runners))
            peaks.append([o.peak_live_microbatches for o in outcomes])
        return peaks

    peaks = run(main())
    expected_peak = [4, 4, 4, 4] if schedule == "gpipe" else [4, 3, 2, 1]
    assert all(p == expected_peak for p in peaks), peaks
    for mine, theirs in zip(workers, reference.workers, strict=True):
        for a, b in zip(mine.parameters(), theirs.parameters(), strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()


def test_the_uplink_is_measured_from_backlogged_writes_and_caps_snapshot_serving():
    """A 2 Mbit/s emulated link kept backlogged: the meter reads about 2 Mbit/s; the snapshot server's
    cap is half of it by default, and an operator's --snapshot-mbps overrides the share."""

    async def scenario() -> float | None:
        async def write(msg: stage_pb2.StageMessage) -> None:
            pass

        meter = UplinkMeter()
        link = StageLink(0, asyncio.Event().wait, write, Metrics("node"), LinkProfile(mbps=2.0), uplink=meter)
        for step in range(8):  # 8 x 10 kB at 2 Mbit/s: ~0.3 s, the queue never empty
            await link.send(gradient(step))
        await link.close(10.0)
        return meter.mbps()

    measured = run(scenario())
    assert measured is not None and 1.5 < measured < 2.5
    meter = UplinkMeter()
    assert serving_cap(0.0, 0.5, meter)() == 0.0  # nothing measured yet: unpaced
    meter.record(1_000_000, 1.0)
    assert serving_cap(0.0, 0.5, meter)() == pytest.approx(4.0)
    assert serving_cap(10.0, 0.5, meter)() == 10.0
    assert serving_cap(0.0, 0.0, meter)() == 0.0


def test_the_uplink_meter_forgets_old_samples_and_ignores_too_little():
    now = [0.0]
    meter = UplinkMeter(window_s=10.0, clock=lambda: now[0])
    meter.record(1000, 0.01)
    assert meter.mbps() is None  # 10 ms of backlogged writes: too little to tell
    meter.record(1_000_000, 0.5)
    assert meter.mbps() == pytest.approx(8 * 1_001_000 / 0.51 / 1e6)
    now[0] = 11.0
    assert meter.mbps() is None
