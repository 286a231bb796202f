"""Throughput of a real local swarm (coordinator + one node process per stage) on emulated links.

Links are shaped in the transport (:mod:`swarm.transport.shaper`: rate limit plus
one-way delay on every stream's sends), the same for every codec, measured side by
side in one run. Throughput is steady-state: tokens over the summed step durations,
leaving out the first steps (process start-up, caches). The physical bound of each
row is ``min(compute-only tokens/s, link rate / wire bytes per token)`` with the link
full duplex (activations and gradients flow in opposite directions), where
compute-only is the same codec's swarm on unshaped loopback.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from bench.codecs import CodecCase
from swarm.config import ModelConfig, RunConfig, TrainConfig
from swarm.local_swarm import up

WARMUP_STEPS = 2


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    mbps: float  # 0: unshaped loopback
    one_way_ms: float = 0.0


def run_swarm(case: CodecCase, model: ModelConfig, train: TrainConfig, n_stages: int, link: Link) -> dict:
    config = RunConfig(
        model=dataclasses.replace(model, constrain_writes=case.constrained),
        codec=case.codec,
        train=train,
        n_stages=n_stages,
    )
    with tempfile.TemporaryDirectory(prefix="swarm-bench-") as run_dir:
        s = up(
            config,
            Path(run_dir),
            link_mbps=link.mbps,
            link_latency_ms=link.one_way_ms,
            progress=False,
            use_dht=False,
            timeout=1800,
        )
    steady = s.step_summaries[WARMUP_STEPS:] or s.step_summaries
    tokens = sum(x.tokens for x in steady)
    seconds = sum(x.wall_seconds for x in steady)
    boundaries = max(1, n_stages - 1)
    fwd = sum(x.bytes_sent_forward for x in steady) / boundaries / tokens
    bwd = sum(x.bytes_sent_backward for x in steady) / boundaries / tokens
    return {
        "codec": case.name,
        "link": link.name,
        "tokens_per_s": tokens / seconds,
        "wire_forward_B_per_token": fwd,
        "wire_backward_B_per_token": bwd,
        "link_bound_tokens_per_s": link.mbps * 1e6 / 8 / max(fwd, bwd) if link.mbps else None,
        "final_loss": s.losses[-1],
    }


def run(
    cases: list[CodecCase], model: ModelConfig, train: TrainConfig, n_stages: int, links: list[Link]
) -> list[dict]:
    """Every codec on every link; adds the ratio to the first codec and the efficiency against the bound."""
    unshaped = Link("loopback (compute-only)", 0.0)
    rows = []
    compute = {c.name: run_swarm(c, model, train, n_stages, unshaped) for c in cases}
    rows.extend(compute.values())
    for link in links:
        for case in cases:
            row = run_swarm(case, model, train, n_stages, link)
            bound = min(compute[case.name]["tokens_per_s"], row["link_bound_tokens_per_s"])
            row["physical_bound_tokens_per_s"] = bound
            row["efficiency"] = row["tokens_per_s"] / bound
            rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["link"] == row["link"] and r["codec"] == cases[0].name)
        row["speedup_vs_" + cases[0].name.replace(" ", "_")] = row["tokens_per_s"] / base["tokens_per_s"]
    return rows
