"""The peer system: the same model and links, trained with ``torch.distributed.pipelining``.

What a user would otherwise pick out of the box: one process per stage,
``PipelineStage`` + ``ScheduleGPipe`` over the gloo backend, fp32 activations and
gradients on the wire, AdamW with the run's learning rate. The stages are the dense
model's (:class:`swarm.core.model.Stage` on :func:`swarm.core.config.stage_layer_ranges`,
``constrain_writes=False``, weights from the run seed); batches are random token ids
(throughput only) of the run's batch size, sequence length and microbatches.

Where :func:`bench.netns.available`, each rank runs in its own namespace behind a
``tc tbf`` access link of the link's rate (the same links the swarm crosses); gloo has
no shaper, so a link's one-way delay is not emulated (no ``netem``). Elsewhere it runs
on unshaped loopback. Each row records which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench.netns import IFNAME, EmulatedNetwork
from bench.throughput import Link
from swarm.core.config import ModelConfig, TrainConfig, stage_layer_ranges
from swarm.core.model import Stage, fixed_embedding
from swarm.launch.local_swarm import WARMUP_STEPS

SYSTEM = "torch.distributed.pipelining (gloo, fp32)"
PORT = 29500  # rendezvous port inside rank 0's namespace
GRACE_S = 5.0


class PipeStage(nn.Module):
    """A :class:`Stage` behind pipelining's one-tensor interface: tokens -> x -> ... -> logits."""

    def __init__(self, stage: Stage):
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stage.is_first:
            return self.stage(x)
        # The dense model's later stages read only the sequence length from the token ids.
        return self.stage(x.new_zeros(x.shape[:2], dtype=torch.long), x)


def build_stage(model: ModelConfig, seed: int, n_stages: int, index: int) -> PipeStage:
    model = dataclasses.replace(model, constrain_writes=False)
    start, end = stage_layer_ranges(model.n_layers, n_stages)[index]
    fixed = fixed_embedding(model.vocab_size, model.d_model, seed)
    return PipeStage(Stage(model, start, end, fixed, None, seed))


def batch(model: ModelConfig, train: TrainConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (inputs, targets) of step ``step``, identical on every rank."""
    gen = torch.Generator().manual_seed(train.seed * 1_000_003 + step)
    ids = torch.randint(0, model.vocab_size, (train.batch_size, train.seq_len + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def worker(spec: dict) -> None:
    """One rank: train ``train.steps`` steps; rank 0 writes its per-step seconds to ``spec["out"]``."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.set_num_threads(spec["threads"])
    model, train = ModelConfig(**spec["model"]), TrainConfig(**spec["train"])
    rank, n = spec["rank"], spec["n_stages"]
    timeout = datetime.timedelta(seconds=spec["timeout"])
    dist.init_process_group("gloo", init_method=spec["init_method"], rank=rank, world_size=n, timeout=timeout)
    try:
        module = build_stage(model, train.seed, n, rank)
        stage = PipelineStage(module, rank, n, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, train.microbatches, loss_fn=_loss)
        opt = torch.optim.AdamW(module.parameters(), lr=train.lr, weight_decay=train.weight_decay)
        seconds = []
        for step in range(train.steps):
            t0 = time.perf_counter()
            inputs, targets = batch(model, train, step)
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(inputs, return_outputs=False)
            elif rank == n - 1:
                schedule.step(target=targets, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
            torch.nn.utils.clip_grad_norm_(module.parameters(), train.grad_clip)
            opt.step()
            seconds.append(time.perf_counter() - t0)
        if rank == 0:
            Path(spec["out"]).write_text(json.dumps({"step_seconds": seconds}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_link(
    model: ModelConfig,
    train: TrainConfig,
    n_stages: int,
    link: Link,
    netns: bool,
    threads: int | None = None,
    timeout: float = 600.0,
) -> dict:
    """The peer on one link: in tbf-limited namespaces if ``netns`` and the link is shaped, else loopback.

    ``threads`` per rank defaults to the rank's share of this machine's CPUs, as if each
    rank had a host of its own: oversubscribed, gloo's ranks slow down several fold.
    """
    threads = threads or max(1, (os.cpu_count() or 1) // n_stages)
    if n_stages < 2:
        raise ValueError("the peer needs at least 2 stages (one process each)")
    if train.steps <= WARMUP_STEPS:
        raise ValueError(f"train.steps={train.steps} leaves no step after {WARMUP_STEPS} warm-up steps")
    shaped = netns and link.mbps > 0
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="swarm-peer-")))
        if shaped:
            net = stack.enter_context(EmulatedNetwork(n_stages, link.mbps))
            prefixes = [net.exec_prefix(r) for r in range(n_stages)]
            init_method, ifname = f"tcp://{net.host_ip(0)}:{PORT}", IFNAME
        else:
            prefixes = [[] for _ in range(n_stages)]
            init_method, ifname = f"tcp://127.0.0.1:{_free_port()}", "lo"
        env = dict(os.environ, GLOO_SOCKET_IFNAME=ifname, PYTHONUNBUFFERED="1")
        spec = {
            "model": dataclasses.asdict(model),
            "train": dataclasses.asdict(train),
            "n_stages": n_stages,
            "init_method": init_method,
            "timeout": timeout,
            "threads": threads,
            "out": str(tmp / "rank0.json"),
        }
        procs: list[subprocess.Popen] = []
        stack.callback(_stop, procs)
        for rank in range(n_stages):
            args = [*prefixes[rank], sys.executable, "-m", "bench.peer", json.dumps(spec | {"rank": rank})]
            log = stack.enter_context(open(tmp / f"rank{rank}.log", "w"))
            procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout
        while not all(p.poll() == 0 for p in procs):
            failed = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                _stop(procs)
                logs = "\n".join((tmp / f"rank{r}.log").read_text()[-1500:] for r in range(n_stages))
                reason = (
                    f"ranks failed (rank, exit code): {failed}" if failed else f"timed out after {timeout}s"
                )
                raise RuntimeError(f"{SYSTEM}: {reason}\n{logs}")
            time.sleep(0.2)
        seconds = json.loads((tmp / "rank0.json").read_text())["step_seconds"][WARMUP_STEPS:]
    row = {
        "system": SYSTEM,
        "link": link.name,
        "tokens_per_s": len(seconds) * train.batch_size * train.seq_len / sum(seconds),
        "shaper": "netns+tbf" if shaped else "none",
        "threads_per_rank": threads,
    }
    if link.mbps and not shaped:
        row["note"] = "unshaped loopback: network namespaces unavailable"
    elif link.one_way_ms:
        row["note"] = "no one-way delay: gloo has no shaper, the kernel no netem"
    return row


def run(
    model: ModelConfig, train: TrainConfig, n_stages: int, links: list[Link], shaper: str = "netns"
) -> list[dict]:
    """The peer on every link; ``shaper="netns"`` uses tbf-limited namespaces where available."""
    netns = shaper == "netns" and EmulatedNetwork.available()[0]
    return [run_link(model, train, n_stages, link, netns) for link in links]


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
