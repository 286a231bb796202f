"""Operations on loopback: health of every process while it trains, the run rates, and a stopped
node shown dead by ``swarm status`` within the heartbeat timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb
from swarm.ops.status import render, run_rates, status_document
from tests.procs import coordinator, node, processes, wait_for_nodes, wait_status

ROOT = Path(__file__).resolve().parents[1]
DEAD_AFTER_S = 3.0


def health(address: str, service: str = "") -> str:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def reflected_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        return set(ProtoReflectionDescriptorDatabase(channel).get_services())


def swarm_status(address: str, *flags: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "status", "--coordinator", address, *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_health_and_a_stopped_node_shown_dead_within_the_timeout(tmp_path):
    with processes() as procs:
        address = coordinator(procs, tmp_path, 2000, "--dead-after", str(DEAD_AFTER_S), "--metrics-port", "0")
        http_port = int(procs[0].wait_for(r"metrics=(\d+)", 5).group(1))
        json_logs = node(procs, tmp_path, "node0", address, "--log-format", "json")
        wait_for_nodes(address, 1)
        stopped = node(procs, tmp_path, "node1", address)
        reply = wait_status(address, lambda r: r.steps_completed >= 3, "3 steps", 120)
        # Every gRPC port answers the standard health check while the run trains.
        assert health(address) == health(address, "swarm.v1.Coordinator") == "SERVING"
        for n in reply.nodes:
            assert health(n.address, "swarm.v1.Stage") == "SERVING"
        # ... and describes itself through server reflection.
        assert {"swarm.v1.Coordinator", "grpc.health.v1.Health"} <= reflected_services(address)
        assert "swarm.v1.Stage" in reflected_services(reply.nodes[0].address)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=5) as r:
            assert r.read() == b"ok\n"
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=5) as r:
            doc = json.loads(r.read())
        assert doc["rates"]["tokens_per_second"] > 0 and doc["rates"]["compression_ratio"] > 1
        assert {n["name"]: n["state"] for n in doc["nodes"]} == {"node0": "alive", "node1": "alive"}
        os.kill(stopped.p.pid, signal.SIGSTOP)  # frozen: no heartbeat, no Leave
        t0 = time.monotonic()
        reply = wait_status(
            address, lambda r: not {n.node_name: n for n in r.nodes}["node1"].alive, "node1 dead", 30
        )
        seconds = time.monotonic() - t0
        table = swarm_status(address)
        os.kill(stopped.p.pid, signal.SIGCONT)
    # The reaper runs once a second: silence of DEAD_AFTER_S, then at most ~1 s more.
    assert seconds < DEAD_AFTER_S + 2.5, seconds
    assert re.search(r"\bnode1\s+dead\s", table) and re.search(r"\bnode0\s+alive\s", table), table
    assert not {n.node_name: n for n in reply.nodes}["node1"].left
    # --log-format json: one object per line, each after the join naming the node and its stages.
    lines = [json.loads(line) for line in json_logs.stdout().splitlines()]
    node0 = {n.node_name: n for n in reply.nodes}["node0"].node_id[:8]
    hosting = next(i for i, x in enumerate(lines) if "hosts stages [0]" in x["msg"])
    later = lines[hosting:]
    assert len(later) >= 2 and all(
        (x["node"], x["stages"], x["level"]) == (node0, "0", "info") for x in later
    )
    assert all(isinstance(x["ts"], float) and x["logger"] == "swarm.operator" for x in lines)


def summary(step: int, tokens: int, wire: int, at: float, loss: float = 1.0) -> cpb.StepSummary:
    return cpb.StepSummary(
        step=step,
        loss=loss,
        tokens=tokens,
        bytes_sent_forward=wire,
        bytes_sent_backward=wire,
        completed_at=at,
    )


def test_run_rates_from_step_summaries():
    steps = [summary(0, 100, 400, 10.0), summary(1, 100, 400, 12.0), summary(2, 100, 400, 14.0, 0.5)]
    rates = run_rates(steps, d_model=64, boundaries=2)
    assert rates.steps == 3 and rates.loss == 0.5
    assert rates.tokens_per_second == 200 / 4.0  # the tokens after the first completion, over 4 s
    assert rates.bytes_per_token == 3 * 800 / 300 / 2
    # dense: 300 tokens x 2 boundaries x (2 bytes x 64 forward + the same backward)
    assert rates.compression_ratio == 300 * 2 * 256 / 2400
    assert run_rates([], 64, 2) == cpb.RunRates()


def test_status_document_hides_credentials_and_names_states():
    reply = cpb.StatusReply(
        run_id="run-1",
        nodes=[
            cpb.NodeStatus(node_id="a" * 32, node_name="n0", alive=True, stages=[0], last_stages=[0]),
            cpb.NodeStatus(node_id="b" * 32, node_name="n1", left=True, last_stages=[1]),
            cpb.NodeStatus(node_id="c" * 32, node_name="n2", last_stages=[1]),
        ],
    )
    doc = status_document(reply)
    assert [(n["node"], n["state"]) for n in doc["nodes"]] == [
        ("a" * 8, "alive"),
        ("b" * 8, "left"),
        ("c" * 8, "dead"),
    ]
    text = render(reply, "host:7000") + json.dumps(doc)
    assert not any(c * 9 in text for c in "abc")


def test_status_says_where_snapshot_bytes_live_and_names_lying_holders():
    reply = cpb.StatusReply(
        run_id="run-1",
        snapshot_holding="snapshots are uploaded to the coordinator (--snapshot-keepers 0)",
        bad_holders=["node aaaaaaaa served a bad chunk of snapshot 0123456789ab to bbbbbbbb: hash mismatch"],
    )
    text = render(reply, "host:7000")
    assert "  snapshots are uploaded to the coordinator (--snapshot-keepers 0)" in text
    assert "bad snapshot holder: node aaaaaaaa served a bad chunk" in text
    assert status_document(reply)["bad_holders"] == list(reply.bad_holders)
