"""Verification: how often sampled recomputation catches a stage that computes wrong, and what it costs.

A pipeline trains on this machine with one stage lying (:mod:`swarm.runtime.faults`: sign flip, noise of the
same norm, weights a step old, a skipped layer) on every microbatch; an auditor holding that stage's
weights at each step's version recomputes every microbatch (:mod:`swarm.runtime.audit`) and
compares with the tolerance for the pair of precisions. That gives, per fault mode, ``q``: the share
of lying microbatches that an audit flags. Honest runs (several seeds, fp32 and bf16 nodes) give the
false alarms. The chance that a node lying on a share ``f`` of its microbatches is caught within an
epoch of ``n`` of its microbatches when each is audited with probability ``p`` is then
``1 - (1 - p f q)^n``; the draw itself (:func:`~swarm.runtime.audit.drawn`) is simulated over
random secrets to check it. Not measured here: eviction and rollback in a live swarm (not built).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from dataclasses import dataclass

from bench.faults import Auditor, Recorder
from swarm.core.config import CodecConfig, DataConfig, ModelConfig, RunConfig, TrainConfig
from swarm.io.data import batch_ids, load_dataset
from swarm.runtime.audit import TOLERANCES, drawn
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
    trials: int = 2000  # simulated epochs per (p, f) for the draw


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


def caught_within(q: float, p: float, f: float, n: int) -> float:
    """The chance that a node lying on a share ``f`` of ``n`` microbatches is flagged at least once
    when each is audited with probability ``p`` and an audit of a lie flags it with probability ``q``."""
    return 1 - (1 - p * f * q) ** n


def needed(q: float, p: float, f: float, confidence: float) -> float:
    """Microbatches for ``confidence`` of being caught."""
    per = p * f * q
    return math.inf if per <= 0 else math.log(1 - confidence) / math.log(1 - per)


def simulate(
    p: float, f: float, q: float, microbatches: int, steps: int, trials: int, seed: int = 0
) -> float:
    """The share of simulated epochs (fresh secret each) in which a lie is drawn and flagged."""
    rng = random.Random(seed)
    caught = 0
    for _ in range(trials):
        secret = os.urandom(16)
        for step in range(steps):
            hits = [mb for mb in drawn(secret, step, 1, microbatches, p) if rng.random() < f * q]
            if hits:
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
    return {"modes": modes, "honest": honest, "epochs": epochs, "overhead": overhead, "microbatches": m}


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
        f"Caught within an epoch ({r['epochs'][0]['epoch_microbatches']} of the node's microbatches, "
        f"{r['microbatches']} per step), each audited with probability p; simulated: the draw over "
        "random secrets:",
        "",
        "| p | share of microbatches lied on | caught | simulated | microbatches for 99% | for 95% |",
        "|---|---|---|---|---|---|",
        *(
            f"| {e['rate']:.0%} | {e['fraction']:g} | {e['caught']:.3f} | {e['simulated']:.3f} | "
            f"{e['needed_99']:.0f} | {e['needed_95']:.0f} |"
            for e in r["epochs"]
        ),
        "",
        f"Auditor compute at p = 2%: {o['audit_share_at_2pct']:.2%} of a step's time (a recompute "
        f"{1e3 * o['recompute_seconds']:.1f} ms, a step {1e3 * o['step_seconds']:.0f} ms), spent by "
        "another node, off the critical path. Eviction, rollback and the wiring into a live swarm are "
        "not built yet.",
        "",
    ]
