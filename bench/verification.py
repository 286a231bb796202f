"""Verification: how often sampled recomputation catches a stage that computes wrong, and what it costs.

A pipeline trains on this machine with one stage lying (:mod:`swarm.runtime.faults`: sign flip, noise of the
same norm, weights a step old, a skipped layer) on every microbatch; an auditor holding that stage's
weights at each step's version recomputes every microbatch (:mod:`swarm.runtime.audit`) and
compares with the tolerance for the pair of precisions. That gives, per fault mode, ``q``: the share
of lying microbatches that an audit flags. Honest runs (several seeds, fp32 and bf16 nodes) give the
false alarms. A node lying on a share ``f`` of its microbatches, each audited with probability ``p``
by each of its two sibling replicas, is flagged by one of them within ``n`` of its microbatches with
chance ``1 - (1 - p f q)^n`` and evicted (both must have flagged it) with that squared; the draws
are simulated to check it. With a :class:`LivePlan`, live swarms (:mod:`bench.audit_swarm`) add the
eviction, the rollback and the throughput with audits on against off.
"""

from __future__ import annotations

import dataclasses
import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.audit_swarm import LiveRun, run_live
from bench.faults import Auditor, Recorder
from swarm.core.config import (
    MODEL_PRESETS,
    AuditConfig,
    CheckpointConfig,
    CodecConfig,
    DataConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
)
from swarm.io.data import batch_ids, load_dataset
from swarm.runtime.audit import TOLERANCES
from swarm.runtime.faults import MODES, Fault
from swarm.runtime.pipeline import LocalPipeline


@dataclass
class VerificationPlan:
    model: ModelConfig
    train: TrainConfig
    n_stages: int = 3
    stage: int = 1  # the lying (and audited) stage: a middle one
    steps: int = 8
    honest_seeds: int = 4
    rates: tuple[float, ...] = (0.01, 0.02, 0.05)
    fractions: tuple[float, ...] = (1.0, 0.1)
    epoch_steps: int = 50  # an epoch's steps, for the per-epoch detection chance
    suspect_rate: float = AuditConfig().suspect_rate  # a suspect's audit rate (after a first mismatch)
    notice_steps: int = 2  # steps between a first mismatch and its siblings auditing at suspect_rate
    trials: int = 2000  # simulated epochs per (p, f) for the draw
    live: LivePlan | None = None  # live swarms (None: in process only)


@dataclass
class LivePlan:
    """Live swarms on this machine: two stages, each on three replicas (six nodes: whichever stage a
    node lands on, it has two siblings to audit it); honest with audits off, honest with audits at
    ``rate``, and with the second node to join lying (``fault``)."""

    steps: int = 60
    microbatches: int = 12
    rate: float = 0.02
    fault: str = "sign"
    nodes: int = 6
    # honest runs for the false evictions: every sibling microbatch audited, a seed each
    honest_runs: int = 0
    honest_steps: int = 30

    def config(self, rate: float, steps: int | None = None, seed: int = 0) -> RunConfig:
        t = TrainConfig(
            seed=seed,
            steps=steps or self.steps,
            batch_size=self.microbatches,
            seq_len=32,
            microbatches=self.microbatches,
            warmup_steps=2,
            replicas=3,
        )
        return RunConfig(
            model=MODEL_PRESETS["tiny"],
            train=t,
            codec=CodecConfig(kind="subspace"),
            data=DataConfig(tokenizer="byte"),
            checkpoint=CheckpointConfig(interval=10),
            audit=AuditConfig(rate=rate),
            n_stages=2,
        )


def _config(p: VerificationPlan, precision: str, seed: int) -> RunConfig:
    train = dataclasses.replace(p.train, precision=precision, seed=seed, steps=p.steps)
    return RunConfig(
        model=p.model,
        train=train,
        codec=CodecConfig(kind="subspace"),
        data=DataConfig(tokenizer="byte"),
        n_stages=p.n_stages,
    )


def audit_run(p: VerificationPlan, mode: str | None, precision: str, seed: int = 0) -> dict:
    """Train ``steps`` steps with stage ``p.stage`` lying (``mode``; None: honest), every microbatch
    audited by an fp32 auditor: per microbatch whether it lied and how far it was."""
    config = _config(p, precision, seed)
    t = config.train
    sampler = load_dataset(config).sampler(t.batch_size, t.seq_len, t.seed)
    pipe = LocalPipeline(config)
    worker = pipe.workers[p.stage]
    auditor = Auditor(worker, "fp32")
    fault = Fault(worker, mode, seed=seed) if mode else None
    recorder = Recorder(worker)
    tolerance = TOLERANCES[(precision == "fp32", precision)]
    rows, step_s, audit_s = [], [], []
    for step in range(t.steps):
        auditor.sync()
        start = time.perf_counter()
        pipe.train_step(step, batch_ids(*sampler.next_batch()))
        step_s.append(time.perf_counter() - start)
        lied = fault.lied[-t.microbatches :] if fault else [False] * t.microbatches
        if fault:
            fault.stepped()
        for mb, (tokens, x_in, claimed) in enumerate(recorder.take()):
            start = time.perf_counter()
            c = auditor.check(tokens, x_in, claimed)
            audit_s.append(time.perf_counter() - start)
            rows.append(
                {"step": step, "lied": lied[mb], "rel_l2": c.rel_l2, "flagged": not c.within(tolerance)}
            )
    return {
        "rows": rows,
        "step_seconds": sorted(step_s)[len(step_s) // 2],
        "audit_seconds": sum(audit_s) / len(audit_s),
    }


def caught_within(q: float, p: float, f: float, n: int, auditors: int = 2, confirmations: int = 2) -> float:
    """The chance that a node lying on a share ``f`` of ``n`` microbatches is evicted: each of its
    ``auditors`` siblings audits each microbatch with probability ``p``, an audit of a lie flags it
    with probability ``q``, and eviction needs ``confirmations`` distinct auditors that flagged one."""
    one = 1 - (1 - p * f * q) ** n
    return sum(
        math.comb(auditors, j) * one**j * (1 - one) ** (auditors - j)
        for j in range(confirmations, auditors + 1)
    )


def needed(
    q: float, p: float, f: float, confidence: float, auditors: int = 2, confirmations: int = 2
) -> float:
    """Microbatches for ``confidence`` of eviction (bisection on :func:`caught_within`)."""
    if p * f * q <= 0:
        return math.inf
    lo, hi = 0, 1
    while caught_within(q, p, f, hi, auditors, confirmations) < confidence:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if caught_within(q, p, f, mid, auditors, confirmations) < confidence else (lo, mid)
    return hi


def simulate(
    p: float,
    f: float,
    q: float,
    microbatches: int,
    steps: int,
    trials: int,
    suspect_rate: float = 0.0,
    notice_steps: int = 0,
    auditors: int = 2,
    seed: int = 0,
) -> float:
    """The share of simulated epochs in which ``auditors`` siblings, each drawing privately as the
    nodes do (:mod:`swarm.node.auditor`), all flag a lie (two confirmations out of two). With
    ``suspect_rate``: once one of them flagged a lie, the node is a suspect and, ``notice_steps``
    steps later (the report, the heartbeat that names it), every sibling audits it at that rate."""
    rng = random.Random(seed)
    caught = 0
    for _ in range(trials):
        flagged: set[int] = set()
        suspect_from = math.inf
        for step in range(steps):
            rate = max(p, suspect_rate) if step >= suspect_from else p
            for _mb in range(microbatches):
                lie = rng.random() < f
                for a in range(auditors):
                    if rng.random() < rate and lie and rng.random() < q:
                        flagged.add(a)
            if flagged and suspect_from == math.inf:
                suspect_from = step + 1 + notice_steps
            if len(flagged) == auditors:
                caught += 1
                break
    return caught / trials


def run(p: VerificationPlan) -> dict:
    modes = []
    for precision in ("fp32", "bf16"):
        for mode in MODES:
            r = audit_run(p, mode, precision)
            lies = [x for x in r["rows"] if x["lied"] and x["step"] > 0]  # step 0: a stale copy is current
            modes.append(
                {
                    "precision": precision,
                    "mode": mode,
                    "lies": len(lies),
                    "q": sum(x["flagged"] for x in lies) / len(lies),
                    "min_rel_l2": min(x["rel_l2"] for x in lies),
                }
            )
    honest = []
    for precision in ("fp32", "bf16"):
        runs = [audit_run(p, None, precision, seed) for seed in range(p.honest_seeds)]
        rows = [x for r in runs for x in r["rows"]]
        honest.append(
            {
                "precision": precision,
                "runs": len(runs),
                "microbatches": len(rows),
                "false_alarms": sum(x["flagged"] for x in rows),
                "max_rel_l2": max(x["rel_l2"] for x in rows),
                "step_seconds": runs[0]["step_seconds"],
                "audit_seconds": runs[0]["audit_seconds"],
            }
        )
    m = p.train.microbatches
    q = min(x["q"] for x in modes if x["mode"] != "stale")
    epochs = [
        {
            "rate": rate,
            "fraction": f,
            "q": q,
            "epoch_microbatches": p.epoch_steps * m,
            "caught": caught_within(q, rate, f, p.epoch_steps * m),
            "simulated": simulate(rate, f, q, m, p.epoch_steps, p.trials),
            "as_built": simulate(rate, f, q, m, p.epoch_steps, p.trials, p.suspect_rate, p.notice_steps),
            "as_built_3": simulate(
                rate, f, q, m, 3 * p.epoch_steps, p.trials, p.suspect_rate, p.notice_steps
            ),
            "needed_99": needed(q, rate, f, 0.99),
            "needed_95": needed(q, rate, f, 0.95),
        }
        for rate in p.rates
        for f in p.fractions
    ]
    fp32 = honest[0]
    overhead = {
        "audit_share_at_2pct": 0.02 * m * fp32["audit_seconds"] / fp32["step_seconds"],
        "recompute_seconds": fp32["audit_seconds"],
        "step_seconds": fp32["step_seconds"],
    }
    out = {
        "modes": modes,
        "honest": honest,
        "epochs": epochs,
        "overhead": overhead,
        "microbatches": m,
        "suspect_rate": p.suspect_rate,
        "notice_steps": p.notice_steps,
    }
    if p.live is not None:
        out["live"] = live(p.live)
    return out


def live(p: LivePlan) -> dict:
    """The three live runs side by side (one after another on this machine)."""
    with tempfile.TemporaryDirectory(prefix="swarm-verification-") as tmp:
        off = run_live(p.config(0.0), Path(tmp) / "off", p.nodes)
        on = run_live(p.config(p.rate), Path(tmp) / "on", p.nodes)
        lying = run_live(p.config(p.rate), Path(tmp) / "liar", p.nodes, liar=1, fault=p.fault)
        honest = [
            run_live(p.config(1.0, p.honest_steps, seed), Path(tmp) / f"honest{seed}", p.nodes)
            for seed in range(p.honest_runs)
        ]
    honest_loss = off.status.steps[-1].loss
    return {
        "honest_runs": {
            "runs": len(honest),
            "steps": p.honest_steps,
            "matched": sum(r.status.audits_matched for r in honest),
            "mismatched": sum(r.status.audits_mismatched for r in honest),
            "unavailable": sum(r.status.audits_unavailable for r in honest),
            "evictions": sum(r.evictions for r in honest),
        },
        "steps": p.steps,
        "rate": p.rate,
        "fault": p.fault,
        "runs": {name: _live_row(r, honest_loss) for name, r in (("off", off), ("on", on), ("liar", lying))},
        "throughput_kept": on.tokens_per_second / off.tokens_per_second,
    }


def _live_row(r: LiveRun, honest_loss: float) -> dict:
    s = r.status
    return {
        "seconds": r.seconds,
        "tokens_per_second": r.tokens_per_second,
        "matched": s.audits_matched,
        "mismatched": s.audits_mismatched,
        "unavailable": s.audits_unavailable,
        "restarts": s.epochs_restarted,
        "liar_evicted": r.liar_evicted,
        "final_loss": s.steps[-1].loss,
        "loss_vs_honest": s.steps[-1].loss / honest_loss - 1,
        "lines": list(s.audit_lines),
    }


def section(r: dict) -> list[str]:
    """The report's Markdown for :func:`run`'s result ``r``."""
    o = r["overhead"]
    return [
        "## Verification: sampled recomputation",
        "",
        "One middle stage of a 3-stage pipeline lies on every microbatch; an fp32 auditor holding its "
        "weights at each step's version recomputes every microbatch and flags those outside the "
        "tolerance for the node's precision (`swarm/runtime/audit.py`). q: share of lies flagged "
        "(from step 1: at step 0 a stale copy is the current one).",
        "",
        "| node precision | fault | lies audited | q | smallest relative L2 of a lie |",
        "|---|---|---|---|---|",
        *(
            f"| {x['precision']} | {x['mode']} | {x['lies']} | {x['q']:.3f} | {x['min_rel_l2']:.3g} |"
            for x in r["modes"]
        ),
        "",
        "| honest node precision | runs | microbatches audited | false alarms | largest relative L2 |",
        "|---|---|---|---|---|",
        *(
            f"| {x['precision']} | {x['runs']} | {x['microbatches']} | {x['false_alarms']} | "
            f"{x['max_rel_l2']:.3g} |"
            for x in r["honest"]
        ),
        "",
        f"Evicted within an epoch ({r['epochs'][0]['epoch_microbatches']} of the node's microbatches, "
        f"{r['microbatches']} per step): each of its two sibling auditors recomputes each microbatch "
        "with probability p, privately, and eviction needs both to have flagged a lie (one auditor "
        "never evicts). *At p*: neither raises its rate (closed form, the draws simulated beside it, "
        "and the microbatches that takes for 99% and 95%); *as built*: a first mismatch makes the node "
        f"a suspect, and {r['notice_steps']} steps later both siblings audit it at "
        f"{r['suspect_rate']:.0%} (simulated; within one epoch and within three):",
        "",
        "| p | share of microbatches lied on | at p | simulated | for 99% | for 95% | as built | "
        "as built, 3 epochs |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {e['rate']:.0%} | {e['fraction']:g} | {e['caught']:.3f} | {e['simulated']:.3f} | "
            f"{e['needed_99']:.0f} | {e['needed_95']:.0f} | {e['as_built']:.3f} | {e['as_built_3']:.3f} |"
            for e in r["epochs"]
        ),
        "",
        f"Auditor compute at p = 2%: {o['audit_share_at_2pct']:.2%} of a step's time per sibling "
        f"(a recompute {1e3 * o['recompute_seconds']:.1f} ms, a step {1e3 * o['step_seconds']:.0f} ms), "
        "run in the background by the replicas themselves.",
        "",
        *(_live_section(r["live"]) if "live" in r else []),
    ]


def _live_section(v: dict) -> list[str]:
    runs = v["runs"]
    names = {
        "off": "honest, audits off",
        "on": f"honest, audits at {v['rate']:.0%}",
        "liar": f"one replica lying ({v['fault']}), audits at {v['rate']:.0%}",
    }
    return [
        f"Live ({v['steps']} steps; two stages, each on three replicas: six nodes and a coordinator on "
        "this machine, the three runs one after another):",
        "",
        "| run | tokens/s | audits matched | mismatched | unavailable | restarts | liar evicted "
        "| final loss | vs honest |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {names[k]} | {x['tokens_per_second']:.0f} | {x['matched']} | {x['mismatched']} | "
            f"{x['unavailable']} | {x['restarts']} | {'yes' if x['liar_evicted'] else '-'} | "
            f"{x['final_loss']:.4f} | {x['loss_vs_honest']:+.2%} |"
            for k, x in runs.items()
        ),
        "",
        f"Honest throughput with audits on: {v['throughput_kept']:.1%} of audits off (goal >= 97%; "
        "seven processes share two cores here, so the ratio is noisy).",
        "",
        *(f"* {line}" for line in runs["liar"]["lines"]),
        "",
        *(_honest_runs_line(v["honest_runs"]) if v.get("honest_runs", {}).get("runs") else []),
    ]


def _honest_runs_line(h: dict) -> list[str]:
    return [
        f"False evictions: {h['runs']} honest live runs ({h['steps']} steps each, a seed each, every "
        f"sibling microbatch audited): {h['matched']} audits matched, {h['mismatched']} mismatched, "
        f"{h['unavailable']} unavailable; {h['evictions']} evictions (goal: none in 20 runs).",
        "",
    ]
