"""Node daemons as real processes on loopback: dial-only nodes, metrics, and stopping by signal."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.core.config import MODEL_PRESETS
from tests.procs import (
    CORPUS,
    Proc,
    coordinator,
    node,
    plan_of,
    processes,
    status,
    tiny_run,
    wait_for_nodes,
    wait_status,
)

# -- a dial-only node --------------------------------------------------------------------------


@dataclasses.dataclass
class DialOnlyRun:
    steps: int
    dial_only: Proc
    reachable: Proc
    nodes: dict[str, coordinator_pb2.NodeStatus]  # by node name, while both were in the run
    plans: dict[str, list[coordinator_pb2.BoundaryLink]]  # by node name, at the same time
    steps_completed: int
    metrics: dict[str, float]  # "name{label=value,...}" -> value, scraped from the reachable node


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture(scope="module")
def dial_only_run(tmp_path_factory) -> Iterator[DialOnlyRun]:
    """Stage 0 on a node with no inbound port, stage 1 on a reachable node serving metrics."""
    folder, steps = tmp_path_factory.mktemp("dial_only"), 3
    with processes() as procs:
        address = coordinator(procs, folder, steps)
        dial_only = node(procs, folder, "dialonly", address, "--listen", "")
        wait_for_nodes(address, 1)
        reachable = node(procs, folder, "reachable", address, "--metrics-port", "0", "--linger-s", "60")
        nodes = {n.node_name: n for n in wait_for_nodes(address, 2).nodes}
        plans = {name: plan_of(address, folder, n.node_id) for name, n in nodes.items()}
        port = int(reachable.wait_for(r"node metrics on 127\.0\.0\.1:(\d+)", 60).group(1))
        reachable.wait_for(r"finished \d+ steps", 60)
        metrics = scrape(port)
        assert dial_only.wait(30) == 0, dial_only.output()
        completed = status(address).steps_completed
        reachable.p.send_signal(signal.SIGTERM)  # ends the linger; the run itself is complete
        assert reachable.wait(15) == 0, reachable.output()
        yield DialOnlyRun(steps, dial_only, reachable, nodes, plans, completed, metrics)


def test_dial_only_node_hosts_a_stage_next_to_a_reachable_one(dial_only_run):
    run, nodes = dial_only_run, dial_only_run.nodes
    assert nodes["dialonly"].address == "" and nodes["reachable"].address.startswith("127.0.0.1:")
    assert list(nodes["dialonly"].stages) == [0] and list(nodes["reachable"].stages) == [1]
    # The plan: the reachable (downstream) side accepts, the dial-only side dials it.
    (dials,), (accepts,) = run.plans["dialonly"], run.plans["reachable"]
    assert (dials.boundary, dials.role, dials.peer_address) == (
        0,
        coordinator_pb2.LINK_ROLE_DIAL,
        nodes["reachable"].address,
    )
    assert (accepts.boundary, accepts.role) == (0, coordinator_pb2.LINK_ROLE_ACCEPT)
    # Both followed it and trained every step.
    dial_only, reachable = run.dial_only.stdout(), run.reachable.stdout()
    assert f"boundary 0: dialled stage 1 at {nodes['reachable'].address}" in dial_only
    assert "boundary 0: accepted stream from stage 0" in reachable
    assert f"finished {run.steps} steps on stages [0]" in dial_only
    assert f"finished {run.steps} steps on stages [1]" in reachable
    assert run.steps_completed == run.steps


def test_node_metrics_endpoint(dial_only_run):
    m, steps = dial_only_run.metrics, dial_only_run.steps
    assert m["swarm_tokens_total{stage=1}"] == steps * 4 * 32
    assert m["swarm_wire_bytes_total{boundary=0,direction=forward,io=received}"] > 0
    assert m["swarm_wire_bytes_total{boundary=0,direction=backward,io=sent}"] > 0
    dense = steps * 4 * 32 * MODEL_PRESETS["tiny"].d_model * 2  # bf16 activations of every token
    assert m["swarm_dense_equivalent_bytes_total{boundary=0,direction=forward,io=received}"] == dense
    assert m["swarm_dense_equivalent_bytes_total{boundary=0,direction=backward,io=sent}"] == dense
    assert m["swarm_step_seconds_count{stage=1}"] == steps
    assert m["swarm_step_seconds_sum{stage=1}"] > 0
    assert m["swarm_step{stage=1}"] == steps - 1
    assert m["swarm_loss{}"] > 0


def test_two_dial_only_nodes_are_never_planned_next_to_each_other(tmp_path):
    """The second dial-only node waits as a standby (``Status`` says what is missing) instead of
    being planned across a boundary neither end can accept; a node with an open port completes it."""
    with processes() as procs:
        address = coordinator(procs, tmp_path, 3)
        first = node(procs, tmp_path, "a", address, "--listen", "")
        wait_for_nodes(address, 1)
        second = node(procs, tmp_path, "b", address, "--listen", "")
        reply = wait_status(address, lambda r: r.plan_problems, "a plan problem", 60)
        assert "a node with an open port is needed" in reply.plan_problems[0]
        assert {n.node_name: list(n.stages) for n in reply.nodes} == {"a": [0], "b": []}
        third = node(procs, tmp_path, "c", address)
        for proc in (first, second, third):
            assert proc.wait(120) == 0, proc.output()
        final = wait_status(address, lambda r: r.run_complete, "the run complete", 10)
        assert not final.plan_problems


# -- stopping by signal ------------------------------------------------------------------------


def test_sigint_stops_a_training_node_and_its_neighbour_waits_for_a_replacement(tmp_path):
    with processes() as procs:
        address = coordinator(procs, tmp_path, 10_000)
        first = node(procs, tmp_path, "first", address)
        wait_for_nodes(address, 1)
        last = node(procs, tmp_path, "last", address)
        last.wait_for(r"step \d+ loss", 60)
        first.p.send_signal(signal.SIGINT)
        assert first.wait(15) == 130, first.output()
        assert "node stopped by signal" in first.stdout()
        # The neighbour learns at once (not after the 300 s step timeout): from the closed stream,
        # or from the plan without the leaver that its held heartbeat brings, whichever comes
        # first; it waits for a replacement instead of dying with the run.
        last.wait_for(r"epoch \d+ failed: boundary 0:|plan epoch \d+ replaces epoch \d+", 15)
        assert last.p.poll() is None
        deadline = time.monotonic() + 10  # its phase arrives with its next heartbeat (about 1 s)
        while True:
            (waiting,) = [n for n in status(address).nodes if n.node_name == "last"]
            if waiting.phase == coordinator_pb2.NODE_PHASE_WAITING or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert waiting.alive and waiting.phase == coordinator_pb2.NODE_PHASE_WAITING, waiting


def live_processes() -> list[tuple[int, str]]:
    """(session id, command line) of every process that is not a zombie."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # it may exit while being read
            stat = (proc / "stat").read_text()
            state, _, _, session = stat[stat.rindex(")") + 2 :].split()[:4]
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if state != "Z":
                found.append((int(session), cmdline))
    return found


def test_swarm_up_stops_every_process_on_sigint(tmp_path):
    run_dir = tmp_path / "up"
    (tmp_path / "corpus.txt").write_text(CORPUS)
    args = [sys.executable, "-m", "swarm.cli", "up", "--preset", "tiny", "--steps", "200", "--stages", "2"]
    args += ["--batch-size", "4", "--seq-len", "32", "--run-dir", str(run_dir)]
    args += ["--corpus", str(tmp_path / "corpus.txt"), "--tokenizer", "byte"]
    up = Proc(args, tmp_path / "up.err", start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not any(re.search(r"step \d+ loss", log.read_text()) for log in run_dir.glob("node*.log")):
            assert up.p.poll() is None, up.output()
            assert time.monotonic() < deadline, up.output()
            time.sleep(0.1)
        up.p.send_signal(signal.SIGINT)
        assert up.wait(20) == 130, up.output()
        assert "stopped: every coordinator and node process was terminated" in up.stdout()
        # Nothing is left: no process naming the run folder, nothing in swarm up's session (p2pd included).
        assert [cmd for _, cmd in live_processes() if str(run_dir) in cmd] == []
        assert [cmd for sid, cmd in live_processes() if sid == up.p.pid] == []
        for i in range(2):
            assert "node stopped by signal" in (run_dir / f"node{i}.log").read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.p.pid, signal.SIGKILL)  # the whole session: swarm up and its children
        up.stop()


def test_join_tokens_stay_off_command_lines_and_out_of_logs(tmp_path):
    """No token given: the coordinator creates one in a 0600 file next to its state (kept across
    restarts) and logs only the path; a node reads it with --token-file; a token on argv works
    but warns; a node with no token at all stops with a clear error."""
    config = tiny_run(tmp_path, 2)
    (tmp_path / "run.toml").write_text(config.to_toml())
    state = tmp_path / "state.sqlite"
    args = [sys.executable, "-m", "swarm.coordinator.cli", "serve", "--config", str(tmp_path / "run.toml")]
    args += ["--port", "0", "--state", str(state), "--no-dht", "--metrics-port", "-1"]
    with processes() as procs:
        procs.append(Proc(args, tmp_path / "coordinator.err", without_token=True))
        address = procs[-1].wait_for(r"coordinator listening on (\S+)", 60).group(1)
        token_file = state.with_name("state.sqlite.token")
        token = token_file.read_text().strip()
        assert len(token) >= 24 and token_file.stat().st_mode & 0o777 == 0o600
        join = [sys.executable, "-m", "swarm.node.cli", "join", "--coordinator", address, "--no-dht"]
        join += ["--device", "cpu", "--connect-timeout", "30"]
        by_file = Proc(
            [*join, "--data-dir", str(tmp_path / "a"), "--token-file", str(token_file)],
            tmp_path / "a.err",
            without_token=True,
        )
        on_argv = Proc(
            [*join, "--data-dir", str(tmp_path / "b"), "--token", token],
            tmp_path / "b.err",
            without_token=True,
        )
        missing = Proc([*join, "--data-dir", str(tmp_path / "c")], tmp_path / "c.err", without_token=True)
        procs += [by_file, on_argv, missing]
        assert missing.wait(30) == 2 and "no join token" in missing.stderr()
        assert by_file.wait(120) == 0, by_file.output()
        assert on_argv.wait(120) == 0, on_argv.output()
        assert "visible to every local user" in on_argv.stderr()
        assert "visible to every local user" not in by_file.stderr()
        logs = procs[0].stdout() + procs[0].stderr() + by_file.output() + on_argv.stdout()
        assert token not in logs and str(token_file) in procs[0].stderr()
