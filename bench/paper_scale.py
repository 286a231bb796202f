"""The paper's setting with emulated compute: a 2B, 8-layer model on 8 nodes over slow links.

Every node process runs the real runtime: real codecs on real-size messages (d=4096
dense, k=40 coordinates), real frames, real gRPC through network namespaces with ``tc tbf``
access links (plus the transport's one-way delay: the kernel has no netem). What a GPU
would run, the transformer layers and the subspace boundary maps, is replaced by waits
from a compute profile (:mod:`swarm.runtime.emulation`), so this machine's CPU does only
what a node's CPU does, and the table shows how much of each node's compute a swarm uses
on the profiled device.

Each row's physical bound is ``min(stage compute rate, uplink rate / bytes per token on
the busiest uplink)``, the compute rate counting the subspace codec's boundary maps (a
middle stage runs a lift and a project); the schedule ceiling ``M / (M + P - 1)`` (the pipeline bubble of
GPipe and 1F1B with ``M`` microbatches and ``P`` stages) is reported next to it, since no
schedule of one step's microbatches can beat it when compute binds. Neither counts the links'
delay; the GPipe bound does: each phase (all forwards, then all backwards) takes ``M + P - 1``
microbatch slots, each as long as the slower of a stage's compute and a link's transfer of
one microbatch, and a step's flush adds one round trip through the ``P - 1`` hops.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from bench.codecs import CodecCase
from bench.throughput import Link, attempt, resolve_shaper, run_config
from swarm.core.config import CheckpointConfig, EmulationConfig, ModelConfig, TrainConfig, stage_layer_ranges
from swarm.core.profiles import ComputeProfile, boundary_sides, load_profile

# The paper's headline (Subspace Networks, 2B 8-layer model at 80 Mbit/s): uncompressed -> compressed.
PAPER_TOKENS_PER_S = {"dense": 36.12, "compressed": 592.41}


@dataclass
class PaperScalePlan:
    model: ModelConfig
    train: TrainConfig
    n_stages: int
    profile: str
    codecs: list[str] = field(default_factory=lambda: ["dense bf16", "subspace bf16", "subspace int8/token"])
    links: list[Link] = field(default_factory=list)
    one_f_one_b_on: str | None = None  # the link on which every codec also runs under 1F1B


def _config(case: CodecCase, plan: PaperScalePlan, schedule: str):
    train = dataclasses.replace(plan.train, schedule=schedule)
    config = run_config(case, plan.model, train, plan.n_stages)
    return dataclasses.replace(
        config, emulation=EmulationConfig(plan.profile), checkpoint=CheckpointConfig(interval=0)
    )


def gpipe_bound(
    profile: ComputeProfile,
    layers: list[int],
    sides: list[int],
    m: int,
    microbatch_tokens: int,
    link: Link,
    row: dict,
) -> float:
    """Tokens/s of GPipe with a flush per step on ``link``: per phase ``M + P - 1`` slots of the slowest
    stage-or-link time of one microbatch, plus one round trip through the ``P - 1`` hops."""
    rate = link.mbps * 1e6 / 8 if link.mbps else float("inf")
    forward = backward = 0.0
    for n, s in zip(layers, sides, strict=True):
        f, b = profile.stage_seconds(n, microbatch_tokens)
        maps = profile.boundary_side_seconds(microbatch_tokens) * s
        forward, backward = max(forward, f + maps), max(backward, b + maps)
    forward = max(forward, row["wire_forward_B_per_token"] * microbatch_tokens / rate)
    backward = max(backward, row["wire_backward_B_per_token"] * microbatch_tokens / rate)
    p = len(layers)
    step_s = (m + p - 1) * (forward + backward) + (p - 1) * 2 * link.one_way_ms / 1e3
    return m * microbatch_tokens / step_s


def run(plan: PaperScalePlan, cases: list[CodecCase], shaper: str = "netns") -> dict:
    """Every codec on every link: tokens/s, the bound, utilisation, and the paper's numbers beside them."""
    shaper = resolve_shaper(shaper)
    profile = load_profile(plan.profile)
    layers = [end - start for start, end in stage_layer_ranges(plan.model.n_layers, plan.n_stages)]
    m, p = plan.train.microbatches, plan.n_stages
    ceiling = m / (m + p - 1)
    runs = [(link, case, plan.train.schedule) for link in plan.links for case in cases]
    runs += [
        (link, case, "1f1b") for link in plan.links if link.name == plan.one_f_one_b_on for case in cases
    ]
    tokens = plan.train.batch_size * plan.train.seq_len
    rows = []
    for link, case, schedule in runs:
        sides = [boundary_sides(case.codec.kind, i == 0, i == p - 1) for i in range(p)]
        rates = [profile.tokens_per_second(n, s) for n, s in zip(layers, sides, strict=True)]
        compute_rate, busy = min(rates), [tokens / rate for rate in rates]
        row = attempt(_config(case, plan, schedule), case.name, link, shaper)
        latency_bound = (
            gpipe_bound(profile, layers, sides, m, tokens // m, link, row) if schedule == "gpipe" else None
        )
        link_bound = row["link_bound_tokens_per_s"] or float("inf")
        bound = min(compute_rate, link_bound)
        step_s = sum(row["step_seconds"]) / len(row["step_seconds"])
        row |= {
            "compute_bound_tokens_per_s": compute_rate,
            "physical_bound_tokens_per_s": bound,
            "binds": "compute" if compute_rate <= link_bound else "link",
            "efficiency": row["tokens_per_s"] / bound,
            "gpipe_bound_tokens_per_s": latency_bound,
            "gpipe_efficiency": row["tokens_per_s"] / latency_bound if latency_bound else None,
            "schedule": schedule,
            "schedule_ceiling": ceiling,
            "stage_compute_utilisation": [b / step_s for b in busy],
        }
        rows.append(row)
    for row in rows:
        dense = next(
            r
            for r in rows
            if (r["link"], r["schedule"], r["codec"]) == (row["link"], row["schedule"], cases[0].name)
        )
        row["speedup_vs_dense"] = row["tokens_per_s"] / dense["tokens_per_s"]
        row["byte_ratio_vs_dense"] = dense["busiest_uplink_B_per_token"] / row["busiest_uplink_B_per_token"]
    return {
        "profile": dataclasses.asdict(profile),
        "model": dataclasses.asdict(plan.model),
        "train": dataclasses.asdict(plan.train),
        "n_stages": plan.n_stages,
        "paper_tokens_per_s": PAPER_TOKENS_PER_S,
        "rows": rows,
    }
