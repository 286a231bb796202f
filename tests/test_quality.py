"""The quality benchmark's arithmetic: parameter counts, steps to a target, gap trends, paper-size steps."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from bench.quality import (
    QualityPlan,
    Variant,
    curve,
    gap_trend,
    paper_step_seconds,
    parameter_count,
    run_key,
    steps_to,
    tuned_curve,
    variants,
)
from bench.quality_report import _seed_lines
from bench.scaling import Method, full_plan, run_variant
from bench.throughput import Link
from swarm.core.config import MODEL_PRESETS, CodecConfig, ModelConfig, RunConfig, TrainConfig
from swarm.core.model import Stage
from swarm.core.profiles import load_profile
from swarm.core.subspace import initial_artifacts
from swarm.io.data import load_dataset
from tests.helpers import tiny_config

CACHE = Path(__file__).resolve().parents[1] / "bench" / "results" / "scaling-runs"  # shipped curves


@pytest.mark.parametrize("change", [{}, {"constrain_writes": False}, {"full_rank_layers": 1}, {"d_ff": 40}])
def test_parameter_count_is_the_models(change):
    config = tiny_config()
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, **change))
    fixed, basis = initial_artifacts(config)
    model = Stage(config.model, 0, config.model.n_layers, fixed, basis, 0)
    assert parameter_count(config.model) == sum(p.numel() for p in model.parameters())


def test_steps_to_a_target_interpolates_and_says_when_it_is_not_reached():
    curve = [(0, 8.0), (10, 6.0), (20, 5.0), (30, 4.5)]
    assert steps_to(curve, 6.0) == 10
    assert steps_to(curve, 5.5) == pytest.approx(15.0)
    assert steps_to(curve, 4.0) is None


def test_gap_trend_compares_mid_run_with_the_end():
    assert gap_trend([0.10, 0.08, 0.05, 0.03]) == "shrinking"
    assert gap_trend([0.02, 0.03, 0.05, 0.08]) == "growing"
    assert gap_trend([0.05, 0.05, 0.052, 0.051]) == "steady"


def test_the_line_up_spans_the_compressions_it_names():
    small = MODEL_PRESETS["small"]
    by_name = {v.name: v for v in variants(small, 4)}
    ranks = [by_name[f"subspace k={k}"].model.subspace_rank for k in (32, 8, 4, 2)]
    assert ranks == [32, 8, 4, 2]  # ~8x, ~30x, ~60x, ~100x+ of bf16 activations at d=256
    wide = by_name["subspace k=4 + parameter-matched FFN"].model
    dense = by_name["dense bf16"].model
    assert abs(parameter_count(wide) - parameter_count(dense)) < 0.01 * parameter_count(dense)


def test_paper_step_is_bound_by_the_slower_of_compute_and_link():
    profile = load_profile("h200-2b-8layer-mb512")
    link = Link("80 Mbit/s", 80, 25)
    dense, compressed = paper_step_seconds(profile, 16384, link), paper_step_seconds(profile, 164, link)
    compute, transfer = sum(profile.stage_seconds(1, 512)), 164 * 512 * 8 / 80e6  # one microbatch
    assert transfer > compute  # an H200 layer outruns even a 100x-compressed 80 Mbit/s link
    assert compressed == pytest.approx(23 * transfer + 14 * 0.025)  # 16 microbatches + 7 to fill, 7 RTTs
    assert dense == pytest.approx(23 * 100 * transfer * 16384 / 16400 + 14 * 0.025)
    assert paper_step_seconds(profile, 164, Link("10 Gbit/s", 10_000)) == pytest.approx(23 * compute)


def test_a_diverging_variant_is_recorded_not_fatal(tmp_path):
    """Non-finite values at a boundary end that variant's curve; the section goes on and says so."""
    model = dataclasses.replace(MODEL_PRESETS["tiny"], constrain_writes=False)
    variant = Variant("exploding", model, CodecConfig("identity", "fp16", "fp16"), lever="lr 3")
    train = TrainConfig(
        steps=12, batch_size=4, seq_len=32, microbatches=2, lr=3.0, warmup_steps=5, eval_every=1
    )
    plan = QualityPlan(model, train, 2, ["exploding"], [], eval_batches=1)
    dataset = load_dataset(RunConfig(model=model, train=train, n_stages=1))
    row = curve(variant, plan, dataset, tmp_path, lambda _: None)
    assert "non-finite" in row["diverged"] and "val_curve" not in row
    assert not list(tmp_path.glob("*.progress.pt"))  # its resumable state goes with it: the row is final
    assert curve(variant, plan, dataset, tmp_path, lambda _: None) == row  # cached like any curve


def test_cache_keys_outlive_a_changed_default():
    """The defaults cached curves were keyed against keep the empty key, so the shipped cache is found
    after a default changed; the new defaults are a change like any other."""
    old_model = dataclasses.replace(ModelConfig(), subspace_rank=32, parametrisation="standard")
    old = RunConfig(model=old_model, train=dataclasses.replace(TrainConfig(), lr=3e-3))
    empty = hashlib.sha256(b"{}/16").hexdigest()[:16]
    assert run_key(old, 16) == empty and run_key(RunConfig(), 16) != empty
    plan = full_plan()
    for method, lr, parametrisation in [
        (Method("dense", 0), 0.004, "mup"),
        (Method("subspace", 8), 0.002, "standard"),
    ]:
        variant, quality_plan = run_variant(plan, 128, method, lr, parametrisation, plan.seed)
        key = run_key(variant.config(quality_plan.train, quality_plan.n_stages), quality_plan.eval_batches)
        assert (CACHE / f"{key}.json").exists(), variant.name


@pytest.mark.parametrize("confirm", [[], [1]])
def test_a_tuned_variant_is_reported_at_its_best_lr_of_a_sweep_that_ends_interior(tmp_path, confirm):
    """Tuning trains the variant at lrs a factor 2 apart until the best one has worse neighbours on
    both sides, and the row is that lr's run (its cached curve), with the sweep it was chosen on;
    the confirming seeds run at that lr only."""
    model = MODEL_PRESETS["tiny"]
    train = TrainConfig(
        steps=6, batch_size=4, seq_len=32, microbatches=2, lr=0.1, warmup_steps=1, eval_every=3
    )
    plan = QualityPlan(
        model, train, 2, ["subspace k=8"], [], eval_batches=1, tune=True, tie_seed=None, confirm_seeds=confirm
    )
    (variant,) = [v for v in variants(model, 2) if v.name == "subspace k=8"]
    dataset = load_dataset(RunConfig(model=model, train=train, n_stages=1))
    row = tuned_curve(variant, plan, dataset, tmp_path, lambda _: None)
    sweep = {float(lr): loss for lr, loss in row["lr_sweep"].items()}
    best = min(sweep, key=sweep.get)
    assert row["lr"] == pytest.approx(best)
    assert any(lr == pytest.approx(best / 2) for lr in sweep) and any(
        lr == pytest.approx(best * 2) for lr in sweep
    )
    runs = len(sweep) + len(confirm)  # one cached run per lr, and one per confirming seed
    assert len(sweep) >= 3 and len(list(tmp_path.glob("*.json"))) == runs
    assert row["final_val_loss"] == sweep[best]
    assert set(row["seed_finals"]) == {"0", *map(str, confirm)}
    for seed in confirm:
        again = curve(variant, plan, dataset, tmp_path, lambda _: None, lr=row["lr"], seed=seed)
        assert row["seed_finals"][str(seed)] == again["final_val_loss"] != row["final_val_loss"]
    assert (
        curve(variant, plan, dataset, tmp_path, lambda _: None, lr=row["lr"])["val_curve"] == row["val_curve"]
    )


def test_the_seed_table_compares_means_over_the_seeds_both_sides_ran():
    """A variant run on one seed is compared with dense's run on that seed, not with dense's mean over
    two (seeds end a point or two apart: mixing seed sets would shift the gap by as much)."""
    rows = [
        {"variant": "dense bf16", "seed_finals": {"0": 5.0, "1": 5.2}},
        {"variant": "one seed", "lr": 0.002, "seed_finals": {"0": 5.1}},
        {"variant": "two seeds", "lr": 0.002, "seed_finals": {"0": 5.0, "1": 5.4}},
        {"variant": "one diverged", "lr": 0.002, "seed_finals": {"0": 5.1, "1": float("inf")}},
    ]
    table = {
        line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in _seed_lines(rows) if "|" in line
    }
    assert table["one seed (lr 0.002)"][1:] == ["0", "5.100", "5.100", "+2.0% |"]
    assert table["two seeds (lr 0.002)"][1:] == ["0, 1", "5.000, 5.400", "5.200", "+2.0% |"]
    assert table["dense bf16"][-1] == "+0.0% |"
    assert table["one diverged (lr 0.002)"][-1] == "+2.0% |"  # over the seed that did not diverge
