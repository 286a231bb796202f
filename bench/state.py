"""Stage state: the training pause per snapshot, and restoring a stage from 1, 2 and 3 holders.

* **Pause per snapshot.** A stage of the benchmark model trains in a single-process pipeline; a
  snapshot's only blocking part, the copy of its state to host memory
  (:func:`swarm.io.checkpoint.capture`), is timed against the step time. The same copy of
  ``state_bytes`` of tensors says what it costs a large stage.
* **Restore from holders.** ``state_bytes`` of snapshot are held by 1, 2 or 3 holders, each a real
  node's ``Stage`` gRPC snapshot server (:mod:`bench.state_hosts`); the node's fetcher takes the
  chunks from all at once and verifies every one. Where network namespaces work, holders and the
  newcomer are processes on emulated hosts whose access links run at ``holder_mbps`` each way
  (:class:`bench.netns.EmulatedNetwork`: rate limits, no added delay), so the newcomer's downlink
  is the limit and the ideal is ``state_bytes / downlink``; elsewhere the holders run in this
  process on loopback, paced at ``holder_mbps`` in the transport (``--snapshot-mbps``), and the
  ideal is ``state_bytes / (holders x holder rate)``. Reported: seconds, the ratio to the ideal,
  each holder's served bytes, and the bytes that went through the coordinator (none: it keeps
  manifests). Everything shares this machine's cores, so the hashing is in the times.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import netns, state_hosts
from swarm.core.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from swarm.io import checkpoint
from swarm.io.data import BatchSampler, batch_ids, load_dataset
from swarm.runtime.pipeline import LocalPipeline


@dataclasses.dataclass(frozen=True)
class StatePlan:
    model: ModelConfig
    train: TrainConfig
    n_stages: int = 4
    steps: int = 6  # the first is a warm-up, not timed
    state_bytes: int = 1 << 30
    holder_mbps: float = 80.0
    holders: tuple[int, ...] = (1, 2, 3)
    keepers: int = 1  # each cut's copies beside the host (swarm-coordinator --snapshot-keepers)
    emulated: bool | None = None  # holders and newcomer on emulated hosts (None: where netns works)


def run(p: StatePlan) -> dict:
    restore = [_restore(p, n) for n in p.holders]
    return {
        "pause": _pause(p),
        "moments": _moments(p),
        "restore": restore,
        "cut_interval": _cut_interval(p, restore[0]),
    }


def _cut_interval(p: StatePlan, row: dict) -> list[dict]:
    """The shortest cut interval a host sustains when ``p.keepers`` keepers fetch every cut of its
    stage through a cap at a share of its uplink, at the goodput ``row`` (a measured restore) got."""
    goodput = row["state_bytes"] * 8 / row["seconds"] / 1e6  # Mbit/s of snapshot payload
    return [
        {
            "share": share,
            "cap_mbps": share * row["holder_mbps"],
            "keepers": p.keepers,
            "seconds": p.keepers * row["state_bytes"] * 8 / (share * goodput * 1e6),
        }
        for share in (0.1, 0.25, 0.5, 1.0)
    ]


def _config_and_sampler(p: StatePlan) -> tuple[RunConfig, BatchSampler]:
    config = RunConfig(model=p.model, train=p.train, data=DataConfig(tokenizer="byte"), n_stages=p.n_stages)
    t = config.train
    return config, BatchSampler(load_dataset(config).train, t.batch_size, t.seq_len, t.seed)


def _moments(p: StatePlan) -> dict:
    """Snapshot bytes with Adam's moments exact and in 8 bits, and how a pipeline restored from each
    continues: the losses of ``p.steps`` more steps against the uninterrupted run's."""
    config, sampler = _config_and_sampler(p)
    batches = [batch_ids(*sampler.next_batch()) for _ in range(2 * p.steps)]
    original = LocalPipeline(config)
    for step, ids in enumerate(batches[: p.steps]):
        original.train_step(step, ids)
    states = [checkpoint.capture(w, p.steps - 1) for w in original.workers]
    later = list(enumerate(batches[p.steps :], start=p.steps))
    reference = [original.train_step(step, ids).loss for step, ids in later]
    rows = {}
    for moments in ("exact", "int8"):
        blobs = [checkpoint.to_bytes(s, moments) for s in states]
        resumed = LocalPipeline(config)
        for worker, blob in zip(resumed.workers, blobs, strict=True):
            checkpoint.restore(worker, checkpoint.from_bytes(blob))
        losses = [resumed.train_step(step, ids).loss for step, ids in later]
        rows[moments] = {
            "bytes": sum(map(len, blobs)),
            "max_loss_deviation": max(abs(a / b - 1) for a, b in zip(losses, reference, strict=True)),
        }
    return {"steps_after": len(later), **rows}


def _pause(p: StatePlan) -> dict:
    config, sampler = _config_and_sampler(p)
    pipe = LocalPipeline(config)
    steps, pauses = [], []
    for step in range(p.steps):
        start = time.perf_counter()
        pipe.train_step(step, batch_ids(*sampler.next_batch()))
        steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        states = [checkpoint.capture(w, step) for w in pipe.workers]
        pauses.append((time.perf_counter() - start) / len(states))
    state_bytes = len(checkpoint.to_bytes(states[0]))
    step_s, pause_s = _median(steps[1:]), _median(pauses[1:])
    big = {f"t{i}": torch.randn(p.state_bytes // 4 // 16) for i in range(16)}  # 16 tensors, state_bytes
    start = time.perf_counter()
    checkpoint.copied(big)
    big_s = time.perf_counter() - start
    return {
        "stage_state_bytes": state_bytes,
        "step_seconds": step_s,
        "pause_seconds_per_stage": pause_s,
        "pause_share_of_step": pause_s / step_s,
        "copy_bytes": p.state_bytes,
        "copy_seconds": big_s,
        "device": "cpu",
    }


def _moments_lines(m: dict | None) -> list[str]:
    if not m:
        return []
    exact, packed = m["exact"], m["int8"]
    return [
        f'Adam\'s moments in 8 bits for transfer (`checkpoint.moments = "int8"`): the snapshots of '
        f"every stage take {packed['bytes'] / 1e6:.1f} MB against {exact['bytes'] / 1e6:.1f} MB exact "
        f"({packed['bytes'] / exact['bytes']:.2f}x); over {m['steps_after']} steps after a restore the "
        f"loss stays within {100 * packed['max_loss_deviation']:.3f}% of the uninterrupted run's "
        f"(exact: {100 * exact['max_loss_deviation']:.3f}%, bit for bit). Weights are never compacted: "
        "fp32 masters cannot be rebuilt from bf16 weights losslessly.",
        "",
    ]


def _interval_lines(rows: list[dict] | None, measured: dict) -> list[str]:
    if not rows:
        return []
    return [
        f"Cut interval a host sustains: every cut of its {measured['state_bytes'] / 1e6:.0f} MB stage goes "
        f"to {rows[0]['keepers']} keeper(s) through a cap at a share of its {measured['holder_mbps']:g} "
        f"Mbit/s uplink, at the goodput of the {measured['holders']}-holder restore above "
        f"({measured['links']}); a shorter interval skips cuts (the newest replaces a waiting one).",
        "",
        "| cap (share of uplink) | cap | shortest cut interval |",
        "|---|---|---|",
        *(f"| {100 * x['share']:.0f}% | {x['cap_mbps']:g} Mbit/s | {x['seconds']:.0f} s |" for x in rows),
        "",
    ]


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _restore(p: StatePlan, holders: int) -> dict:
    data = os.urandom(p.state_bytes)
    emulated = p.emulated if p.emulated is not None else netns.available()[0]
    with tempfile.TemporaryDirectory(prefix="swarm-state-") as tmp:
        run = _emulated if emulated else _loopback
        seconds, coordinator_bytes, served = run(p, holders, data, Path(tmp))
    # On emulated hosts the newcomer's downlink (as fast as each holder's uplink) is the limit;
    # on loopback only the holders' paced uplinks are.
    rate = p.holder_mbps * (1 if emulated else holders)
    ideal = p.state_bytes * 8 / (rate * 1e6)
    return {
        "holders": holders,
        "links": "emulated" if emulated else "loopback",
        "state_bytes": p.state_bytes,
        "holder_mbps": p.holder_mbps,
        "newcomer_mbps": p.holder_mbps if emulated else None,
        "seconds": seconds,
        "ideal_seconds": ideal,
        "ratio_to_ideal": seconds / ideal,
        "served_bytes": served,  # per holder
        "coordinator_bytes": coordinator_bytes,
    }


def _loopback(p: StatePlan, holders: int, data: bytes, folder: Path) -> tuple[float, float, list[int]]:
    """Holders as gRPC servers in this process, each paced at ``holder_mbps``."""

    async def go() -> tuple[float, float, list[int]]:
        async with contextlib.AsyncExitStack() as stack:
            served = [
                await stack.enter_async_context(state_hosts.holder(folder, f"holder{i}", data, p.holder_mbps))
                for i in range(holders)
            ]
            named = [state_hosts.holder_record(i, f"127.0.0.1:{port}") for i, (port, _) in enumerate(served)]
            restored, seconds, coordinator_bytes = await state_hosts.fetch(
                state_hosts.checkpoint_ref(data, named), folder / "newcomer"
            )
            if restored != data:
                raise RuntimeError("the restored snapshot differs from the one held")
            return seconds, coordinator_bytes, [state_hosts.served_bytes(m) for _, m in served]

    return asyncio.run(go())


def _emulated(p: StatePlan, holders: int, data: bytes, folder: Path) -> tuple[float, float, list[int]]:
    """Holders and the newcomer as processes on emulated hosts, every access link ``holder_mbps``
    each way (network namespaces; the links pace, the servers do not)."""
    (folder / "snapshot").write_bytes(data)
    module = [sys.executable, "-m", "bench.state_hosts"]
    with (
        netns.EmulatedNetwork(holders + 1, p.holder_mbps, prefix="swsst") as net,
        contextlib.ExitStack() as stack,
    ):
        procs = []
        for i in range(holders):
            args = [
                "serve",
                "--data",
                str(folder / "snapshot"),
                "--folder",
                str(folder),
                "--name",
                f"holder{i}",
            ]
            proc = subprocess.Popen(
                [*net.exec_prefix(i), *module, *args, "--bind", net.host_ip(i)],
                stdout=subprocess.PIPE,
                text=True,
            )
            stack.callback(_stop, proc)
            procs.append(proc)
        named = [
            state_hosts.holder_record(i, f"{net.host_ip(i)}:{_ready_port(proc)}")
            for i, proc in enumerate(procs)
        ]
        (folder / "ref").write_bytes(state_hosts.checkpoint_ref(data, named).SerializeToString())
        fetch = [*net.exec_prefix(holders), *module, "fetch", "--ref", str(folder / "ref")]
        done = subprocess.run(
            [*fetch, "--folder", str(folder / "newcomer")],
            capture_output=True,
            text=True,
            timeout=60 + 4 * p.state_bytes * 8 / (p.holder_mbps * 1e6),
        )
        if done.returncode:
            raise RuntimeError(f"the newcomer's fetch failed: {done.stderr.strip()[-2000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if not result["verified"] or result["bytes"] != len(data):
            raise RuntimeError("the restored snapshot differs from the one held")
        served = [_stop(proc) for proc in procs]
    return result["seconds"], result["coordinator_bytes"], served


def _ready_port(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """The port a ``state_hosts serve`` process announced (it exits or stays silent: RuntimeError)."""
    line = _line(proc, timeout)
    if not line.startswith("READY "):
        raise RuntimeError(f"a snapshot holder did not start: {line!r}")
    return int(line.split()[1])


def _stop(proc: subprocess.Popen) -> int:
    """SIGTERM a holder; the bytes it says it served (0 if it had already gone)."""
    if proc.poll() is not None:
        return 0
    proc.terminate()
    line = _line(proc, 30.0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    return int(line.split()[1]) if line.startswith("SERVED ") else 0


def _line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line ``proc`` prints within ``timeout`` seconds ("" if none)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if ready else ""


def section(r: dict) -> list[str]:
    """The report's Markdown for :func:`run`'s result ``r``."""
    pause = r["pause"]
    lines = [
        "## Stage state: pause per snapshot, restore from holders",
        "",
        f"Pause per snapshot (the copy of a stage's state to host memory, {pause['device']}): "
        f"{pause['pause_seconds_per_stage'] * 1000:.2f} ms per stage of "
        f"{pause['stage_state_bytes'] / 1e6:.1f} MB against a {pause['step_seconds'] * 1000:.0f} ms step "
        f"({100 * pause['pause_share_of_step']:.2f}% of a step); copying "
        f"{pause['copy_bytes'] / 1e9:.2f} GB of tensors took {pause['copy_seconds']:.2f} s. Memory: one "
        "copy of the stage's state in host memory per cut in flight, plus its serialisation while "
        "it is saved.",
        "",
        *_moments_lines(r.get("moments")),
        "| holders | links | state | uplink per holder | newcomer's downlink | restore (s) | ideal (s) "
        "| ratio | served per holder (MB) | through the coordinator |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["restore"]:
        down = f"{row['newcomer_mbps']:g} Mbit/s" if row.get("newcomer_mbps") else "unlimited"
        lines.append(
            f"| {row['holders']} | {row.get('links', 'loopback')} | {row['state_bytes'] / 1e6:.0f} MB | "
            f"{row['holder_mbps']:g} Mbit/s | {down} | {row['seconds']:.1f} | {row['ideal_seconds']:.1f} | "
            f"{row['ratio_to_ideal']:.2f} | {', '.join(f'{b / 1e6:.0f}' for b in row['served_bytes'])} | "
            f"{row['coordinator_bytes']:.0f} bytes |"
        )
    lines += [
        "",
        "Emulated links: every host (holders, newcomer) in its own network namespace behind a "
        "full-duplex access link at the holders' rate (a token bucket; the kernel here has no netem, "
        "so no added RTT): the newcomer's downlink is the limit and the ideal is the state over it "
        "(the goal: within 1.2x with 2+ holders). Loopback: holders paced at their uplink in the "
        "transport, the newcomer's downlink unlimited, the ideal the holders' summed uplink.",
        "",
        *_interval_lines(r.get("cut_interval"), r["restore"][0]),
    ]
    return lines
