"""The relay (swarm.net.relay): pairing by key, exact splicing, limits and counters, and a boundary
stream over mutual TLS through it that a tampering relay can break but not corrupt."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from swarm.coordinator.relays import Relay, RelayPool
from swarm.node.links import LinkError, StageLink, dial

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm._proto.swarm.v1.coordinator_pb2_grpc import CoordinatorStub
from swarm.codecs.base import EncodedTensor
from swarm.core.config import RunConfig
from swarm.net import certs, relay, tls
from swarm.net.relay import (
    GO,
    HEADER_BYTES,
    ROLE_ACCEPT,
    ROLE_DIAL,
    RelayAcceptor,
    RelayForwarder,
    RelayLimits,
    RelayServer,
    header,
    ping,
    rendezvous_key,
)
from swarm.net.tls import Security
from swarm.ops.metrics import Metrics
from swarm.runtime.wire import GradientFrame
from tests.hostile_relay import Tampered, tampering
from tests.procs import Proc, coordinator, free_port, node, processes, status, tiny_run, wait_status
from tests.test_links import CLIENT, DOWN_PEER, SECRET, run, stage_server
from tests.test_swarm import reference_run

KEY = rendezvous_key(SECRET, 0, CLIENT.node_id, DOWN_PEER.node_id, 3)


def sample(server: RelayServer, name: str, labels: dict[str, str] | None = None) -> float:
    return server.metrics.registry.get_sample_value(name, labels or {}) or 0.0


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def connect(port: int, role: int, key: bytes = KEY) -> Stream:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(header(role, key))
    await writer.drain()
    return reader, writer


def test_the_key_depends_on_secret_pair_and_epoch_and_a_header_is_fixed_size():
    keys = {
        rendezvous_key(SECRET, 0, "up", "down", 3),
        rendezvous_key("other secret", 0, "up", "down", 3),
        rendezvous_key(SECRET, 1, "up", "down", 3),
        rendezvous_key(SECRET, 0, "up", "down2", 3),
        rendezvous_key(SECRET, 0, "up", "down", 4),
    }
    assert len(keys) == 5 and all(len(k) == 32 for k in keys)
    assert len(header(ROLE_DIAL, KEY)) == HEADER_BYTES
    with pytest.raises(ValueError, match="32 bytes"):
        header(ROLE_DIAL, b"short")


def test_a_dialler_and_a_parked_acceptor_of_one_key_are_spliced_exactly_both_ways():
    """5 MB each way through the relay, unchanged; the pair and its bytes are counted."""
    up, down = os.urandom(5 << 20), os.urandom(5 << 20)

    async def scenario() -> tuple[bytes, bytes, RelayServer]:
        async with RelayServer() as server:
            port = await server.start()
            a_reader, a_writer = await connect(port, ROLE_ACCEPT)
            d_reader, d_writer = await connect(port, ROLE_DIAL)
            assert await a_reader.readexactly(1) == GO

            async def send(writer: asyncio.StreamWriter, data: bytes) -> None:
                writer.write(data)
                await writer.drain()
                writer.write_eof()

            _, _, got_down, got_up = await asyncio.gather(
                send(d_writer, up), send(a_writer, down), d_reader.read(), a_reader.read()
            )
            for w in (a_writer, d_writer):
                w.close()
            await asyncio.sleep(0.1)
            return got_up, got_down, server

    got_up, got_down, server = run(scenario())
    assert got_up == up and got_down == down
    assert sample(server, "swarm_relay_links_total") == 1
    assert sample(server, "swarm_relay_bytes_total") == len(up) + len(down)
    assert sample(server, "swarm_relay_active_links") == 0 and server.parked == 0


def test_ping_tells_a_live_relay_from_a_closed_port():
    async def scenario() -> tuple[bool, bool]:
        async with RelayServer() as server:
            port = await server.start()
            alive = await ping(f"127.0.0.1:{port}")
        return alive, await ping(f"127.0.0.1:{port}", timeout=1)

    assert run(scenario()) == (True, False)


def test_a_relay_counts_as_gone_only_after_two_missed_pings_in_a_row():
    """One ping lost to a busy host must not move a relay's links (a new epoch); two in a row do."""

    async def scenario() -> list[tuple[bool, list[str]]]:
        seen = []
        async with RelayServer() as server:
            address = f"127.0.0.1:{await server.start()}"
            pool = RelayPool([Relay(address, address)])
            seen.append((await pool.probe(), list(pool.alive)))
        for _ in range(3):  # the relay is closed now
            seen.append((await pool.probe(), list(pool.alive)))
        return seen

    [(came, alive), *missed] = run(scenario())
    address = alive[0]
    assert came and missed == [(False, [address]), (True, []), (False, [])]


def test_bad_headers_unpaired_diallers_and_a_full_parking_are_refused_and_counted():
    limits = RelayLimits(parked_per_key=1, pair_s=0.3, header_s=0.3)

    async def scenario() -> tuple[RelayServer, list[bytes]]:
        async with RelayServer(limits) as server:
            port = await server.start()
            answers = []
            for role, key in ((ROLE_DIAL, os.urandom(32)), (ROLE_ACCEPT, KEY), (ROLE_ACCEPT, KEY)):
                reader, writer = await connect(port, role, key)
                if role == ROLE_DIAL or len(answers) == 2:
                    answers.append(await asyncio.wait_for(reader.read(), 5))  # closed: nothing, EOF
                else:
                    answers.append(b"parked")
            for junk in (b"GET / HTTP/1.1\r\n\r\n" + bytes(40), b"SWR"):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(junk)
                answers.append(await asyncio.wait_for(reader.read(), 5))
            return server, answers

    server, answers = run(scenario())
    assert answers == [b"", b"parked", b"", b"", b""]
    for reason, count in (("unpaired", 1), ("full", 1), ("bad_header", 2)):
        assert sample(server, "swarm_relay_refused_total", {"reason": reason}) == count, reason


async def closed(reader: asyncio.StreamReader, wait_s: float = 5.0) -> bool:
    """Whether the relay closed this connection (end of stream or reset) within ``wait_s`` without
    sending anything."""
    try:
        return await asyncio.wait_for(reader.read(), wait_s) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_the_relay_splices_no_more_links_than_allowed():
    """``links=1``: a second pair is refused although its acceptor is parked; the first still works."""

    async def scenario() -> tuple[bool, bytes, RelayServer]:
        async with RelayServer(RelayLimits(links=1)) as server:
            port = await server.start()
            first, second = os.urandom(32), os.urandom(32)
            a_reader, a_writer = await connect(port, ROLE_ACCEPT, first)
            _, d_writer = await connect(port, ROLE_DIAL, first)
            assert await a_reader.readexactly(1) == GO
            _, b_writer = await connect(port, ROLE_ACCEPT, second)
            e_reader, _ = await connect(port, ROLE_DIAL, second)
            refused = await closed(e_reader)
            d_writer.write(b"still spliced")
            await d_writer.drain()
            through = await a_reader.readexactly(13)
            for w in (a_writer, d_writer, b_writer):
                w.close()
            return refused, through, server

    refused, through, server = run(scenario())
    assert refused and through == b"still spliced"
    assert sample(server, "swarm_relay_refused_total", {"reason": "full"}) == 1


def test_the_relay_takes_no_more_connections_from_one_host_than_allowed():
    async def scenario() -> tuple[list[bool], RelayServer]:
        async with RelayServer(RelayLimits(per_host=2)) as server:
            port = await server.start()
            held = [await connect(port, ROLE_ACCEPT, os.urandom(32)) for _ in range(3)]
            answers = [await closed(reader, 0.5) for reader, _ in held]
            for _, writer in held:
                writer.close()
            return answers, server

    answers, server = run(scenario())
    assert answers == [False, False, True]  # two parked (nothing to read yet), the third closed
    assert sample(server, "swarm_relay_refused_total", {"reason": "full"}) == 1


def test_a_link_is_held_to_the_relays_rate():
    """1 MB at 4 Mbit/s needs 2 s through the relay (a lower bound: the limiter's job)."""
    limits = RelayLimits(link_mbps=4.0)

    async def scenario() -> float:
        async with RelayServer(limits) as server:
            port = await server.start()
            a_reader, a_writer = await connect(port, ROLE_ACCEPT)
            _, d_writer = await connect(port, ROLE_DIAL)
            await a_reader.readexactly(1)
            loop = asyncio.get_running_loop()
            start = loop.time()
            d_writer.write(bytes(1 << 20))
            await a_reader.readexactly(1 << 20)
            elapsed = loop.time() - start
            for w in (a_writer, d_writer):
                w.close()
            return elapsed

    assert run(scenario()) >= 1.8


# -- a boundary stream through the relay ------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pki")
    certs.init(root)
    for name in ("node-up", "node-down"):
        certs.issue_node(root, name)
    return root


def mutual(pki: Path, name: str) -> Security:
    return Security.from_files(pki / "ca.pem", pki / f"{name}.pem", pki / f"{name}.key", mutual=True)


def frame(step: int) -> GradientFrame:
    payload = torch.randn(2500, generator=torch.Generator().manual_seed(step)).numpy().tobytes()
    return GradientFrame(step, 0, 0, EncodedTensor("fp32", 2500, 1, payload))


async def relayed_stream(
    pki: Path, frames: int, relay_port: int, relay_after_s: float = 0.0
) -> tuple[list, list[Exception]]:
    """Stage 0 (dialler) sends ``frames`` gradient frames to stage 1 (accepting) over mutual TLS
    through a relay on ``relay_port`` (started ``relay_after_s`` after both ends are up); what
    stage 1 received, and the failures either end saw."""
    received: list = []
    failures: list[Exception] = []
    attached = asyncio.Event()

    async def attach(boundary: int, link: StageLink) -> None:
        attached.set()
        await link.pump(received.append, failures.append)

    address = f"127.0.0.1:{relay_port}"
    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(stage_server(attach, mutual(pki, "node-down")))
        acceptor = RelayAcceptor(address, KEY, server.address)
        acceptor.start()
        stack.push_async_callback(acceptor.close)
        forwarder = RelayForwarder(address, KEY)
        stack.push_async_callback(forwarder.close)
        local = await forwarder.start()
        if relay_after_s:
            await asyncio.sleep(relay_after_s)
        relay_server = await stack.enter_async_context(RelayServer())
        await relay_server.start(port=relay_port)
        link, channel = await dial(
            local, CLIENT, 0, 0, DOWN_PEER, Metrics("node"), timeout=20, security=mutual(pki, "node-up")
        )
        stack.push_async_callback(channel.close)
        reader = asyncio.create_task(link.pump(lambda item: None, failures.append))
        stack.callback(reader.cancel)
        await asyncio.wait_for(attached.wait(), 10)
        try:
            for step in range(frames):
                await link.send(frame(step))
            await link.close(flush_s=10)
        except LinkError as e:
            failures.append(e)
        for _ in range(100):
            if len(received) == frames or failures:
                break
            await asyncio.sleep(0.1)
    return received, failures


def test_a_boundary_stream_over_mutual_tls_runs_through_the_relay(pki: Path):
    """The acceptor parks before the relay is up (it retries), then 40 frames pass unchanged."""
    received, failures = run(relayed_stream(pki, 40, free_port(), relay_after_s=0.5), timeout=60)
    assert {str(e) for e in failures} <= {"boundary 0: the peer closed the stream"}  # after the last
    assert [f.step for f in received] == list(range(40))
    assert all(f.payload.data == frame(f.step).payload.data for f in received)


@pytest.mark.parametrize("how", ["flip", "drop", "replay"])
def test_a_relay_that_alters_bytes_breaks_the_stream_but_delivers_nothing_corrupt(
    pki: Path, how: str, monkeypatch
):
    """TLS runs end to end through the relay: whatever it does to the bytes, the receiver either
    gets the frames exactly as sent or a broken stream (then the step fails and the epoch retries)."""
    Tampered.done = False  # every pipe of this process alters the stream: relay, forwarder, acceptor
    monkeypatch.setattr(relay, "pipe", tampering(how, 20_000))
    received, failures = run(relayed_stream(pki, 40, free_port()), timeout=60)
    assert Tampered.done and failures, (len(received), failures)
    assert len(received) < 40
    assert all(f.payload.data == frame(f.step).payload.data for f in received)
    assert [f.step for f in received] == list(range(len(received)))


# -- swarms whose only link runs through a relay ----------------------------------------------------

STEPS, INTERVAL = 30, 5
LINK = ("--link-latency-ms", "15")  # slows each step, so a kill lands mid-run


def relayed_run(folder: Path) -> tuple[RunConfig, list[float]]:
    config = tiny_run(folder, STEPS, n_stages=2, checkpoint_interval=INTERVAL)
    return config, reference_run(config, folder / "cache")[0]


def dial_only_nodes(
    running: list[Proc], folder: Path, address: str, flags: Callable[[str], list[str]] = lambda name: []
) -> list[Proc]:
    """Two nodes that accept no inbound stream (``--listen ''``): stage 0 and stage 1."""
    return [node(running, folder, n, address, "--listen", "", *LINK, *flags(n)) for n in ("a", "b")]


def stages_of(status: coordinator_pb2.StatusReply, proc: Proc) -> list[int]:
    """The stages the node started as ``proc`` hosted last."""
    return next(list(n.last_stages) for n in status.nodes if n.node_name == proc.log.stem)


def node_pki(folder: Path) -> Path:
    """A CA with the coordinator's certificate and nodes a's and b's."""
    pki = folder / "pki"
    certs.init(pki)
    for name in ("a", "b"):
        certs.issue_node(pki, name)
    return pki


def assert_reproduces(final: coordinator_pb2.StatusReply, reference: list[float]) -> None:
    assert final.run_complete and [s.step for s in final.steps] == list(range(STEPS))
    rel = [abs(s.loss - r) / abs(r) for s, r in zip(final.steps, reference, strict=True)]
    assert max(rel) < 1e-4, rel


@pytest.mark.timeout(300)
def test_two_dial_only_nodes_train_through_the_coordinators_relay_over_mutual_tls(tmp_path: Path):
    """Neither node can accept: the coordinator's relay carries their link (TLS end to end), the run
    reproduces the single-process losses, and Status shows the link as relayed."""
    config, reference = relayed_run(tmp_path)
    pki = node_pki(tmp_path)
    with processes() as running:
        flags = (*tls.cli_flags(pki, "coordinator"), "--relay-port", "0")
        address = coordinator(running, tmp_path, config, *flags, port=free_port())
        relay_port = re.search(r"relay=(\d+)", running[0].stdout()).group(1)
        nodes = dial_only_nodes(running, tmp_path, address, lambda name: tls.cli_flags(pki, name))
        client = Security.from_files(pki / "ca.pem", pki / "a.pem", pki / "a.key", mutual=True)
        relayed = set()
        with client.channel(address) as channel:
            stub = CoordinatorStub(channel)
            deadline = time.monotonic() + 150
            while any(n.p.poll() is None for n in nodes) and time.monotonic() < deadline:
                relayed.update(stub.Status(coordinator_pb2.StatusRequest(), timeout=5).relayed_links)
                time.sleep(0.2)
            for n in nodes:
                assert n.wait(5) == 0, n.output()
            final = stub.Status(coordinator_pb2.StatusRequest(), timeout=5)
    assert_reproduces(final, reference)
    assert final.epochs_restarted == 0 and not final.plan_problems, running[0].output()
    up, down = sorted(nodes, key=lambda n: stages_of(final, n))  # whoever joined first has stage 0
    assert relayed == {f"boundary 0: {up.log.stem} -> {down.log.stem} through relay :{relay_port}"}
    relay_at = f"through relay {address.rpartition(':')[0]}:{relay_port}"
    assert f"boundary 0: dialled stage 1 {relay_at} (certificate {down.log.stem})" in up.stdout()
    assert f"accepted stream from stage 0 {relay_at}" in down.stdout()


@pytest.mark.timeout(300)
def test_a_killed_relay_moves_the_link_to_another_and_the_run_reproduces_its_losses(tmp_path: Path):
    """Two ``swarm-coordinator relay`` processes; the one carrying the link is killed mid-run: the
    link comes back through the other and the run completes with the undisturbed losses."""
    config, reference = relayed_run(tmp_path)
    with processes() as running:
        relays = []
        for name in ("r1", "r2"):
            args = [sys.executable, "-m", "swarm.coordinator.cli", "relay", "--port", str(free_port())]
            running.append(Proc(args, tmp_path / f"{name}.err"))
            relays.append(running[-1].wait_for(r"relay listening on (\S+)", 60).group(1))
        flags = [arg for r in relays for arg in ("--relay", r)]
        address = coordinator(running, tmp_path, config, *flags)
        nodes = dial_only_nodes(running, tmp_path, address)
        mid = wait_status(address, lambda r: r.step >= INTERVAL + 2 and r.relayed_links, "mid-run", 180)
        (line,) = mid.relayed_links
        used = line.rpartition(" ")[2]
        running[relays.index(used)].p.kill()
        for n in nodes:
            assert n.wait(150) == 0, n.output()
        final = status(address)
    assert_reproduces(final, reference)
    assert final.epochs_restarted >= 1
    (other,) = set(relays) - {used}
    dialled = "".join(n.stdout() for n in nodes)
    assert f"boundary 0: dialled stage 1 through relay {other}" in dialled  # after the kill


@pytest.mark.timeout(300)
def test_a_relay_that_flips_a_bit_mid_run_breaks_the_link_and_the_run_recovers_exactly(tmp_path: Path):
    """Over mutual TLS, a relay flips one bit once the link has carried 50 kB: the TLS record check
    breaks the stream (nothing corrupt reaches a stage), the epoch restarts from the cut through
    the same relay, and the run ends with the undisturbed losses."""
    config, reference = relayed_run(tmp_path)
    pki = node_pki(tmp_path)
    with processes() as running:
        port = free_port()
        hostile = [sys.executable, "-m", "tests.hostile_relay", "flip", "50000", "--port", str(port)]
        running.append(Proc(hostile, tmp_path / "relay.err"))
        running[-1].wait_for(r"relay listening on", 60)
        flags = (*tls.cli_flags(pki, "coordinator"), "--relay", f"127.0.0.1:{port}")
        address = coordinator(running, tmp_path, config, *flags, port=free_port())
        nodes = dial_only_nodes(running, tmp_path, address, lambda name: tls.cli_flags(pki, name))
        for n in nodes:
            assert n.wait(150) == 0, n.output()
        running[0].wait_for(r"tampered \(flip\)", 5)
        client = Security.from_files(pki / "ca.pem", pki / "a.pem", pki / "a.key", mutual=True)
        with client.channel(address) as channel:
            final = CoordinatorStub(channel).Status(coordinator_pb2.StatusRequest(), timeout=5)
    assert_reproduces(final, reference)
    assert final.epochs_restarted >= 1
