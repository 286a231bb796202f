"""Relays: what a relayed link costs in throughput, and what relaying costs the relay host.

Two measurements, side by side in one run:

* **Tokens/s, direct vs relayed.** The same 2-stage local swarm at an emulated link rate
  (shaped in the nodes' transport) twice: stage 1 accepting the stream directly, then both
  nodes dial-only so their link runs through the coordinator's relay (``swarm up --dial-only 2
  --relay``). The relay runs on loopback here (this machine has no separate relay host), so the
  ratio shows the relay's own overhead: a byte copy and one more TCP hop, not a second WAN path.
* **The relay's CPU per GB.** A ``swarm-coordinator relay`` process carries ``megabytes``
  through one spliced pair on loopback; its CPU time (user + system, from ``/proc``) per GB
  relayed and the rate it reached.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from swarm.core.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from swarm.launch.local_swarm import up
from swarm.net.relay import GO, ROLE_ACCEPT, ROLE_DIAL, header

CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class RelayPlan:
    model: ModelConfig
    train: TrainConfig
    mbps: float = 80.0
    one_way_ms: float = 25.0
    megabytes: int = 512


def run(p: RelayPlan) -> dict:
    return {"swarm": _swarm_rows(p), "cpu": _relay_cpu(p.megabytes)}


def _swarm_rows(p: RelayPlan) -> list[dict]:
    config = RunConfig(model=p.model, train=p.train, data=DataConfig(tokenizer="byte"), n_stages=2)
    rows = []
    for relayed in (False, True):
        with tempfile.TemporaryDirectory(prefix="swarm-relay-") as tmp:
            s = up(
                config,
                Path(tmp) / "run",
                link_mbps=p.mbps,
                link_latency_ms=p.one_way_ms,
                progress=False,
                timeout=1800,
                use_dht=False,
                dial_only=2 if relayed else 0,
                relay=relayed,
            )
            relayed_lines = [
                line
                for log in s.node_logs
                for line in log.read_text().splitlines()
                if "through relay" in line
            ]
        if relayed and not relayed_lines:
            raise RuntimeError("the relayed run's link did not go through the relay")
        rows.append(
            {
                "link": f"{p.mbps:g} Mbit/s, {2 * p.one_way_ms:g} ms RTT",
                "path": "through the coordinator's relay" if relayed else "direct",
                "steps": s.steps,
                "tokens_per_s": s.tokens_per_second,
                "step_seconds": [x.wall_seconds for x in s.steady_steps],
                "losses": s.losses,
            }
        )
    direct, relayed_row = rows
    relayed_row["ratio_to_direct"] = relayed_row["tokens_per_s"] / direct["tokens_per_s"]
    relayed_row["losses_equal_direct"] = relayed_row.pop("losses") == direct.pop("losses")
    return rows


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _relay_cpu(megabytes: int) -> dict:
    """Carry ``megabytes`` through a relay process; its CPU seconds per GB and the rate."""
    args = [sys.executable, "-m", "swarm.coordinator.cli", "relay", "--port", "0"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        port = int(re.search(r"relay listening on \S+:(\d+)", line).group(1))
        before = _cpu_seconds(proc.pid)
        seconds = asyncio.run(_carry(port, megabytes))
        cpu = _cpu_seconds(proc.pid) - before
    finally:
        proc.terminate()
        proc.wait(10)
    return {
        "megabytes": megabytes,
        "seconds": seconds,
        "megabytes_per_s": megabytes / seconds,
        "relay_cpu_seconds": cpu,
        "relay_cpu_seconds_per_gb": cpu / (megabytes / 1024),
    }


async def _carry(port: int, megabytes: int) -> float:
    """Send ``megabytes`` from a dialler to a parked acceptor through the relay at ``port``."""
    key = os.urandom(32)
    a_reader, a_writer = await asyncio.open_connection("127.0.0.1", port)
    a_writer.write(header(ROLE_ACCEPT, key))
    await asyncio.sleep(0.1)  # parked before the dialler arrives
    _, d_writer = await asyncio.open_connection("127.0.0.1", port)
    d_writer.write(header(ROLE_DIAL, key))
    if await a_reader.readexactly(1) != GO:
        raise RuntimeError("the relay did not pair the two ends")
    block = os.urandom(CHUNK)
    start = time.perf_counter()

    async def send() -> None:
        for _ in range(megabytes):
            d_writer.write(block)
            await d_writer.drain()
        d_writer.write_eof()

    async def receive() -> int:
        got = 0
        while data := await a_reader.read(CHUNK):
            got += len(data)
        return got

    _, got = await asyncio.gather(send(), receive())
    seconds = time.perf_counter() - start
    for writer in (a_writer, d_writer):
        writer.close()
    if got != megabytes * CHUNK:
        raise RuntimeError(f"the relay delivered {got} of {megabytes * CHUNK} bytes")
    return seconds
