"""Generation through a swarm on emulated links: subspace coordinates against dense activations.

Three hosts (network namespaces, each behind a tbf access link of the given rate) each
run ``swarm-node serve`` for one stage of the same model; the client runs on the
control host (unshaped) and routes every token through the three servers, relaying each
boundary's frame. The same servers, once with ``--boundary subspace`` and once with
``--boundary dense`` (bf16 frames both), generate the same number of tokens after the
same prompt. Reported: decode tokens/s, prompt (prefill) seconds, and serialized frame
bytes per generated token per boundary. The model is the run's initialisation (weights
do not change the cost of a token).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.netns import EmulatedNetwork
from swarm.core.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from swarm.io import model_io
from swarm.launch.local_swarm import ProcessGroup, tee, wait_for_line
from swarm.runtime.pipeline import LocalPipeline
from swarm.serve.generate import Sampling, sample
from swarm.serve.inference import ClientHead
from swarm.serve.remote_generate import SwarmGenerator, parse_servers

PORT = 7200
BOUNDARIES = ("dense", "subspace")
SERVING = re.compile(r"serving stage \d .* on (\S+)")


@dataclasses.dataclass(frozen=True)
class GenerationPlan:
    model: ModelConfig
    links_mbps: tuple[float, ...] = (10.0,)
    prompt_tokens: int = 32
    new_tokens: int = 32
    n_stages: int = 3
    repeats: int = 3  # client runs per boundary kind, alternating; the median is reported


def model_folder(plan: GenerationPlan, folder: Path) -> Path:
    train = TrainConfig(seq_len=plan.model.max_seq_len)  # unused: the model is only initialised and saved
    config = RunConfig(
        model=plan.model, train=train, data=DataConfig(tokenizer="byte"), n_stages=plan.n_stages
    )
    model_io.save(model_io.from_workers(LocalPipeline(config).workers, 0), folder / "model")
    return folder / "model"


def run(plan: GenerationPlan) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="swarm-generation-") as tmp:
        model = model_folder(plan, Path(tmp))
        for mbps in plan.links_mbps:
            rows += _measure_link(plan, model, mbps, Path(tmp))
    for row in rows:
        dense = next(r for r in rows if r["link_mbps"] == row["link_mbps"] and r["boundary"] == "dense")
        row["speedup_vs_dense"] = row["tokens_per_s"] / dense["tokens_per_s"]
    return rows


def _measure_link(plan: GenerationPlan, model: Path, mbps: float, folder: Path) -> list[dict]:
    """Dense and subspace servers side by side on the same hosts; client runs alternate between them
    (``plan.repeats`` each) and each row reports the median run."""
    group = ProcessGroup()
    with EmulatedNetwork(plan.n_stages, mbps, prefix="swsgen", control=True) as net:
        try:
            specs: dict[str, list[str]] = {}
            for port, boundary in enumerate(BOUNDARIES, start=PORT):
                specs[boundary] = [
                    f"{stage}={_serve(group, net, model, stage, port, boundary, folder)}"
                    for stage in range(plan.n_stages)
                ]
            runs: dict[str, list[dict]] = {b: [] for b in BOUNDARIES}
            for _ in range(plan.repeats):
                for boundary in BOUNDARIES:
                    client = [
                        *net.control_prefix,
                        sys.executable,
                        "-m",
                        "bench.generation",
                        "client",
                        str(model),
                        boundary,
                    ]
                    client += [str(plan.prompt_tokens), str(plan.new_tokens), *specs[boundary]]
                    done = subprocess.run(client, capture_output=True, text=True, timeout=600)
                    if done.returncode:
                        raise RuntimeError(f"generation client failed: {done.stderr[-2000:]}")
                    runs[boundary].append(json.loads(done.stdout))
        finally:
            group.stop()
    rows = []
    for boundary, results in runs.items():
        median = sorted(results, key=lambda r: r["tokens_per_s"])[len(results) // 2]
        rows.append({"link_mbps": mbps, "boundary": boundary, "runs": len(results), **median})
    return rows


def _serve(
    group: ProcessGroup, net: EmulatedNetwork, model: Path, stage: int, port: int, boundary: str, folder: Path
) -> str:
    """Start ``swarm-node serve`` for ``stage`` on its host; its address once it serves."""
    argv = [*net.exec_prefix(stage), sys.executable, "-m", "swarm.node.cli", "serve", "--model", str(model)]
    argv += ["--stage", str(stage), "--listen", f"{net.host_ip(stage)}:{port}"]
    argv += ["--boundary", boundary, "--format", "bf16", "--device", "cpu", "--insecure"]  # emulated hosts
    name = f"serve-{boundary}-{stage}"
    proc = group.start(argv, folder / f"{name}.err")
    lines: list[str] = []
    tee(proc, folder / f"{name}.log", lines)
    return wait_for_line(lines, SERVING, proc, 120).group(1)


def client(model: str, boundary: str, prompt_tokens: int, new_tokens: int, servers: list[str]) -> dict:
    """Run on the control host: one generation through ``servers``; its measurements as JSON."""
    trained = model_io.load(model)
    by_stage, head = parse_servers(servers), ClientHead(trained, boundary, "bf16")
    context = trained.config.model.max_seq_len
    prompt = (list(b"To be, or not to be, that is the question: ") * 8)[:prompt_tokens]
    warm = SwarmGenerator(by_stage, head)  # first-call costs on every server, not measured
    try:
        sample(prompt[:4], Sampling(max_new_tokens=2, temperature=0), context, warm.logits_after)
    finally:
        warm.close()
    swarm, prefill = SwarmGenerator(by_stage, head), []

    def logits_after(new_ids: list[int]):
        start = time.perf_counter()
        logits = swarm.logits_after(new_ids)
        if not prefill:
            prefill.append(time.perf_counter() - start)
        return logits

    try:
        sample(prompt, Sampling(max_new_tokens=new_tokens + 1, temperature=0), context, logits_after)
    finally:
        swarm.close()
    stats = swarm.stats
    return {
        "tokens": stats.decode_steps,
        "tokens_per_s": stats.tokens_per_second,
        "prefill_s": prefill[0],
        "bytes_per_token": sum(stats.bytes_per_token) / len(stats.bytes_per_token),
        "prefill_bytes_per_token": sum(stats.prefill_boundary_bytes)
        / len(stats.prefill_boundary_bytes)
        / len(prompt),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["client"])
    parser.add_argument("model")
    parser.add_argument("boundary")
    parser.add_argument("prompt_tokens", type=int)
    parser.add_argument("new_tokens", type=int)
    parser.add_argument("servers", nargs="+")
    a = parser.parse_args()
    print(json.dumps(client(a.model, a.boundary, a.prompt_tokens, a.new_tokens, a.servers)))
