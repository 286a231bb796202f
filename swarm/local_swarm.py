"""``swarm up``: a coordinator and N node daemons as separate processes on loopback.

Every process is real (its own interpreter, gRPC server, DHT peer); only the addresses
are local. Progress comes from the coordinator's ``Status`` RPC; each process's output
goes to a log file in the run folder. Ctrl-C (or any failure) stops every process:
SIGTERM first, SIGKILL for those that do not exit within the grace period.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from tqdm import tqdm

from swarm._proto.swarm.v1 import coordinator_pb2, coordinator_pb2_grpc
from swarm.config import RunConfig

LISTENING = re.compile(r"coordinator listening on (\S+)")
GRACE_S = 10.0


@dataclass
class SwarmSummary:
    steps: int
    losses: list[float]
    seconds: float
    tokens: int
    wire_bytes_forward: int
    wire_bytes_backward: int
    boundaries: int
    node_logs: list[Path] = field(default_factory=list)
    step_summaries: list = field(default_factory=list)  # coordinator_pb2.StepSummary per step

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def wire_bytes_per_token(self) -> float:
        """Serialized bytes crossing one boundary per token, forward + backward."""
        total = self.wire_bytes_forward + self.wire_bytes_backward
        return total / max(1, self.boundaries) / max(1, self.tokens)


class ProcessGroup:
    """Child processes that are all stopped together, whatever happens."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], log_path: Path) -> subprocess.Popen:
        log = open(log_path, "w")  # noqa: SIM115 - closed with the process
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        proc.log = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.log.close()  # type: ignore[attr-defined]


def _tee(proc: subprocess.Popen, log_path: Path, lines: list[str]) -> threading.Thread:
    """Copy a child's stdout to its log (and a list, for the caller) on a background thread."""

    def pump() -> None:
        with open(log_path, "w") as log:
            for line in proc.stdout:
                lines.append(line)
                log.write(line)
                log.flush()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def _wait_for_line(lines: list[str], pattern: re.Pattern, proc: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in lines:
            if m := pattern.search(line):
                return m
        if proc.poll() is not None:
            raise RuntimeError(
                f"process exited with code {proc.returncode} before printing {pattern.pattern!r}"
            )
        time.sleep(0.05)
    raise TimeoutError(f"no {pattern.pattern!r} within {timeout}s")


def up(
    config: RunConfig,
    run_dir: str | Path,
    nodes: int | None = None,
    stages_per_node: int = 1,
    link_mbps: float = 0.0,
    link_latency_ms: float = 0.0,
    device: str = "cpu",
    use_dht: bool = True,
    progress: bool = True,
    timeout: float = 3600.0,
) -> SwarmSummary:
    """Run ``config`` on a local swarm; returns when every node has finished (or raises)."""
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    nodes = nodes or -(-config.n_stages // stages_per_node)
    if nodes * stages_per_node < config.n_stages:
        raise ValueError(f"{nodes} nodes x {stages_per_node} stages cannot host {config.n_stages} stages")
    (run / "run.toml").write_text(config.to_toml())
    state_path = run / "coordinator.sqlite"
    state_path.unlink(missing_ok=True)
    token = secrets.token_hex(16)
    group = ProcessGroup()
    py = sys.executable
    try:
        coord_lines: list[str] = []
        coord_args = [py, "-m", "coordinator.cli", "serve", "--config", str(run / "run.toml"), "--port", "0"]
        coord_args += ["--state", str(state_path), "--token", token, "--metrics-port", "-1"]
        coord_args += [] if use_dht else ["--no-dht"]
        coord = group.start(coord_args, run / "coordinator.err")
        _tee(coord, run / "coordinator.log", coord_lines)
        address = _wait_for_line(coord_lines, LISTENING, coord, 60).group(1)
        node_procs, logs = [], []
        for i in range(nodes):
            args = [py, "-m", "node.cli", "join", "--coordinator", address, "--token", token]
            args += [
                "--stages",
                str(stages_per_node),
                "--data-dir",
                str(run / f"node{i}"),
                "--device",
                device,
            ]
            args += [
                "--link-mbps",
                str(link_mbps),
                "--link-latency-ms",
                str(link_latency_ms),
                "--name",
                f"node{i}",
            ]
            args += [] if use_dht else ["--no-dht"]
            proc = group.start(args, run / f"node{i}.err")
            _tee(proc, run / f"node{i}.log", [])
            node_procs.append(proc)
            logs.append(run / f"node{i}.log")
        start = time.monotonic()
        poller = StatusPoller(address)
        try:
            _follow(config, poller, node_procs, progress, timeout)
        finally:
            poller.close()
        seconds = time.monotonic() - start
        failed = [(i, p.returncode) for i, p in enumerate(node_procs) if p.returncode != 0]
        if failed:
            raise RuntimeError(f"nodes failed (index, exit code): {failed}; see the logs in {run}")
        return _summary(config, poller.steps, seconds, logs)
    finally:
        group.stop()


class StatusPoller:
    """Collects the coordinator's per-step summaries as the run progresses."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.steps: list[coordinator_pb2.StepSummary] = []

    def poll(self) -> list[coordinator_pb2.StepSummary]:
        """The steps completed since the last poll."""
        since = self.steps[-1].step + 1 if self.steps else 0
        reply = self.stub.Status(coordinator_pb2.StatusRequest(since_step=since), timeout=10)
        self.steps.extend(reply.steps)
        return list(reply.steps)

    def close(self) -> None:
        self.channel.close()


def _follow(
    config: RunConfig, poller: StatusPoller, procs: list[subprocess.Popen], progress: bool, timeout: float
):
    """Show step, loss, tokens/s and wire bytes/token until every node has exited."""
    bar = tqdm(total=config.train.steps, disable=not progress, desc="swarm", unit="step")
    deadline, t0 = time.monotonic() + timeout, time.monotonic()
    boundaries = max(1, config.n_stages - 1)
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the swarm did not finish within {timeout}s")
            time.sleep(0.5)
            new = poller.poll()
            if new:
                tokens = sum(s.tokens for s in poller.steps)
                wire = sum(s.bytes_sent_forward + s.bytes_sent_backward for s in poller.steps)
                bar.update(len(new))
                bar.set_postfix(
                    loss=f"{new[-1].loss:.3f}",
                    tok_s=f"{tokens / (time.monotonic() - t0):.0f}",
                    B_tok=f"{wire / boundaries / max(1, tokens):.1f}",
                )
        poller.poll()
    finally:
        bar.close()


def _summary(config: RunConfig, steps: list, seconds: float, logs: list[Path]) -> SwarmSummary:
    return SwarmSummary(
        steps=len(steps),
        losses=[s.loss for s in steps],
        seconds=seconds,
        tokens=sum(s.tokens for s in steps),
        wire_bytes_forward=sum(s.bytes_sent_forward for s in steps),
        wire_bytes_backward=sum(s.bytes_sent_backward for s in steps),
        boundaries=config.n_stages - 1,
        node_logs=logs,
        step_summaries=list(steps),
    )
