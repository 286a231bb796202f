"""``swarm bench [--quick]``: every benchmark, written as JSON, a Markdown report and PNG plots.

``--quick`` (CI's smoke test, a few minutes) runs each section on the tiny model with
few steps and codecs; the full run is what the README quotes. Every number in the
report is measured by this run; the JSON records the configuration that produced it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import (
    averaging,
    churn,
    convergence,
    generation,
    multihost,
    overhead,
    paper_scale,
    peer,
    precision,
    quality,
    relay,
    replica_sync,
    replicas,
    report,
    scaling,
    state,
    throughput,
    verification,
    wan_replicas,
    wire,
)
from bench import data as data_bench
from bench.codecs import CodecCase, codec_cases
from bench.netns import available as netns_available
from bench.throughput import Link
from swarm.core.config import MODEL_PRESETS, ModelConfig, RunConfig, TrainConfig
from swarm.io.data import load_dataset

# The benchmarks' model: the small preset as it was when their results were recorded (d=256, k=32,
# standard parametrisation); the embedded default run has since moved to k=8 under mup-anchored.
BENCH_MODEL = dataclasses.replace(MODEL_PRESETS["small"], subspace_rank=32, parametrisation="standard")


@dataclass
class BenchPlan:
    model: ModelConfig
    train: TrainConfig
    n_stages: int
    convergence_steps: int
    rotation_interval: int
    convergence_codecs: list[str]
    throughput_model: ModelConfig
    throughput_train: TrainConfig
    throughput_codecs: list[str]
    links: list[Link] = field(default_factory=list)
    wire_tokens: int = 4096
    shaper: str = "netns"
    peer: bool = True
    churn: churn.ChurnPlan | None = None
    multihost: multihost.MultiHostPlan | None = None
    multihost_codecs: list[str] = field(default_factory=lambda: ["dense bf16", "subspace bf16"])
    generation: generation.GenerationPlan | None = None
    paper_scale: paper_scale.PaperScalePlan | None = None
    gpu_scale: list[paper_scale.PaperScalePlan] = field(default_factory=list)  # measured GPU profiles
    averaging: averaging.AveragingPlan | None = None
    replicas: replicas.ReplicaPlan | None = None
    replica_sync: replica_sync.ReplicaSyncPlan | None = None
    wan_replicas: wan_replicas.WanReplicaPlan | None = None
    quality: quality.QualityPlan | None = None
    precision: precision.PrecisionPlan | None = None
    relay: relay.RelayPlan | None = None
    state: state.StatePlan | None = None
    data: data_bench.DataPlan | None = None
    scaling: scaling.ScalingPlan | None = None
    verification: verification.VerificationPlan | None = None


def plan(quick: bool) -> BenchPlan:
    if quick:
        tiny = MODEL_PRESETS["tiny"]
        return BenchPlan(
            model=tiny,
            train=TrainConfig(batch_size=8, seq_len=64, microbatches=2, lr=1e-2, warmup_steps=5),
            n_stages=2,
            convergence_steps=30,
            rotation_interval=10,
            convergence_codecs=["dense bf16", "top-k", "subspace bf16", "MAPL bf16"],
            throughput_model=tiny,
            throughput_train=TrainConfig(steps=5, batch_size=4, seq_len=32, microbatches=2),
            throughput_codecs=["dense bf16", "subspace bf16"],
            links=[Link("80 Mbit/s, 50 ms RTT", 80, 25)],
            wire_tokens=1024,
            shaper="transport",
            peer=False,
            churn=churn.ChurnPlan(
                model=tiny,
                train=TrainConfig(steps=150, batch_size=4, seq_len=32, microbatches=2),
                n_stages=3,
                kill_every_s=10,
                checkpoint_interval=5,
            ),
            multihost=multihost.MultiHostPlan(
                tiny, TrainConfig(steps=8, batch_size=4, seq_len=32, microbatches=2), mbps=100
            ),
            generation=generation.GenerationPlan(tiny, (10.0,), prompt_tokens=16, new_tokens=16, repeats=1),
            paper_scale=paper_scale.PaperScalePlan(
                tiny,
                TrainConfig(steps=3, batch_size=4, seq_len=32, microbatches=4),
                n_stages=4,
                profile="h200-2b-8layer-mb512",
                codecs=["dense bf16", "subspace bf16"],
                links=[Link("80 Mbit/s, 50 ms RTT", 80, 25)],
            ),
            averaging=averaging.AveragingPlan(tiny, n_stages=2, rounds=1),
            replicas=replicas.ReplicaPlan(
                tiny, TrainConfig(steps=8, batch_size=8, seq_len=32, microbatches=4), counts=(1, 2)
            ),
            replica_sync=replica_sync.ReplicaSyncPlan(
                dataclasses.replace(tiny, n_layers=2),
                TrainConfig(steps=10, batch_size=4, seq_len=32, microbatches=2, lr=1e-2),
                every=(5,),
                formats=("int8",),
                tail=3,
            ),
            quality=quality.QualityPlan(
                tiny,
                TrainConfig(steps=20, batch_size=4, seq_len=32, microbatches=2, lr=1e-2, eval_every=5),
                n_stages=2,
                variants=["dense bf16", "subspace k=8", "subspace k=1 + full-rank last stage"],
                links=[Link("80 Mbit/s, 50 ms RTT", 80, 25)],
                eval_batches=2,
                tune=True,
                dense_lr=2e-2,
                tie_seed=None,
                timing_train=TrainConfig(steps=4, batch_size=4, seq_len=32, microbatches=2),
                shaper="transport",
            ),
            precision=precision.PrecisionPlan(
                tiny,
                TrainConfig(batch_size=4, seq_len=32, microbatches=2),
                stage_counts=(1, 2),
                steps=2,
                compiled=False,  # compiling takes longer than the quick section's whole run
            ),
            relay=relay.RelayPlan(
                tiny, TrainConfig(steps=6, batch_size=4, seq_len=32, microbatches=2), megabytes=64
            ),
            data=data_bench.DataPlan(
                max_mb=4, max_steps=200, repeats=1, memory_check=False, install=False, model_steps=1
            ),
            state=state.StatePlan(
                tiny,
                TrainConfig(batch_size=4, seq_len=32, microbatches=2),
                n_stages=2,
                steps=3,
                state_bytes=8 << 20,
                holders=(2,),
            ),
            scaling=scaling.quick_plan(),
            verification=verification.VerificationPlan(
                tiny,
                TrainConfig(batch_size=4, seq_len=16, microbatches=2, lr=1e-2, warmup_steps=1),
                steps=3,
                honest_seeds=1,
                trials=200,
            ),
        )
    small = BENCH_MODEL
    return BenchPlan(
        model=small,
        train=TrainConfig(batch_size=8, seq_len=128, microbatches=2, lr=3e-3, warmup_steps=20),
        n_stages=4,
        convergence_steps=200,
        rotation_interval=50,
        convergence_codecs=[
            c.name
            for c in _cases(small)
            if c.name not in ("dense fp32", "subspace fp32", "subspace int8/token + zstd")
        ],
        throughput_model=small,
        throughput_train=TrainConfig(steps=8, batch_size=8, seq_len=128, microbatches=4),
        throughput_codecs=["dense bf16", "int8 blockwise", "subspace bf16"],
        links=[
            Link("2 Mbit/s", 2),
            Link("10 Mbit/s", 10),
            Link("80 Mbit/s, 50 ms RTT", 80, 25),
            Link("200 Mbit/s", 200),
            Link("1 Gbit/s", 1000),
        ],
        churn=churn.ChurnPlan(
            model=small,
            train=TrainConfig(steps=300, batch_size=8, seq_len=128, microbatches=2),
            n_stages=4,
            kill_every_s=20,
            checkpoint_interval=10,
            replicas=(1, 2),
            keepers=(1, 0),  # the keepers' cost, side by side with uploads to the coordinator
        ),
        multihost=multihost.MultiHostPlan(
            small, TrainConfig(steps=20, batch_size=8, seq_len=128, microbatches=2), mbps=100
        ),
        generation=generation.GenerationPlan(small, (2.0, 10.0, 80.0), prompt_tokens=64, new_tokens=32),
        paper_scale=paper_scale.PaperScalePlan(
            # the bundled tokenizer's vocabulary; with emulated layers it only sizes the fixed embedding
            dataclasses.replace(MODEL_PRESETS["2b-8layer"], vocab_size=4096, max_seq_len=512),
            TrainConfig(steps=3, batch_size=16, seq_len=512, microbatches=16),
            n_stages=8,
            profile="paper-2b-8layer",
            links=[
                Link("10 Mbit/s", 10),
                Link("80 Mbit/s, 50 ms RTT", 80, 25),
                Link("500 Mbit/s", 500),
            ],
            one_f_one_b_on="80 Mbit/s, 50 ms RTT",
        ),
        gpu_scale=_gpu_scale_plans(),
        averaging=averaging.AveragingPlan(small, n_stages=4),
        replicas=replicas.ReplicaPlan(
            MODEL_PRESETS["tiny"], TrainConfig(steps=40, batch_size=12, seq_len=64, microbatches=6)
        ),
        replica_sync=replica_sync.ReplicaSyncPlan(
            dataclasses.replace(MODEL_PRESETS["tiny"], n_layers=2),
            TrainConfig(steps=100, batch_size=4, seq_len=32, microbatches=2, lr=1e-2),
        ),
        wan_replicas=wan_replicas.WanReplicaPlan(
            small, TrainConfig(steps=60, batch_size=8, seq_len=128, microbatches=2)
        ),
        quality=quality.QualityPlan(  # the product's model (mup-anchored), every variant at its own lr
            MODEL_PRESETS["small"],
            TrainConfig(
                steps=1000, batch_size=8, seq_len=128, microbatches=2, lr=2e-3, warmup_steps=20, eval_every=50
            ),
            n_stages=4,
            variants=[  # the most telling first: an interrupted run still answers the question
                "dense bf16",
                "subspace k=8",
                "subspace k=4",
                "subspace k=2",
                "subspace k=32",
                "subspace k=4, bottleneck at boundaries only",
                "MAPL r=8, Adam + PCA init",
                "top-k (~30x)",
                "subspace k=12 int4/block",
                "subspace k=8 int8/token",
                "subspace k=4 + full-rank last stage",
                "subspace k=4 + parameter-matched FFN",
                "subspace k=4 + rotation",
                "subspace k=2->4 growing",
                "subspace k=4->8 growing",
                "MAPL r=8",
                "MAPL r=8 + Riemannian Adam",
            ],
            tune=True,
            dense_lr=4e-3,  # the scaling grid's dense optimum at d=128 (the subspace model's: 2e-3)
            confirm_seeds=[1],  # gaps of a point or two: every variant on two seeds
            links=[Link("80 Mbit/s, 50 ms RTT", 80, 25), Link("200 Mbit/s, 50 ms RTT", 200, 25)],
            timing_train=TrainConfig(steps=6, batch_size=8, seq_len=128, microbatches=2),
        ),
        precision=_precision_plan(),
        relay=relay.RelayPlan(small, TrainConfig(steps=12, batch_size=8, seq_len=128, microbatches=2)),
        data=data_bench.DataPlan(),
        state=state.StatePlan(small, TrainConfig(batch_size=8, seq_len=128, microbatches=2)),
        scaling=scaling.full_plan(),  # CPU hours; its runs are cached (python -m bench.scaling runs parts)
        verification=verification.VerificationPlan(
            MODEL_PRESETS["tiny"],
            TrainConfig(batch_size=8, seq_len=32, microbatches=4, lr=1e-2, warmup_steps=2),
            steps=12,
            honest_seeds=20,
            live=verification.LivePlan(honest_runs=20),
        ),
    )


def _precision_plan() -> precision.PrecisionPlan:
    """On CUDA the 150m preset, the size the GPU throughput goals are stated for; on a CPU the small one."""
    if torch.cuda.is_available():
        train = TrainConfig(batch_size=16, seq_len=1024, microbatches=4)
        return precision.PrecisionPlan(MODEL_PRESETS["150m"], train, warmup_steps=2, steps=5)
    train = TrainConfig(batch_size=8, seq_len=128, microbatches=4)
    return precision.PrecisionPlan(BENCH_MODEL, train, steps=8)


def _cases(model: ModelConfig) -> list[CodecCase]:
    """Baselines sized to the subspace codec's bytes/token (k bf16 numbers per token)."""
    k = model.subspace_rank
    return codec_cases(k, mapl_rank=k, topk=k // 2, lowrank=max(1, k * 2 // 3))


def _pick(cases: list[CodecCase], names: list[str]) -> list[CodecCase]:
    """The cases named in ``names``; a name may leave out the parameters in parentheses."""
    return [c for c in cases if any(c.name == n or c.name.startswith(n + " (") for n in names)]


def machine() -> dict:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "torch_threads": torch.get_num_threads(),
    }


def _gpu_scale_plans() -> list[paper_scale.PaperScalePlan]:
    """The paper-size models on the H200's measured compute: 32 microbatches of 4 x 512 tokens per step
    (the profiles' 2048-token microbatch), the 2B model on three links, the 8B one at 80 Mbit/s."""
    train = TrainConfig(steps=3, batch_size=128, seq_len=512, microbatches=32)
    slow = Link("80 Mbit/s, 50 ms RTT", 80, 25)
    return [
        paper_scale.PaperScalePlan(
            dataclasses.replace(MODEL_PRESETS[preset], vocab_size=4096, max_seq_len=512),
            train,
            n_stages=8,
            profile=f"h200-{preset}-mb2048",
            links=links,
        )
        for preset, links in (
            ("2b-8layer", [slow, Link("200 Mbit/s", 200), Link("1 Gbit/s", 1000)]),
            ("8b", [slow]),
        )
    ]


def sections(p: BenchPlan, quick: bool, cache: Path | None = None) -> dict[str, Callable[[], object]]:
    """Each benchmark section as a thunk, in the order they run (``cache``: where sections that
    take long keep finished parts, so a rerun resumes)."""
    cases = _cases(p.model)
    stages = p.n_stages if not quick else 2

    def run_convergence():
        dataset = load_dataset(RunConfig(model=p.model, train=p.train, n_stages=1))
        train_cfg = dataclasses.replace(p.train, steps=p.convergence_steps)
        return convergence.run(
            _pick(cases, p.convergence_codecs), p.model, train_cfg, p.n_stages, dataset, p.rotation_interval
        )

    def run_peer():
        dense = dataclasses.replace(p.throughput_model, constrain_writes=False)
        rate_only = [Link("loopback (compute-only)", 0.0), *(x for x in p.links if not x.one_way_ms)]
        return peer.run(dense, p.throughput_train, stages, rate_only, shaper=p.shaper)

    out: dict[str, Callable[[], object]] = {
        "wire": lambda: wire.run(p.model, p.train, tokens=p.wire_tokens),
        "overhead": lambda: overhead.run(_pick(cases, p.convergence_codecs), p.model, p.train),
        "convergence": run_convergence,
        "throughput": lambda: throughput.run(
            _pick(_cases(p.throughput_model), p.throughput_codecs),
            p.throughput_model,
            p.throughput_train,
            stages,
            p.links,
            shaper=p.shaper,
        ),
    }
    if p.peer:
        out["peer"] = run_peer
    if p.paper_scale is not None:
        out["paper_scale"] = lambda: _paper_scale(p.paper_scale, p.shaper)
    if p.gpu_scale:
        out["gpu_scale"] = lambda: [_paper_scale(plan, p.shaper) for plan in p.gpu_scale]
    if p.churn is not None:
        out["churn"] = lambda: churn.run(p.churn)
        if not quick:  # three more runs of the churn model: the full plan only
            out["lost_stage"] = lambda: churn.lost_stage(p.churn)
    if p.multihost is not None:
        out["multihost"] = lambda: _multihost(p)
    if p.generation is not None:
        out["generation"] = lambda: _needs_netns(lambda: generation.run(p.generation))
    if p.averaging is not None:
        out["averaging"] = lambda: averaging.run(p.averaging)
    if p.replicas is not None:
        out["replicas"] = lambda: replicas.run(p.replicas)
    if p.replica_sync is not None:
        out["replica_sync"] = lambda: replica_sync.run(p.replica_sync)
    if p.wan_replicas is not None:
        out["wan_replicas"] = lambda: _needs_netns(lambda: wan_replicas.run(p.wan_replicas))
    if p.quality is not None:
        out["quality"] = lambda: _quality(p.quality, cache)
    if p.precision is not None:
        out["precision"] = lambda: precision.run(p.precision)
    if p.relay is not None:
        out["relay"] = lambda: relay.run(p.relay)
    if p.state is not None:
        out["state"] = lambda: state.run(p.state)
    if p.data is not None:
        out["data"] = lambda: data_bench.run(p.data, Path(tempfile.gettempdir()) / "swarm-bench-data")
    if p.verification is not None:
        out["verification"] = lambda: verification.run(p.verification)
    if p.scaling is not None:
        runs = cache.parent / "scaling-runs" if cache else Path(tempfile.mkdtemp(prefix="swarm-scaling-"))
        out["scaling"] = lambda: _scaling(p.scaling, runs)
    return out


def _needs_netns(section: Callable[[], object]) -> object:
    ok, reason = netns_available()
    return section() if ok else {"skipped": reason}


def _paper_scale(ps: paper_scale.PaperScalePlan, shaper: str) -> dict:
    """A paper-size model on emulated compute; namespaces where available (quick: the transport's shaper)."""
    return paper_scale.run(ps, _pick(_cases(ps.model), ps.codecs), shaper=shaper)


def _quality(q: quality.QualityPlan, cache: Path | None) -> dict:
    """Every quality variant on the benchmark corpus (loaded once); curves kept in ``cache``."""
    return quality.run(q, load_dataset(RunConfig(model=q.model, train=q.train, n_stages=1)), cache)


def _scaling(plan: scaling.ScalingPlan, cache: Path) -> dict:
    """The width x rank grid, its coordinate check and law; runs kept in ``cache``."""
    dataset = load_dataset(RunConfig(model=ModelConfig(vocab_size=plan.vocab_size), n_stages=1))
    return scaling.full(plan, dataset, cache)


def _multihost(p: BenchPlan) -> list[dict] | dict:
    """The README's multi-host recipe on emulated hosts (needs network namespaces: root + iproute2)."""
    codecs = {c.name: c.codec for c in _pick(_cases(p.multihost.model), p.multihost_codecs)}
    return _needs_netns(lambda: multihost.run(p.multihost, codecs))


REPORT_HEAD = ("wire", "overhead", "convergence", "throughput")  # sections the report always shows


def main(
    quick: bool,
    out: str | Path,
    resume: bool = False,
    only: list[str] | None = None,
    compute_profile: str | None = None,
) -> dict:
    """Run every section, saving ``results.json`` after each; ``resume`` keeps sections already saved
    by an interrupted run of the same plan; ``only`` reruns just the named sections and keeps the
    others of the saved results (with none saved yet, runs just those: wire, overhead, convergence
    and throughput must be among them, the report starts with them); ``compute_profile`` replaces
    the paper-scale section's profile."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    p = plan(quick)
    if compute_profile and p.paper_scale is not None:  # e.g. one measured on a GPU
        p.paper_scale = dataclasses.replace(p.paper_scale, profile=compute_profile)
    current_plan = json.loads(json.dumps(dataclasses.asdict(p), default=str))
    results: dict = {"quick": quick, "machine": machine(), "plan": current_plan, "seconds": {}}
    saved = out / "results.json"
    available = sections(p, quick, out / "quality-runs")
    unknown = set(only or ()) - set(available)
    if unknown:
        raise ValueError(f"unknown benchmark sections {sorted(unknown)}; choose from {list(available)}")
    missing = [name for name in REPORT_HEAD if name not in (only or available)]
    if only and not saved.exists() and missing:
        raise ValueError(f"--only {','.join(only)} with no {saved} yet: the report needs {missing} too")
    if (resume or only) and saved.exists():
        previous = json.loads(saved.read_text())
        if only or previous.get("plan") == current_plan:
            results = previous | {"plan": current_plan}
    if only and saved.exists():  # the sections newer than the run the header describes, and where they ran
        rerun = results.setdefault("rerun", {"sections": {}})
        now = machine()
        rerun |= {"platform": now["platform"], "cpu_count": now["cpu_count"]}
        rerun["sections"] |= dict.fromkeys(only, now["date"])
    for name, section in available.items():
        if (only and name not in only) or (not only and name in results):
            continue
        t0 = time.perf_counter()
        results[name] = section()
        results["seconds"][name] = time.perf_counter() - t0
        saved.write_text(json.dumps(results, indent=2, default=str))
    (out / "results.md").write_text(report.markdown(results))
    report.plots(results, out)
    return results
