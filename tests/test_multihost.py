"""The multi-host recipe of docs/operations.md on emulated hosts (one network namespace each, no
loopback across hosts): training with the DHT on, a dial-only node and a node that cannot reach
the DHT; a real Prometheus scraping every process; gRPC health, /healthz and ``swarm status``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import multihost, wan_replicas
from bench.multihost import (
    CERTS,
    COORDINATOR,
    DIAL_ONLY_NODE,
    INBOUND_NODE,
    ISSUE,
    METRICS_PORT,
    ROLES,
    STATUS,
    MultiHostPlan,
)
from bench.netns import available
from swarm.core.config import MODEL_PRESETS, ReplicaSyncConfig, TrainConfig
from tests.test_deploy import dashboard_exprs

ROOT = Path(__file__).resolve().parents[1]
OK, REASON = available()
needs_netns = pytest.mark.skipif(not OK, reason=REASON)
PROMETHEUS = shutil.which("prometheus") is not None and shutil.which("promtool") is not None
needs_prometheus = pytest.mark.skipif(
    not PROMETHEUS, reason="prometheus/promtool not installed (apt-get install prometheus)"
)
STEPS = 8


def test_the_docs_quote_the_recipe_this_test_runs():
    operations = ROOT.joinpath("docs", "operations.md").read_text()
    for line in (CERTS, ISSUE, COORDINATOR, INBOUND_NODE, DIAL_ONLY_NODE, STATUS):
        assert line in operations, f"docs/operations.md's multi-host section lacks: {line}"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory) -> Iterator[multihost.MultiHostSwarm]:
    if not OK:
        pytest.skip(REASON)
    train = TrainConfig(steps=STEPS, batch_size=4, seq_len=32, microbatches=2, lr=1e-2, warmup_steps=1)
    plan = MultiHostPlan(MODEL_PRESETS["tiny"], train, mbps=100, prometheus=PROMETHEUS)
    with multihost.running(plan, tmp_path_factory.mktemp("multihost")) as running:
        yield running


def log_with(swarm, name: str, text: str, timeout: float = 30.0) -> str:
    """``name``'s log once it holds ``text`` (or as it is after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while text not in (log := swarm.log(name)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return log


def host_ips(text: str) -> set[str]:
    return set(re.findall(r"\b(?:\d{1,3}\.){3}\d{1,3}\b", text))


@needs_netns
def test_recipe_trains_across_hosts_with_the_dht(swarm):
    poller = swarm.poller
    assert [s.step for s in poller.steps] == list(range(STEPS))
    nodes = {n.node_name: n for n in poller.nodes}
    for i, role in enumerate(ROLES):
        n = nodes[f"node{i}"]
        assert list(n.last_stages) == [i] and n.left  # it left when the run was complete
        # Announced from the interface that reaches the coordinator, never 0.0.0.0 or loopback.
        assert n.address == ("" if role == "dial-only" else f"{swarm.host_ip(i)}:{multihost.NODE_PORT}")
    coordinator = swarm.log("coordinator")
    dht = re.search(r"DHT at (.+)", coordinator).group(1)
    assert host_ips(dht) == {swarm.coordinator_ip}, dht
    for i, role in enumerate(ROLES):
        # A node says Leave before it prints its last line: wait for that line, bounded.
        log = log_with(swarm, f"node{i}", f"finished {STEPS} steps on stages [{i}]")
        if role == "no-dht":
            assert "DHT unavailable, discovery falls back to the coordinator's addresses" in log
        else:
            joined = re.search(r"DHT joined at (.+)", log).group(1)
            assert host_ips(joined) == {swarm.host_ip(i)}, joined
        assert f"finished {STEPS} steps on stages [{i}]" in log
        assert "fork_posix" not in log  # no gRPC C-core noise
        assert "127.0.0.1" not in " ".join(re.findall(r"(?:dialled|accepted) .*", log))
    assert re.search(rf"boundary 0: dialled stage 0 at {swarm.host_ip(0)}:7100", swarm.log("node1"))
    assert re.search(rf"boundary 1: dialled stage 2 at {swarm.host_ip(2)}:7100", swarm.log("node1"))


def promql(swarm, query: str) -> list[dict]:
    url = f"http://{swarm.coordinator_ip}:9090/api/v1/query?query={urllib.parse.quote(query)}"
    reply = json.loads(swarm.fetch(url))
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def scraped_after(swarm, at: float, timeout: float = 30.0) -> None:
    """Until Prometheus has scraped every target after unix time ``at`` (bounded by ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        scrapes = promql(swarm, "timestamp(up)")
        if len(scrapes) == len(ROLES) + 1 and min(float(r["value"][1]) for r in scrapes) > at:
            return
        time.sleep(0.5)
    raise AssertionError(f"Prometheus scraped no target after the run completed within {timeout} s")


@needs_netns
@needs_prometheus
def test_prometheus_scrapes_the_swarm(swarm):
    # A tiny run completes within one scrape interval: look at scrapes taken after it did.
    scraped_after(swarm, max(s.completed_at for s in swarm.poller.steps))
    up = promql(swarm, "up")
    assert sorted((r["labels"] if "labels" in r else r["metric"])["instance"] for r in up) == sorted(
        [f"{swarm.coordinator_ip}:{METRICS_PORT}"] + [f"{swarm.host_ip(i)}:{METRICS_PORT}" for i in range(4)]
    )
    assert all(r["value"][1] == "1" for r in up), up
    (tokens,) = promql(swarm, 'swarm_run_tokens_per_second{job="swarm-coordinator"}')
    assert float(tokens["value"][1]) > 0
    (ratio,) = promql(swarm, 'swarm_run_compression_ratio{job="swarm-coordinator"}')
    assert float(ratio["value"][1]) > 1
    # The nodes' own counters agree that the wire carries less than dense bf16 would.
    (node_ratio,) = promql(
        swarm, 'sum(swarm_dense_equivalent_bytes_total{io="sent"}) / sum(swarm_wire_bytes_total{io="sent"})'
    )
    assert float(node_ratio["value"][1]) > 1
    (per_stage,) = promql(swarm, "count(swarm_stage_tokens_per_second > 0)")
    assert per_stage["value"][1] == "4"
    # Every run-level panel of the Grafana dashboard shows data for this swarm.
    for expr in dashboard_exprs():
        if 'job="swarm-coordinator"' in expr and "rate(" not in expr:
            assert promql(swarm, expr), expr


@needs_netns
@needs_prometheus
def test_promtool_accepts_every_exposition(swarm):
    hosts = [(None, swarm.coordinator_ip)] + [(i, swarm.host_ip(i)) for i in range(len(ROLES))]
    for host, ip in hosts:
        text = swarm.fetch(f"http://{ip}:{METRICS_PORT}/metrics", host)
        assert b"swarm_" in text
        done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60)
        assert done.returncode == 0, (ip, done.stdout, done.stderr)


@needs_netns
def test_every_process_reports_healthy(swarm):
    coordinator = f"{swarm.coordinator_ip}:{multihost.GRPC_PORT}"
    assert swarm.health(coordinator, host=0) == "SERVING"
    assert swarm.health(coordinator, "swarm.v1.Coordinator", host=0) == "SERVING"
    for i, role in enumerate(ROLES):
        if role != "dial-only":  # it has no gRPC port; its HTTP endpoint answers below
            # Lingering after the run: the process is up, its Stage service takes no more streams.
            assert swarm.health(f"{swarm.host_ip(i)}:7100", node=True) == "SERVING"
            assert swarm.health(f"{swarm.host_ip(i)}:7100", "swarm.v1.Stage", node=True) == "NOT_SERVING"
        assert swarm.fetch(f"http://{swarm.host_ip(i)}:{METRICS_PORT}/healthz") == b"ok\n"


@needs_netns
def test_swarm_status_from_a_volunteer_host(swarm):
    table = swarm.swarm_status(2)
    assert "complete" in table and f"step {STEPS - 1}" in table
    assert "compression" in table and "tokens/s" in table
    for i, role in enumerate(ROLES):  # the coordinator dialled every announced address back
        inbound = "dial-only" if role == "dial-only" else "open"
        assert re.search(rf"node{i}\s+left\s+\w+\s+{i}\s+{inbound}\s+{STEPS - 1}\s", table), table
    doc = json.loads(swarm.swarm_status(2, "--json"))
    assert doc == json.loads(swarm.fetch(f"http://{swarm.coordinator_ip}:{METRICS_PORT}/status")) | {
        "nodes": doc["nodes"]
    }
    assert doc["rates"]["compression_ratio"] > 1 and doc["rates"]["tokens_per_second"] > 0
    full_ids = [n.node_id for n in swarm.poller.nodes]
    for text in (table, json.dumps(doc)):
        assert swarm.token not in text
        assert not any(node_id in text for node_id in full_ids)  # ids are credentials: shortened


@pytest.mark.slow
@needs_netns
def test_a_replica_on_another_host_averages_across_the_emulated_links():
    """The ``wan_replicas`` section in small: a second replica of the slow stage joins on a third
    host and syncs by overlapped int8 outer steps over the access links; the run completes every
    step, both replicas report their averaging, and one replica alone averages nothing."""
    train = TrainConfig(steps=16, batch_size=4, seq_len=32, microbatches=2, lr=1e-2, warmup_steps=1)
    sync = ReplicaSyncConfig(mode="outer", every=4, format="int8", overlap=1)
    # stage 1 slow enough that the standby is measured and placed long before step 16
    plan = wan_replicas.WanReplicaPlan(MODEL_PRESETS["tiny"], train, slowdown=8.0, syncs=(sync,))
    one, two = wan_replicas.run(plan)
    assert (one["mode"], two["mode"]) == ("1 replica", "2 replicas, outer H=4 int8 overlap 1")
    assert one["steps"] == two["steps"] == 16 and one["tokens_per_s"] > 0 < two["tokens_per_s"]
    assert one["averaging_bytes_per_replica_step"] == 0 < two["averaging_bytes_per_replica_step"]
    assert two["replicas_seen"] == 2
