"""A live swarm for the verification bench: one coordinator and nodes joined one after another on
this machine (loopback, hivemind without NAT port mapping), one of them optionally lying (the hidden
``swarm-node join --fault``), run to completion; what the coordinator's status says at the end."""

from __future__ import annotations

import contextlib
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from swarm.coordinator.cli import serve_command
from swarm.node.cli import join_command

from swarm._proto.swarm.v1 import coordinator_pb2
from swarm.core.config import RunConfig
from swarm.launch.local_swarm import (
    LISTENING,
    ProcessGroup,
    StatusPoller,
    steady_tokens_per_second,
    tee,
    wait_for_line,
)

POLL_S = 0.2


@dataclass
class LiveRun:
    """The end of one live run: its status, the liar's node id ("" without one), the seconds it took."""

    status: coordinator_pb2.StatusReply
    liar: str
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Tokens over the summed durations of the steps past the warm-up (start-up)."""
        return steady_tokens_per_second(self.status.steps)

    @property
    def evictions(self) -> int:
        """Evictions the coordinator's audit lines record (of anyone)."""
        return sum("evicted" in line for line in self.status.audit_lines)

    @property
    def liar_evicted(self) -> bool:
        """Whether the coordinator's audit lines record the liar's eviction."""
        return bool(self.liar) and any(
            f"node {self.liar[:8]} " in line and "evicted" in line for line in self.status.audit_lines
        )


def _wait(poller: StatusPoller, done, what: str, timeout: float) -> coordinator_pb2.StatusReply:
    """Poll the coordinator's status until ``done(reply)`` (unreachable: not done yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.RpcError):
            poller.poll()
        if poller.reply is not None and done(poller.reply):
            return poller.reply
        time.sleep(POLL_S)
    raise TimeoutError(f"no {what} within {timeout:.0f}s")


def run_live(
    config: RunConfig, folder: Path, nodes: int, liar: int = -1, fault: str = "sign", timeout: float = 900
) -> LiveRun:
    """Run ``config`` with ``nodes`` nodes joined in order (node ``liar`` lies with ``fault``; -1: none)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.toml").write_text(config.to_toml())
    env = {"SWARM_TOKEN": secrets.token_hex(16)}
    group = ProcessGroup()
    started = time.monotonic()
    try:
        args = serve_command(
            config=folder / "run.toml", port=0, state=folder / "state.sqlite", metrics_port=-1
        )
        proc = group.start(
            [sys.executable, "-m", "swarm.coordinator.cli", *args], folder / "coordinator.err", env=env
        )
        lines: list[str] = []
        tee(proc, folder / "coordinator.log", lines)
        address = wait_for_line(lines, LISTENING, proc, 60).group(1)
        poller = StatusPoller(address)
        for i in range(nodes):
            name = f"node{i}"
            join = join_command(address, data_dir=folder / name, device="cpu", name=name, metrics_port=-1)
            join += ["--fault", fault] if i == liar else []
            node = group.start(
                [sys.executable, "-m", "swarm.node.cli", *join], folder / f"{name}.err", env=env
            )
            tee(node, folder / f"{name}.log", [])
            _wait(poller, lambda r, n=i + 1: len(r.nodes) >= n, f"{i + 1} nodes joined", 60)
        final = _wait(poller, lambda r: r.run_complete, "completed run", timeout)
        poller.close()
    finally:
        group.stop()
    liar_id = next((n.node_id for n in final.nodes if n.node_name == f"node{liar}"), "")
    return LiveRun(final, liar_id, time.monotonic() - started)
