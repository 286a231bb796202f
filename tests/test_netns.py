"""Emulated links from network namespaces + tbf: measured rate, teardown, a swarm and the peer inside."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import peer
from bench.netns import IFNAME, EmulatedNetwork, available, cleanup_stale, list_namespaces, nat_available
from bench.throughput import Link
from swarm.core.config import MODEL_PRESETS, CheckpointConfig, CodecConfig, RunConfig, TrainConfig
from swarm.launch.local_swarm import SwarmSummary, up
from tests.test_swarm import reference_run

OK, REASON = available()
pytestmark = pytest.mark.skipif(not OK, reason=REASON)

SERVER = """
import socket, sys, time
s = socket.create_server((sys.argv[1], 5001))
print("ready", flush=True)
conn, _ = s.accept()
n, t0 = 0, None
while data := conn.recv(1 << 16):
    t0 = t0 or time.perf_counter()
    n += len(data)
print(n, time.perf_counter() - t0, flush=True)
"""
CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], 5001)) as c:
    c.sendall(bytes(int(sys.argv[2])))
"""


def ours(prefix: str) -> list[str]:
    return [ns for ns in list_namespaces() if ns.startswith(prefix + "-")]


def test_tcp_transfer_runs_at_the_link_rate_and_teardown_leaves_nothing():
    prefix = "swstest"
    with EmulatedNetwork(2, 20, prefix=prefix) as net:
        assert len(ours(prefix)) == 3  # two hosts and the bridge
        server = subprocess.Popen(
            [*net.exec_prefix(1), sys.executable, "-c", SERVER, net.host_ip(1)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout.readline().strip() == "ready"
            nbytes = 20_000_000 // 8 * 2  # two seconds at 20 Mbit/s
            client = [*net.exec_prefix(0), sys.executable, "-c", CLIENT, net.host_ip(1), str(nbytes)]
            subprocess.run(client, check=True, timeout=60)
            received, seconds = server.stdout.readline().split()
            server.wait(timeout=10)
        finally:
            server.kill()
    mbps = int(received) * 8 / float(seconds) / 1e6
    assert int(received) == nbytes
    assert 12 <= mbps <= 22, mbps
    assert ours(prefix) == []


def test_teardown_on_an_exception():
    prefix = "swstest"
    with pytest.raises(KeyboardInterrupt), EmulatedNetwork(3, 5, prefix=prefix, control=True):
        assert len(ours(prefix)) == 5
        raise KeyboardInterrupt
    assert ours(prefix) == []


def test_cleanup_stale_deletes_only_namespaces_of_dead_processes():
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = [f"swstest-{dead.pid}-0-h0", f"swstest-{os.getpid()}-99-h0"]
    for ns in names:
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        assert cleanup_stale("swstest") == names[:1]
        assert ours("swstest") == names[1:]
    finally:
        cleanup_stale("swstest", include_live=True)
    assert ours("swstest") == []


def tiny_train(steps: int = 3) -> TrainConfig:
    return TrainConfig(steps=steps, batch_size=4, seq_len=32, microbatches=2, lr=1e-2, warmup_steps=1)


def tbf_sent_bytes(ns: str) -> int:
    """Bytes the tbf on ``ns``'s interface has sent."""
    stats = subprocess.run(
        ["tc", "-s", "-n", ns, "qdisc", "show", "dev", IFNAME], capture_output=True, text=True
    )
    return int(re.search(r"Sent (\d+) bytes", stats.stdout).group(1))


def swarm_in(net: EmulatedNetwork, config: RunConfig, run: Path, **options) -> SwarmSummary:
    """``config`` on nodes each on its host of ``net`` (one per stage unless ``options`` say more),
    the coordinator on its control host."""
    return up(
        config,
        run,
        progress=False,
        use_dht=False,
        timeout=300,
        launch_prefix=net.exec_prefix,
        node_host=net.host_ip,
        coordinator_prefix=net.control_prefix,
        coordinator_host=net.control_ip,
        **options,
    )


def test_swarm_inside_the_emulated_network(tmp_path):
    config = RunConfig(
        model=dataclasses.replace(MODEL_PRESETS["tiny"]),
        codec=CodecConfig(kind="subspace"),
        train=tiny_train(),
        n_stages=2,
    )
    with EmulatedNetwork(2, 50, prefix="swstest", control=True) as net:
        summary = swarm_in(net, config, tmp_path / "run")
        sent = [tbf_sent_bytes(ns) for ns in net.hosts]
    assert summary.steps == 3 and summary.tokens_per_second > 0
    assert f"listening on {net.control_ip}:" in (tmp_path / "run" / "coordinator.log").read_text()
    logs = "".join(log.read_text() for log in summary.node_logs)
    assert re.search(r"dialled stage \d at 10\.213\.0\.[23]:\d+", logs), logs
    # Both directions of the boundary went through the hosts' tbf links.
    assert min(sent) > summary.wire_bytes_backward
    assert ours("swstest") == []


def test_peer_smoke_on_a_tbf_link():
    (row,) = peer.run(MODEL_PRESETS["tiny"], tiny_train(), 2, [Link("20 Mbit/s", 20)])
    assert row["system"] == peer.SYSTEM and row["shaper"] == "netns+tbf"
    assert row["tokens_per_s"] > 0


# -- behind real NAT (MASQUERADE routers, no inbound forwarding) ------------------------------------

NAT_OK, NAT_REASON = nat_available()


def nat_swarm(tmp_path: Path, n_stages: int, nat: set[int]) -> tuple[RunConfig, SwarmSummary, list[float]]:
    """A swarm of one node per stage, the hosts in ``nat`` behind NAT (each announces its private
    address, as a volunteer who opened nothing would), and a coordinator that can relay; its
    summary and the single-process losses of the same run."""
    config = RunConfig(
        model=dataclasses.replace(MODEL_PRESETS["tiny"]),
        codec=CodecConfig(kind="subspace"),
        train=tiny_train(steps=6),
        n_stages=n_stages,
    )
    with EmulatedNetwork(n_stages, 50, prefix="swstest", control=True, nat=nat) as net:
        summary = swarm_in(net, config, tmp_path / "run", relay=True)
    assert ours("swstest") == []
    return config, summary, reference_run(config, tmp_path / "cache")[0]


def assert_same_losses(summary: SwarmSummary, reference: list[float]) -> None:
    rel = [abs(a - b) / abs(b) for a, b in zip(summary.losses, reference, strict=True)]
    assert max(rel) < 1e-4, rel


def node_logs(run: Path, n: int, suffix: str) -> list[str]:
    return [(run / f"node{i}.{suffix}").read_text() for i in range(n)]


@pytest.mark.skipif(not NAT_OK, reason=NAT_REASON)
def test_two_nodes_behind_nat_train_through_the_relay(tmp_path: Path):
    """Both hosts are behind NAT: the coordinator's dial-back of their private addresses fails, so
    both are dial-only, their link runs through the coordinator's relay (which they reach through
    their routers), and the run reproduces the single-process losses."""
    _, summary, reference = nat_swarm(tmp_path, 2, nat={0, 1})
    assert_same_losses(summary, reference)
    run = tmp_path / "run"
    for err in node_logs(run, 2, "err"):
        assert re.search(r"not reachable: .*192\.168\.\d\.2:\d+", err), err[-2000:]
    logs = "".join(node_logs(run, 2, "log"))
    assert re.search(r"dialled stage 1 through relay 10\.213\.0\.1:\d+", logs), logs
    assert re.search(r"accepted stream from stage 0 through relay 10\.213\.0\.1:\d+", logs), logs


@pytest.mark.slow  # the NAT and relay paths stay in the default suite
@pytest.mark.skipif(not NAT_OK, reason=NAT_REASON)
def test_two_nated_and_two_public_hosts_need_no_relay(tmp_path: Path):
    """4 stages on 2 hosts behind NAT and 2 public ones: placement puts a public node next to every
    NATed one, so no link is relayed (though the coordinator could), and the losses are the
    single-process run's."""
    _, summary, reference = nat_swarm(tmp_path, 4, nat={0, 2})
    assert_same_losses(summary, reference)
    logs = "".join(node_logs(tmp_path / "run", 4, "log"))
    assert "through relay" not in logs
    assert len(re.findall(r"dialled stage \d at 10\.213\.0\.[2-5]:\d+", logs)) == 3, logs


@pytest.mark.slow  # the NAT and relay paths stay in the default suite
@pytest.mark.skipif(not NAT_OK, reason=NAT_REASON)
def test_a_partition_between_two_live_neighbours_is_placed_around(tmp_path: Path):
    """Mid-run, the hosts of the two stage nodes start dropping every packet between them; both
    still reach the coordinator and heartbeat. Their link fails in two consecutive epochs and the
    standby takes one end's place (before, the same plan restarted for as long as the partition
    lasted); the run completes with the single-process losses."""
    config = RunConfig(
        model=dataclasses.replace(MODEL_PRESETS["tiny"]),
        codec=CodecConfig(kind="subspace"),
        train=tiny_train(steps=40),
        checkpoint=CheckpointConfig(interval=5),
        n_stages=2,
    )
    run = tmp_path / "run"
    with EmulatedNetwork(3, 50, prefix="swstest", control=True) as net:
        options = {"nodes": 2, "standbys": 1, "connect_timeout": 8, "link_latency_ms": 20}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            swarm = pool.submit(swarm_in, net, config, run, **options)
            hosts = wait_for_hosts(run, 3, 2, swarm)
            net.partition(*hosts)
            partitioned_at = time.monotonic()
            summary = swarm.result(timeout=300)
    assert_same_losses(summary, reference_run(config, tmp_path / "cache")[0])
    coordinator = (run / "coordinator.err").read_text()
    assert "failed in two consecutive epochs: placing around it" in coordinator, coordinator[-3000:]
    print(f"MEASURED partition: the run ended {time.monotonic() - partitioned_at:.1f} s after it began")


def wait_for_hosts(run: Path, n: int, count: int, swarm: concurrent.futures.Future) -> list[int]:
    """The indices of the first ``count`` nodes (of ``n``) that print which stages they host."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not swarm.done():
        hosting = [i for i in range(n) if "hosts stages [" in read(run / f"node{i}.log")]
        if len(hosting) >= count:
            return hosting[:count]
        time.sleep(0.1)
    raise AssertionError(f"fewer than {count} nodes hosted a stage: {swarm.done() and swarm.result()}")


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""
