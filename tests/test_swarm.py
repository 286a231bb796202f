"""Real local swarms: a coordinator and node daemons as separate processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from swarm.core.config import MODEL_PRESETS, CodecConfig, RotationConfig, RunConfig, TrainConfig
from swarm.io import model_io
from swarm.io.artifacts import ArtifactCache
from swarm.io.data import BatchSampler, batch_ids, load_dataset
from swarm.launch import local_swarm
from swarm.launch.local_swarm import up
from swarm.runtime.pipeline import LocalPipeline

FRAMING_BYTES_PER_FRAME = 64


def swarm_config(n_stages: int = 3, steps: int = 20, rotation: RotationConfig | None = None) -> RunConfig:
    return RunConfig(
        model=dataclasses.replace(MODEL_PRESETS["tiny"]),
        codec=CodecConfig(kind="subspace", forward_format="bf16", backward_format="bf16"),
        rotation=rotation or RotationConfig(),
        train=TrainConfig(steps=steps, batch_size=4, seq_len=32, microbatches=2, lr=1e-2, warmup_steps=5),
        n_stages=n_stages,
    )


def reference_run(
    config: RunConfig, cache: Path, device: str = "cpu"
) -> tuple[list[float], list[list[int]], list[list[int]]]:
    """Per-step losses and codec-accounted bytes of the single-process pipeline on the same batches."""
    t = config.train
    sampler = BatchSampler(load_dataset(config, cache).train, t.batch_size, t.seq_len, t.seed)
    pipe = LocalPipeline(config, device=device)
    results = [pipe.train_step(step, batch_ids(*sampler.next_batch())) for step in range(t.steps)]
    return [r.loss for r in results], [r.bytes_forward for r in results], [r.bytes_backward for r in results]


def log_text(run: Path, node: int) -> str:
    return (run / f"node{node}.log").read_text()


@pytest.fixture(scope="module")
def three_stage_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("swarm3")
    config = swarm_config()
    summary = up(config, run, nodes=3, progress=False, timeout=600)
    return config, run, summary


def test_three_stage_swarm_matches_single_process_reference(three_stage_run, tmp_path):
    config, _, summary = three_stage_run
    ref_losses, ref_fwd, ref_bwd = reference_run(config, tmp_path / "cache")
    assert summary.steps == config.train.steps
    rel = [abs(a - b) / abs(b) for a, b in zip(summary.losses, ref_losses, strict=True)]
    assert max(rel) < 1e-4, rel
    # Wire bytes: the codec's accounting plus protobuf framing, per frame.
    frames = config.train.steps * config.train.microbatches * (config.n_stages - 1)
    codec_fwd, codec_bwd = sum(map(sum, ref_fwd)), sum(map(sum, ref_bwd))
    assert 0 < summary.wire_bytes_forward - codec_fwd <= FRAMING_BYTES_PER_FRAME * frames
    assert 0 < summary.wire_bytes_backward - codec_bwd <= FRAMING_BYTES_PER_FRAME * frames


def test_each_node_fetched_the_embedding_once(three_stage_run):
    _, run, _ = three_stage_run
    for node in range(3):
        text = log_text(run, node)
        assert text.count("fetched") == 1 and "cache hit" not in text


def test_the_coordinator_exports_the_model_a_local_run_would_train(three_stage_run, tmp_path):
    """The final cut becomes STATE.model/ by itself; ``swarm-coordinator export`` writes the same."""
    config, run, _ = three_stage_run
    auto = model_io.load(run / "coordinator.sqlite.model")
    assert auto.step == config.train.steps - 1 and auto.config == config
    cli = [
        sys.executable,
        "-m",
        "swarm.coordinator.cli",
        "export",
        "--state",
        str(run / "coordinator.sqlite"),
    ]
    done = subprocess.run(
        [*cli, "--out", str(tmp_path / "model")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    on_demand = model_io.load(tmp_path / "model")
    assert on_demand.tensors.keys() == auto.tensors.keys()
    assert all(torch.equal(on_demand.tensors[k], auto.tensors[k]) for k in auto.tensors)
    # The same weights as the single-process pipeline trained on the same batches.
    t = config.train
    sampler = BatchSampler(load_dataset(config, tmp_path / "cache").train, t.batch_size, t.seq_len, t.seed)
    pipe = LocalPipeline(config)
    for step in range(t.steps):
        pipe.train_step(step, batch_ids(*sampler.next_batch()))
    local = model_io.from_workers(pipe.workers, t.steps - 1)
    assert local.tensors.keys() == auto.tensors.keys()
    worst = max((local.tensors[k] - auto.tensors[k]).abs().max().item() for k in auto.tensors)
    assert worst < 1e-5, worst


def test_restart_reuses_cache_corruption_refetches_two_stages_on_one_node(three_stage_run):
    config, run, _ = three_stage_run
    caches = [ArtifactCache(run / f"node{i}" / "artifacts") for i in range(2)]
    (cached,) = list(caches[1].root.glob("*.bin"))
    cached.write_bytes(b"corrupt" + cached.read_bytes()[7:])
    again = up(
        dataclasses.replace(config, train=dataclasses.replace(config.train, steps=3)),
        run,
        nodes=2,
        stages_per_node=2,
        progress=False,
        timeout=600,
    )
    assert again.steps == 3
    assert "cache hit" in log_text(run, 0) and "fetched" not in log_text(run, 0)
    node1 = log_text(run, 1)
    assert "failed its hash check" in node1 and "fetched" in node1
    assert any("hosts stages [0, 1]" in log_text(run, i) for i in range(2))


def test_rotation_and_rank_growth_are_applied_at_their_step_on_every_stage(tmp_path):
    """Over mutual TLS (``swarm up --tls``): the same losses as one process, with the rank growing
    from 16 to 20 at step 5 (boundaries then send 20 coordinates) and a Grassmann turn at step 10."""
    config = swarm_config(
        steps=12, rotation=RotationConfig(interval=5, max_angle=0.1, grow_by=4, max_rank=20)
    )
    summary = up(config, tmp_path / "run", nodes=3, progress=False, timeout=600, tls=True)
    assert "gRPC over mutual TLS" in (tmp_path / "run" / "coordinator.err").read_text()
    ref_losses, _, _ = reference_run(config, tmp_path / "cache")
    rel = [abs(a - b) / abs(b) for a, b in zip(summary.losses, ref_losses, strict=True)]
    assert max(rel) < 1e-4, rel
    for node in range(3):
        text = log_text(tmp_path / "run", node)
        assert "rotation to subspace version 1 at step 5 (rank 20)" in text
        assert "rotation to subspace version 2 at step 10 (rank 20)" in text


def test_swarm_up_command_runs_to_completion(tmp_path):
    args = [sys.executable, "-m", "swarm.cli", "up", "--preset", "tiny", "--steps", "3", "--stages", "2"]
    args += ["--batch-size", "4", "--seq-len", "32", "--run-dir", str(tmp_path / "up")]
    base = free_port_range(3)
    done = subprocess.run(
        [*args, "--metrics-base-port", str(base)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "3 steps" in done.stdout and "wire bytes/token" in done.stdout
    # Every process's endpoint is printed, and each served there.
    assert f"metrics: coordinator http://127.0.0.1:{base}/metrics" in done.stdout
    for i in range(2):
        assert f"metrics: node{i} http://127.0.0.1:{base + 1 + i}/metrics" in done.stdout
        assert f"node metrics on 127.0.0.1:{base + 1 + i}" in (tmp_path / "up" / f"node{i}.log").read_text()
    coordinator_log = (tmp_path / "up" / "coordinator.log").read_text()
    assert f"metrics={base} " in coordinator_log
    # The coordinator's address and the commands that watch the run and sample the trained model.
    address = re.search(r"listening on (127\.0\.0\.1:\d+)", coordinator_log).group(1)
    assert f"watch the run: swarm status --coordinator {address} --watch 2" in done.stdout
    model = tmp_path / "up" / "coordinator.sqlite.model"
    assert f"trained model: {model}" in done.stdout
    sample = re.search(r"sample from it: swarm (generate .*)", done.stdout).group(1)
    generated = subprocess.run(
        [sys.executable, "-m", "swarm.cli", *shlex.split(sample), "--max-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert generated.returncode == 0 and generated.stdout.startswith("ROMEO:"), generated.stderr[-2000:]


def processes_mentioning(text: str) -> list[int]:
    """Pids of the live processes whose command line contains ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return pids


def test_swarm_up_stopped_by_sigterm_leaves_no_process_behind(tmp_path):
    """``kill PID`` of ``swarm up`` (as a service manager stops it) stops its coordinator and nodes too."""
    run_dir = tmp_path / "terminated"
    args = [sys.executable, "-m", "swarm.cli", "up", "--preset", "tiny", "--steps", "100000", "--stages", "2"]
    args += ["--batch-size", "4", "--seq-len", "32", "--no-dht", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:  # bounded by the test's timeout
            if "watch the run" in line:
                break
        assert processes_mentioning(str(run_dir)), "the nodes were not started"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert processes_mentioning(str(run_dir)) == []
    finally:
        proc.kill()
        for pid in processes_mentioning(str(run_dir)):
            os.kill(pid, signal.SIGKILL)


def free_port_range(n: int) -> int:
    """A base port with the ``n`` ports from it free now (a random base, checked by binding)."""
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(20000, 60000)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + n):
                    stack.enter_context(socket.create_server(("127.0.0.1", port)))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports")


class CompletedRun:
    """What the coordinator's status says once the run is complete and every node said Leave."""

    def __init__(self):
        self.run_complete, self.steps = True, []
        self.nodes = [dataclasses.make_dataclass("Node", [("left", bool), ("alive", bool)])(True, False)]

    def poll(self) -> list:
        return []


def test_a_node_that_said_leave_but_keeps_running_is_stopped_and_not_timed(monkeypatch, capsys):
    """``swarm up``'s follower: once the run is complete and every node said Leave, a node process
    still running after the grace is stopped with a warning, and the run's end is when that state
    was first seen, not when the straggler was stopped."""
    monkeypatch.setattr(local_swarm, "EXIT_GRACE_S", 1.0)
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait(timeout=30)
    straggler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        start = time.monotonic()
        end = local_swarm._follow(RunConfig(), CompletedRun(), [exited, straggler], False, timeout=60)
        assert straggler.wait(timeout=15) != 0  # terminated
        assert start <= end < start + 0.9 and time.monotonic() >= end + 1.0  # stopped after the grace
        assert "node1 said Leave but did not exit" in capsys.readouterr().out
    finally:
        straggler.kill()
        straggler.wait(timeout=15)
