"""Real processes for the multi-process tests: coordinators and nodes on loopback, always stopped."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from swarm.coordinator.sessions import Sessions
from swarm.coordinator.tokens import token_id

from swarm._proto.swarm.v1 import coordinator_pb2, coordinator_pb2_grpc
from swarm.core.config import MODEL_PRESETS, CheckpointConfig, DataConfig, RunConfig, TrainConfig
from swarm.net.credentials import session_metadata

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "node-test-join-token"
CORPUS = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.\n" * 300


class Proc:
    """A child process whose stdout lines are collected on a thread (stderr goes to a file)."""

    def __init__(self, args: list[str], log: Path, without_token: bool = False, **popen: Any):
        self.log = log
        self.lines: list[str] = []
        env = dict(os.environ, PYTHONUNBUFFERED="1", SWARM_TOKEN=TOKEN)  # the join token, off argv
        if without_token:
            del env["SWARM_TOKEN"]
        with open(log, "w") as err:
            self.p = subprocess.Popen(
                args, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env, **popen
            )
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()

    def _collect(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first stdout line matching ``pattern``; fails on timeout or if the process exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exited = self.p.poll() is not None
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if exited:
                pytest.fail(f"exited ({self.p.returncode}) before printing {pattern!r}: {self.output()}")
            time.sleep(0.05)
        pytest.fail(f"no {pattern!r} within {timeout}s: {self.output()}")

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {timeout}s: {self.output()}")

    def stdout(self) -> str:
        """Everything printed so far (all of it, once the process has exited)."""
        self._reader.join(timeout=5 if self.p.poll() is not None else 0)
        return "".join(self.lines)

    def stderr(self) -> str:
        return self.log.read_text()

    def output(self) -> str:
        return self.stdout()[-2000:] + "\nstderr: " + self.stderr()[-3000:]

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    """Every process started into the yielded list is stopped on the way out, whatever happened."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def tiny_run(folder: Path, steps: int, n_stages: int = 2, checkpoint_interval: int = 25) -> RunConfig:
    """A tiny run on a small byte-tokenised corpus (no BPE training, no big corpus)."""
    (folder / "corpus.txt").write_text(CORPUS)
    return RunConfig(
        model=dataclasses.replace(MODEL_PRESETS["tiny"]),
        # lr: the default these multi-process tests' thresholds were set at (the default is 2e-3 since)
        train=TrainConfig(steps=steps, batch_size=4, seq_len=32, microbatches=2, warmup_steps=2, lr=3e-3),
        data=DataConfig(source=str(folder / "corpus.txt"), tokenizer="byte"),
        checkpoint=CheckpointConfig(interval=checkpoint_interval),
        n_stages=n_stages,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def coordinator(
    procs: list[Proc],
    folder: Path,
    config: RunConfig | int,
    *flags: str,
    port: int = 0,
    name: str = "coordinator",
    dht: bool = False,
) -> str:
    """Start a coordinator for ``config`` (or a 2-stage tiny run of that many steps); its address.
    ``dht``: run its hivemind DHT peer (loopback, no NAT port mapping), which replicas need.

    The state file is ``folder/state.sqlite``: a second coordinator on it resumes the run.
    """
    if isinstance(config, int):
        config = tiny_run(folder, config)
    path = folder / "run.toml"
    path.write_text(config.to_toml())
    args = [sys.executable, "-m", "swarm.coordinator.cli", "serve", "--config", str(path)]
    args += ["--port", str(port), "--state", str(folder / "state.sqlite")]
    args += [] if dht else ["--no-dht"]
    args += ["--metrics-port", "-1", *flags]
    procs.append(Proc(args, folder / f"{name}.err"))
    return procs[-1].wait_for(r"coordinator listening on (\S+)", 60).group(1)


def node(
    procs: list[Proc],
    folder: Path,
    name: str,
    address: str,
    *flags: str,
    runner: Sequence[str] = ("swarm.node.cli",),
    dht: bool = False,
) -> Proc:
    """Start ``swarm-node join`` (``runner``: the module and its leading arguments, e.g. a hostile
    node; ``dht``: join the coordinator's DHT, whose P2P replicas average over)."""
    args = [sys.executable, "-m", *runner, "join", "--coordinator", address]
    args += ["--data-dir", str(folder / name), "--device", "cpu", "--name", name]
    args += [] if dht else ["--no-dht"]
    args += ["--connect-timeout", "30", *flags]
    procs.append(Proc(args, folder / f"{name}.err"))
    return procs[-1]


def status(address: str) -> coordinator_pb2.StatusReply:
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        return stub.Status(coordinator_pb2.StatusRequest(), timeout=5)


def plan_of(address: str, folder: Path, node_id: str) -> list[coordinator_pb2.BoundaryLink]:
    """The dial plan the coordinator (state in ``folder``) gives ``node_id``: what its own heartbeat
    returns, asked with the credential the operator can derive from the coordinator's key file."""
    keys = Sessions(folder / "state.sqlite.session-key", revoked=lambda token: False)
    session = keys.issue(node_id, token_id(TOKEN))
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = coordinator_pb2.HeartbeatRequest(node_id=node_id)
        reply = stub.Heartbeat(request, timeout=5, metadata=session_metadata(node_id, session))
        return list(reply.plan.links)


def wait_for_nodes(address: str, count: int, timeout: float = 30) -> coordinator_pb2.StatusReply:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = status(address)
        if len(reply.nodes) >= count:
            return reply
        time.sleep(0.1)
    pytest.fail(f"fewer than {count} nodes joined within {timeout}s")


def wait_status(address: str, done, what: str, timeout: float) -> coordinator_pb2.StatusReply:
    """Poll ``Status`` until ``done(reply)`` (an unreachable coordinator counts as not done yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.RpcError):
            reply = status(address)
            if done(reply):
                return reply
        time.sleep(0.1)
    pytest.fail(f"no {what} within {timeout}s")
