"""Emulated links from network namespaces + tbf: measured rate, teardown, a swarm and the peer inside."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from bench import peer
from bench.netns import IFNAME, EmulatedNetwork, available, cleanup_stale, list_namespaces
from bench.throughput import Link
from swarm.core.config import MODEL_PRESETS, CodecConfig, RunConfig, TrainConfig
from swarm.launch.local_swarm import up

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


def test_swarm_inside_the_emulated_network(tmp_path):
    config = RunConfig(
        model=dataclasses.replace(MODEL_PRESETS["tiny"]),
        codec=CodecConfig(kind="subspace"),
        train=tiny_train(),
        n_stages=2,
    )
    with EmulatedNetwork(2, 50, prefix="swstest", control=True) as net:
        summary = up(
            config,
            tmp_path / "run",
            progress=False,
            use_dht=False,
            timeout=300,
            launch_prefix=net.exec_prefix,
            node_host=net.host_ip,
            coordinator_prefix=net.control_prefix,
            coordinator_host=net.control_ip,
        )
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
