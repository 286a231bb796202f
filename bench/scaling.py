"""Quality as models widen: every method on a width x rank grid, each at its own tuned learning rate.

The rule, applied the same way to every method (dense, subspace at rank k, the residual
bottleneck, with AdamW or Muon):

1. **Tune once at the narrowest width.** Sweep the learning rate on a grid of factors of 2
   around ``lr_start`` until the best final validation loss is interior (its two neighbours
   measured and worse). Two seeds end ~1% apart, so lrs within ``SEED_NOISE`` of the best are
   ranked on the mean of two seeds: one seed cannot tell them apart. Under muP, and for the
   subspace model under the standard parametrisation too (the dense model is the same under
   both at ``d = base_width``, and so is the subspace model under ``mup-anchored`` and standard).
2. **Transfer.** At every wider width run the tuned lr under muP (and, with ``anchored``, the
   subspace model under ``mup-anchored``, checked like muP), and under the standard
   parametrisation at its own narrow-width lr as the control (what a user gets by carrying
   a tuned lr over without muP).
3. **Check the transfer** (``check_widths``): a local sweep one grid point each way at the
   wider width, extended like the tuning until its best point is interior; the transfer holds if
   the tuned lr is that best, and meets the goal if it is within one grid point of it; it is
   *tied* if its loss is within ``TIED`` of the best's (a flat optimum the seeds cannot rank).
4. **More seeds** (``extra_seeds``): every method again at its best lr measured at that width
   under muP (and ``mup-anchored``, with ``anchored``) with other seeds (the same tokens, other
   inits and sample order); the table reports the mean over seeds and each seed's gap, since two
   seeds of one variant end ~1% apart here.
5. **Probes** (``probes``): single runs at a width and lr outside the rule (say, where a narrower
   check found the transfer off), reported beside the grid and marked as probes.

Runs are cached one JSON per run under their configuration's hash (:func:`bench.quality.curve`),
so the section resumes where it stopped and a second session extends the grid. Every run trains
the same tokens (seed, sampler) on the single-process pipeline with its real codecs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import coordinate_check, lr_search, scaling_law, scaling_report
from bench.lr_search import LR_FACTOR
from bench.quality import QualityPlan, Variant, curve, loss_at, run_key, steps_to
from swarm.core.config import CodecConfig, ModelConfig, RunConfig, TrainConfig
from swarm.io.data import TokenDataset, load_dataset

TIED = 0.01  # lrs whose scores differ by less than this are level within the seed noise


@dataclass(frozen=True)
class Method:
    """A model-and-boundary family at rank ``k`` (0: dense) with its optimizer."""

    kind: str  # "dense" | "subspace" | "bottleneck"
    rank: int = 0
    optimizer: str = "adamw"

    @property
    def name(self) -> str:
        core = "dense" if self.kind == "dense" else f"{self.kind} k={self.rank}"
        return core if self.optimizer == "adamw" else f"{core} + {self.optimizer}"


Probe = tuple[int, Method, float, str]  # (d, method, lr, parametrisation): a single run off the rule


@dataclass
class ScalingPlan:
    widths: list[int]  # the first is the width the learning rates are tuned at
    ranks: list[int]  # subspace ranks, each run at the widths where k <= d/4
    steps: int
    batch_size: int = 8
    seq_len: int = 128
    n_layers: int = 4
    n_stages: int = 4
    vocab_size: int = 4096
    eval_every: int = 100
    eval_batches: int = 8
    lr_start: float = 4e-3
    seed: int = 0  # the seed every lr is tuned and transferred at
    tie_seed: int = 1  # the second seed of lrs within SEED_NOISE of the best while tuning
    extra_seeds: list[int] = field(default_factory=list)  # rerun at the chosen lrs with these seeds
    probes: list[Probe] = field(default_factory=list)  # single runs off the rule
    check_widths: list[int] = field(default_factory=list)  # widths with a local sweep around the transfer
    control: bool = True  # also run the standard parametrisation at the transferred lr
    anchored: bool = False  # also tune, transfer and check the subspace model under mup-anchored
    optimizers: list[str] = field(default_factory=lambda: ["adamw"])
    contenders: list[tuple[str, str]] = field(default_factory=list)  # (kind, optimizer) beside the grid
    max_width: int = 0  # 0: every width; else skip wider ones (the budget of a session)
    precision: str = "fp32"  # the layers' compute: "fp32" or "bf16" (autocast; a GPU's grid)

    @property
    def run_widths(self) -> list[int]:
        """The widths this session runs (up to ``max_width``)."""
        return [d for d in self.widths if not self.max_width or d <= self.max_width]

    def methods(self, d: int) -> list[Method]:
        """Dense and, at every rank with k <= d/4, the subspace model, per optimizer; then the
        contenders at the same ranks (the same numbers per token), dense contenders once."""
        ranks = [k for k in self.ranks if k <= d // 4]
        grid = [
            Method(kind, k, opt)
            for opt in self.optimizers
            for kind, k in [("dense", 0)] + [("subspace", k) for k in ranks]
        ]
        contenders = [
            Method(kind, k, opt) for kind, opt in self.contenders for k in (ranks if kind != "dense" else [0])
        ]
        return grid + [m for m in contenders if m not in grid]


def width_model(plan: ScalingPlan, d: int, method: Method, parametrisation: str) -> ModelConfig:
    """The grid's model at width ``d``: heads of 64 channels, d_ff ~ 2.69 d (688 at d = 256)."""
    return ModelConfig(
        vocab_size=plan.vocab_size,
        d_model=d,
        n_layers=plan.n_layers,
        n_heads=max(1, d // 64),
        d_ff=round(2.6875 * d / 8) * 8,
        max_seq_len=plan.seq_len,
        subspace_rank=method.rank if method.kind == "subspace" else 0,
        constrain_writes=method.kind == "subspace",
        bottleneck_rank=method.rank if method.kind == "bottleneck" else 0,
        parametrisation=parametrisation,
        base_width=plan.widths[0],
    )


def run_variant(
    plan: ScalingPlan, d: int, method: Method, lr: float, parametrisation: str, seed: int
) -> tuple[Variant, QualityPlan]:
    """One grid point as the quality section's variant and plan (so its curves share the cache format)."""
    model = width_model(plan, d, method, parametrisation)
    codec = CodecConfig(kind="subspace" if method.kind == "subspace" else "identity")
    name = f"d={d} {method.name} lr={lr:.3g} {parametrisation}" + (
        f" seed={seed}" if seed != plan.seed else ""
    )
    train = TrainConfig(
        steps=plan.steps,
        batch_size=plan.batch_size,
        seq_len=plan.seq_len,
        lr=lr,
        optimizer=method.optimizer,
        precision=plan.precision,
        eval_every=plan.eval_every,
        seed=seed,
    )
    quality_plan = QualityPlan(model, train, plan.n_stages, [name], [], eval_batches=plan.eval_batches)
    return Variant(name, model, codec), quality_plan


def runs_under(method: Method, parametrisation: str) -> bool:
    """Whether the grid runs ``method`` under ``parametrisation``: muP for every method, the
    others (standard, mup-anchored) for the subspace model only (its only one they change)."""
    return parametrisation == "mup" or method.kind == "subspace"


def stored_parametrisation(plan: ScalingPlan, d: int, method: Method, parametrisation: str) -> str:
    """The parametrisation a run is trained and cached under: at the base width, one of those that
    build the same model there (bit for bit, tests/test_width.py), so it is trained once."""
    if d != plan.widths[0]:
        return parametrisation
    if method.kind != "subspace":
        return "mup"  # dense and the bottleneck: every parametrisation is the standard model here
    return "standard" if parametrisation == "mup-anchored" else parametrisation


class Grid:
    """The runs of a plan, trained on demand and cached; ``results`` collects what was run."""

    def __init__(
        self,
        plan: ScalingPlan,
        dataset: TokenDataset,
        cache: Path,
        progress: Callable[[str], None],
        cached_only: bool = False,
    ):
        self.plan, self.dataset, self.cache, self.progress = plan, dataset, cache, progress
        self.cached_only = cached_only  # report what was run; train nothing
        self._recorded: dict[str, dict] = {}  # run key -> its entry, in the order first asked for
        self.chosen: dict[tuple, float] = {}  # (d, method name, parametrisation) -> tuned lr
        self.swept: dict[tuple, dict[float, float]] = {}  # the same key -> lr -> the tune's score

    @property
    def results(self) -> list[dict]:
        """One entry per run, in the order first asked for."""
        return list(self._recorded.values())

    def loss(
        self, d: int, method: Method, lr: float, parametrisation: str = "mup", seed: int | None = None
    ) -> float:
        """The final validation loss of one run (inf if it diverged); trains it unless cached
        (NaN for a run not in the cache when ``cached_only``). ``seed``: the plan's unless given."""
        parametrisation = stored_parametrisation(self.plan, d, method, parametrisation)
        seed = self.plan.seed if seed is None else seed
        variant, quality_plan = run_variant(self.plan, d, method, lr, parametrisation, seed)
        key = run_key(variant.config(quality_plan.train, quality_plan.n_stages), quality_plan.eval_batches)
        if key in self._recorded:
            return self._recorded[key]["final"]
        if self.cached_only and not (self.cache / f"{key}.json").exists():
            return math.nan
        t0 = time.perf_counter()
        row = curve(variant, quality_plan, self.dataset, self.cache, self.progress)
        entry = {
            "d": d,
            "method": method.name,
            "kind": method.kind,
            "rank": method.rank,
            "optimizer": method.optimizer,
            "lr": lr,
            "parametrisation": parametrisation,
            "seed": seed,
            "final": row.get("final_val_loss", math.inf),
            "curve": row.get("val_curve", []),
            "compression": row.get("compression_vs_dense_bf16"),
            "seconds": time.perf_counter() - t0,
        }
        self._recorded[key] = entry
        return entry["final"]

    def tune(self, d: int, method: Method, parametrisation: str, start: float | None = None) -> float:
        """The best lr of :func:`bench.lr_search.search` around ``start`` (the plan's ``lr_start``),
        ties ranked with the plan's ``tie_seed``."""
        start = self.plan.lr_start if start is None else start
        best, scores = lr_search.search(
            lambda lr, seed: self.loss(d, method, lr, parametrisation, seed),
            start,
            self.plan.seed,
            self.plan.tie_seed,
            partial=self.cached_only,
        )
        if scores and not lr_search.interior(best, scores) and not self.cached_only:
            self.progress(f"scaling: d={d} {method.name} {parametrisation}: no interior best lr ({scores})")
        if scores and math.isfinite(scores[best]):
            self.chosen[(d, method.name, parametrisation)] = best
            self.swept[(d, method.name, parametrisation)] = scores
        return best

    def best_lr(self, d: int, method: Method, default: float, parametrisation: str = "mup") -> float:
        """The lr :meth:`tune` chose for ``method`` at width ``d`` under ``parametrisation``, else
        ``default``."""
        return self.chosen.get((d, method.name, parametrisation), default)


def tuned_lr(tuned: dict[tuple, float], method: Method, parametrisation: str) -> float:
    """The narrow width's best lr of ``method``; a rank tuned nowhere takes the nearest tuned rank's.
    Only the subspace model differs between the parametrisations at the base width."""
    par = parametrisation if method.kind == "subspace" else "mup"
    same = [k for k in tuned if k[0] == par and k[1] == method.kind and k[3] == method.optimizer]
    return tuned[min(same, key=lambda k: abs(math.log(max(k[2], 1) / max(method.rank, 1))))]


def transfer_check(lr: float, best: float, local: dict[float, float]) -> dict | None:
    """The check of a transferred ``lr`` against a local sweep's ``best`` (``local``: lr -> score);
    None until the neighbours of both were run (a cached-only report of a partial sweep)."""
    around = [x * f for x in (lr, best) for f in (1 / LR_FACTOR, LR_FACTOR)]
    if not all(any(math.isclose(x, m) for m in local) for x in around):
        return None
    transferred = min(v for k, v in local.items() if math.isclose(k, lr))
    return {
        "losses": {str(k): v for k, v in sorted(local.items())},
        "best": best,
        "holds": math.isclose(best, lr),
        "within_one": any(math.isclose(best, lr * f) for f in (1 / LR_FACTOR, 1, LR_FACTOR)),
        "tied": transferred <= local[best] * (1 + TIED),
    }


def run(
    plan: ScalingPlan,
    dataset: TokenDataset,
    cache: Path,
    progress: Callable[[str], None] = print,
    cached_only: bool = False,
) -> dict:
    """Tune at the narrowest width, transfer to the others (muP and the control), check transfers."""
    grid = Grid(plan, dataset, cache, progress, cached_only)
    base = plan.widths[0]
    transferred = ["mup", "mup-anchored"] if plan.anchored else ["mup"]
    parametrisations = transferred + (["standard"] if plan.control else [])
    tuned = {
        (par, m.kind, m.rank, m.optimizer): grid.tune(base, m, par)
        for m in plan.methods(base)
        for par in parametrisations
        if runs_under(m, par)
    }
    transfer = []
    for d in plan.run_widths[1:]:
        for method in plan.methods(d):
            for par in (p for p in transferred if runs_under(method, p)):
                lr = tuned_lr(tuned, method, par)
                grid.loss(d, method, lr, par)
                check = None
                if d in plan.check_widths:
                    best = grid.tune(d, method, par, start=lr)  # until the local best is interior
                    check = transfer_check(lr, best, grid.swept.get((d, method.name, par), {}))
                point = {"d": d, "method": method.name, "parametrisation": par, "lr": lr}
                transfer.append(point | {"check": check})
            if plan.control:
                grid.loss(d, method, tuned_lr(tuned, method, "standard"), "standard")
    for d, method, lr, parametrisation in plan.probes:
        if not plan.max_width or d <= plan.max_width:
            grid.loss(d, method, lr, parametrisation)
    for seed in plan.extra_seeds:
        for d in plan.run_widths:
            for method in plan.methods(d):
                for par in (p for p in transferred if runs_under(method, p)):
                    lr = grid.best_lr(d, method, tuned_lr(tuned, method, par), par)
                    grid.loss(d, method, lr, par, seed)
    return {
        "plan": dataclasses.asdict(plan),
        "tuned": [  # those whose sweep ran (a cached-only report leaves the others at lr_start)
            {"parametrisation": p, "kind": k, "rank": r, "optimizer": o, "lr": lr}
            for (p, k, r, o), lr in tuned.items()
            if (base, Method(k, r, o).name, p) in grid.swept
        ],
        "transfer": transfer,
        "runs": grid.results,
        "table": table(grid.results, plan.steps, plan.seed, grid.chosen, plan.probes),
    }


def table(
    runs: list[dict],
    steps: int,
    base_seed: int = 0,
    chosen: dict | None = None,
    probes: list[Probe] = (),
) -> list[dict]:
    """Per width and parametrisation, each method at its best lr on the rule (``chosen``'s where it
    was tuned there, else the best of the base seed's runs that are not probes), then each probe on
    a row of its own marked ``probe``: loss at equal steps (the mean over the seeds run at that lr),
    gap to dense over the seeds both ran (their summed losses), each seed's gap, and the steps the
    base seed's run needs to reach dense's final loss. Dense is the best dense run at that width
    with the same optimizer (any, where dense did not run with it) under either parametrisation
    (each side at its own best hyperparameters)."""

    def is_probe(r: dict) -> bool:
        point = (r["d"], r["method"], r["parametrisation"])
        return any((pd, m.name, par) == point and math.isclose(lr, r["lr"]) for pd, m, lr, par in probes)

    best: dict[tuple, dict] = {}
    for r in runs:
        if r["seed"] != base_seed:
            continue
        key = (r["d"], r["parametrisation"], r["method"])
        pick = (chosen or {}).get((r["d"], r["method"], r["parametrisation"]))
        if pick is not None and math.isclose(r["lr"], pick):
            best[key] = r
        elif is_probe(r):
            best[(*key, r["lr"])] = r
        elif pick is None and (key not in best or r["final"] < best[key]["final"]):
            best[key] = r
    by_seed: dict[tuple, dict[int, float]] = {}
    for r in runs:
        if math.isfinite(r["final"]):
            point = (r["d"], r["parametrisation"], r["method"], r["lr"])
            by_seed.setdefault(point, {})[r["seed"]] = r["final"]

    def seeds(r: dict) -> dict[int, float]:
        return by_seed.get((r["d"], r["parametrisation"], r["method"], r["lr"]), {})

    def mean(r: dict) -> float:
        finals = seeds(r)
        return sum(finals.values()) / len(finals) if finals else r["final"]

    rows = []

    def order(item: tuple[tuple, dict]) -> tuple:
        key, r = item
        return key[0], len(key), key[1], r["rank"], r["lr"]  # per width: the rule's rows, then probes

    for key, r in sorted(best.items(), key=order):
        d, par, name = key[:3]
        denses = [x for k, x in best.items() if k[0] == d and len(k) == 3 and x["kind"] == "dense"]
        same = [x for x in denses if x["optimizer"] == r["optimizer"]]
        dense = min(same or denses, key=mean, default=None)  # the best dense on the rule, same optimizer
        row = {
            "d": d,
            "parametrisation": par,
            "method": name,
            "kind": r["kind"],
            "rank": r["rank"],
            "optimizer": r["optimizer"],
            "lr": r["lr"],
            "probe": len(key) > 3,
            "loss": mean(r),
            "seeds": len(seeds(r)) or 1,
            "compression": r["compression"],
        }
        if dense is not None and r["curve"]:
            both = sorted(set(seeds(r)) & set(seeds(dense)))  # the gap compares the same seeds
            row["dense_optimizer"] = dense["optimizer"]
            row["seed_gaps"] = [seeds(r)[s] / seeds(dense)[s] - 1 for s in both]
            row["gap"] = (
                sum(seeds(r)[s] for s in both) / sum(seeds(dense)[s] for s in both) - 1
                if both
                else mean(r) / mean(dense) - 1
            )
            reached = steps_to(r["curve"], dense["final"])
            row["steps_to_dense"] = reached / steps if reached is not None else None
            row["loss_at_half"] = loss_at(r["curve"], steps // 2)
        rows.append(row)
    return rows


def coordinate(plan: ScalingPlan, dataset: TokenDataset, steps: int = 4) -> dict:
    """The coordinate check over the plan's widths (up to ``max_width``), standard vs muP (and, with
    ``anchored``, the subspace model under ``mup-anchored``), for dense and the subspace model at
    the plan's smallest rank, all at ``lr_start``."""
    widths = plan.run_widths
    methods = [Method("dense"), Method("subspace", min(plan.ranks))]
    parametrisations = ("standard", "mup", "mup-anchored") if plan.anchored else ("standard", "mup")
    configs = {
        (m.name, par, d): coordinate_check.check_config(
            width_model(plan, d, m, par),
            plan.lr_start,
            plan.batch_size,
            plan.seq_len,
            plan.n_stages,
            m.kind == "subspace",
        )
        for m in methods
        for par in parametrisations
        if par != "mup-anchored" or m.kind == "subspace"  # dense: the same model as under mup
        for d in widths
    }
    return coordinate_check.run(configs, dataset, steps)


def _coordinate_order(path: Path) -> tuple[int, bool]:
    """A kept coordinate check's number of widths, then whether it covers mup-anchored."""
    parts = path.stem.split("-")[2:]
    return sum(p.isdigit() for p in parts), "anchored" in parts


def coordinate_file(plan: ScalingPlan, cache: Path) -> Path:
    """Where the coordinate check of ``plan``'s widths (and parametrisations) is kept."""
    widths = "-".join(map(str, plan.run_widths))
    return cache / f"coordinate-check-{widths}{'-anchored' if plan.anchored else ''}.json"


def law_summary(runs: list[dict], steps: int) -> dict:
    """The gap law fitted on the subspace runs, its leave-out check and its predictions."""
    pts = scaling_law.points(runs)
    try:
        law, left_out = scaling_law.check(pts)
    except ValueError as e:
        return {"error": str(e)}
    predictions = []
    for d in (2048, 4096):
        for k in (20, 40, 80):
            gap, sd = law.predict(d, k, steps)
            predictions.append({"d": d, "k": k, "steps": steps, "gap": gap, "uncertainty": sd})
    return {
        "formula": law.formula(),
        "alpha": scaling_law.dense_exponent(runs),
        "coef": law.coef,
        "sigma": law.sigma,
        "loo_error": law.loo_error,
        "points": len(pts),
        "grid_points": len({(p.d, p.k) for p in pts}),
        "left_out": left_out,
        "predictions": predictions,
    }


def full(
    plan: ScalingPlan,
    dataset: TokenDataset,
    cache: Path,
    progress: Callable[[str], None] = print,
    cached_only: bool = False,
) -> dict:
    """The section: the grid (:func:`run`), the coordinate check (kept in ``cache`` once run) and the law."""
    result = run(plan, dataset, cache, progress, cached_only)
    widths = plan.run_widths
    saved = coordinate_file(plan, cache)
    kept = sorted(cache.glob("coordinate-check-*.json"), key=_coordinate_order)  # the widest last
    if saved.exists() or (cached_only and kept):
        result["coordinate"] = json.loads((saved if saved.exists() else kept[-1]).read_text())
    elif not cached_only:
        progress("scaling: coordinate check")
        result["coordinate"] = {"widths": widths, **coordinate(plan, dataset)}
        cache.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(result["coordinate"]))
    # the law fits the table's runs on the rule: each point at the lr its rule chose (its seeds'
    # mean), not a sweep's luckiest seed nor a probe
    chosen = {
        (row["d"], row["parametrisation"], row["method"], row["lr"])
        for row in result["table"]
        if not row["probe"]
    }
    on_rule = {
        optimizer: [
            r
            for r in result["runs"]
            if r["optimizer"] == optimizer and (r["d"], r["parametrisation"], r["method"], r["lr"]) in chosen
        ]
        for optimizer in {*plan.optimizers, *(opt for _, opt in plan.contenders)}
    }
    result["law"] = law_summary(on_rule[plan.optimizers[0]], plan.steps)  # the grid's first optimizer's
    if "coef" in result["law"]:
        shape = {"n_layers": plan.n_layers, "vocab_size": plan.vocab_size}
        measured = measured_points(result["table"])
        alphas = {}  # steps to dense's loss with each optimizer use its own dense's exponent
        for optimizer, runs in on_rule.items():
            try:
                alphas[optimizer] = scaling_law.dense_exponent(runs)
            except ValueError:  # no dense curve with this optimizer (none ran, or all diverged)
                continue
        result["law"] |= {
            "steps": plan.steps,
            "shape": shape,
            "optimizer": plan.optimizers[0],
            "alphas": alphas,
            "measured": measured,
        }
    return result


def measured_points(table: list[dict]) -> list[dict]:
    """Per width, rank and optimizer, the subspace model's row on the rule with the smallest gap
    (any parametrisation; against dense with that optimizer, where it ran): what ``swarm plan``
    quotes at the widths the grid ran instead of the law. Diverged rows (no gap) are left out."""
    best: dict[tuple[int, int, str], dict] = {}
    for row in table:
        if row["kind"] != "subspace" or row["probe"] or row.get("dense_optimizer") != row["optimizer"]:
            continue  # a probe, a diverged row (no gap), or one measured against another optimizer's dense
        key = (row["d"], row["rank"], row["optimizer"])
        if key not in best or row["gap"] < best[key]["gap"]:
            best[key] = row
    return [
        {
            "d": d,
            "rank": k,
            "optimizer": optimizer,
            "parametrisation": row["parametrisation"],
            "lr": row["lr"],
            "gap": row["gap"],
            "seed_gaps": row["seed_gaps"],
        }
        for (d, k, optimizer), row in sorted(best.items())
    ]


def full_plan() -> ScalingPlan:
    return ScalingPlan(
        widths=[128, 256, 512, 1024], ranks=[8, 16, 32, 64], steps=1000, check_widths=[256, 512]
    )


def quick_plan() -> ScalingPlan:
    """A tiny grid for CI: two widths, one rank, a few steps (checks the machinery, not the law)."""
    return ScalingPlan(
        widths=[32, 64],
        ranks=[4],
        steps=8,
        batch_size=2,
        seq_len=16,
        n_layers=2,
        n_stages=2,
        vocab_size=512,
        eval_every=4,
        eval_batches=1,
        lr_start=0.1,  # near the tiny models' best, so the sweep stays short
        check_widths=[64],
        control=False,
        anchored=True,
    )


def parse_probe(text: str) -> Probe:
    """``d:kind:rank:lr[:parametrisation]`` (AdamW; muP unless named) as a plan's probe."""
    d, kind, rank, lr, *parametrisation = text.split(":")
    return int(d), Method(kind, int(rank)), float(lr), parametrisation[0] if parametrisation else "mup"


def build_parser() -> argparse.ArgumentParser:
    """The section's command line (``python -m bench.scaling``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument(
        "--max-width", type=int, default=0, help="skip widths above this (a session's budget)"
    )
    parser.add_argument(
        "--widths", default="", help="comma-separated widths, the first tuned (default: the plan's)"
    )
    parser.add_argument(
        "--check-widths", default=None, help="widths with a local lr sweep (default: the plan's)"
    )
    parser.add_argument(
        "--no-control", action="store_true", help="skip the standard parametrisation's control"
    )
    parser.add_argument(
        "--anchored",
        action="store_true",
        help="also transfer and check the subspace model under mup-anchored",
    )
    parser.add_argument("--cached-only", action="store_true", help="report the cached runs; train nothing")
    parser.add_argument("--law-out", help="also write the fitted law here (swarm plan's law file)")
    parser.add_argument("--precision", default="fp32", help="fp32, or bf16 (autocast, on a GPU)")
    parser.add_argument("--optimizers", default="adamw")
    parser.add_argument("--ranks", default="", help="comma-separated ranks (default: the plan's)")
    parser.add_argument(
        "--extra-seeds", default="", help="comma-separated seeds to rerun every method at its chosen lr"
    )
    parser.add_argument(
        "--probes",
        default="",
        help="d:kind:rank:lr[:parametrisation],... runs off the rule, e.g. 1024:subspace:16:0.001",
    )
    parser.add_argument(
        "--contenders", default="", help="kind:optimizer,... e.g. bottleneck:adamw,dense:muon"
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    plan = quick_plan() if args.quick else full_plan()
    plan.max_width = args.max_width
    plan.optimizers = args.optimizers.split(",")
    if args.widths:
        plan.widths = [int(d) for d in args.widths.split(",")]
    if args.check_widths is not None:
        plan.check_widths = [int(d) for d in args.check_widths.split(",") if d]
    plan.precision = args.precision
    if args.no_control:
        plan.control = False
    if args.anchored:
        plan.anchored = True
    if args.ranks:
        plan.ranks = [int(k) for k in args.ranks.split(",")]
    if args.extra_seeds:
        plan.extra_seeds = [int(s) for s in args.extra_seeds.split(",")]
    if args.probes:
        plan.probes = [parse_probe(p) for p in args.probes.split(",")]
    if args.contenders:
        plan.contenders = [tuple(c.split(":")) for c in args.contenders.split(",")]
    out = Path(args.out)
    dataset = load_dataset(RunConfig(model=ModelConfig(vocab_size=plan.vocab_size), n_stages=1))
    result = full(
        plan,
        dataset,
        out / "scaling-runs",
        progress=lambda s: print(time.strftime("%H:%M:%S"), s, flush=True),
        cached_only=args.cached_only,
    )
    result["threads"] = torch.get_num_threads()
    (out / "scaling.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "scaling.md").write_text("\n".join(scaling_report.section({"scaling": result})) + "\n")
    scaling_report.plots({"scaling": result}, out)
    if args.law_out and "coef" in result["law"]:
        law = result["law"] | {
            "source": f"bench.scaling on {time.strftime('%Y-%m-%d')}, widths {plan.widths}"
        }
        Path(args.law_out).write_text(json.dumps(law, indent=2) + "\n")


if __name__ == "__main__":
    main()
