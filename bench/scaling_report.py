"""The ``scaling`` section's report: Markdown tables and plots of :func:`bench.scaling.full`'s result."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.lr_search import LR_FACTOR, SEED_NOISE

LAW_GOAL = 0.01  # the goal for the law's leave-out error: 1 point of gap


def best_gaps(table: list[dict]) -> dict[tuple[str, int], dict]:
    """(method, d) -> the table row of the lowest loss at that point under any parametrisation run
    on the rule (probes are not); a method names its optimizer unless it is AdamW."""
    best: dict[tuple[str, int], dict] = {}
    for row in table:
        key = (row["method"], row["d"])
        if "gap" in row and not row.get("probe") and (key not in best or row["loss"] < best[key]["loss"]):
            best[key] = row
    return best


def _methods(rows: list[dict], compressed: bool = True) -> list[str]:
    """The rows' methods, by kind, rank and optimizer (without dense's when ``compressed``)."""
    order = {r["method"]: (r["kind"], r["rank"], r["method"]) for r in rows}
    return sorted((m for m, r in order.items() if not compressed or r[0] != "dense"), key=order.get)


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:+.1f}%"


def _gap_cell(row: dict) -> str:
    """The gap, with each seed's where more than one was run."""
    per_seed = row.get("seed_gaps", [])
    if len(per_seed) < 2:
        return _pct(row["gap"])
    return f"{_pct(row['gap'])} ({', '.join(_pct(g) for g in per_seed)})"


def _times(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.2f}x"


def section(r: dict) -> list[str]:
    """The ``scaling`` results as Markdown lines (nothing when the section did not run)."""
    if "scaling" not in r:
        return []
    s = r["scaling"]
    widths = sorted({row["d"] for row in s["table"]})
    best = best_gaps(s["table"])
    out = [
        "## Quality as models widen (scaling)",
        "",
        f"{s['plan']['steps']} steps of batch {s['plan']['batch_size']} x {s['plan']['seq_len']}, "
        f"{s['plan']['n_layers']} layers in {s['plan']['n_stages']} stages, heads of 64, d_ff ~2.69 d; "
        f"learning rates tuned at d = {s['plan']['widths'][0]} on a factor-{LR_FACTOR:g} grid (best point "
        f"interior; lrs within {100 * SEED_NOISE:g}% of the best ranked on the mean of two seeds), then "
        "transferred. Gap: final "
        "validation loss over the best dense run's at that width with the same optimizer "
        "(either parametrisation), each at its own best lr. Two runs differing only in seed often end "
        "~1% apart, so a gap under ~2 points decides nothing on one seed: where a point was rerun with "
        "more seeds at the same lr, the gap is that of the mean losses, each seed's gap in brackets.",
        "",
        *(
            [
                "Under `mup-anchored` the subspace model at the base width is the standard one (bit for "
                "bit): its sweep there is the standard rows'.",
                "",
            ]
            if s["plan"].get("anchored")
            else []
        ),
        "Tuned at the base width:",
        "",
        "| parametrisation | method | lr |",
        "|---|---|---|",
        *(
            f"| {t['parametrisation']} | {t['kind']} k={t['rank']} {t['optimizer']} | {t['lr']:.3g} |"
            for t in s["tuned"]
        ),
        "",
        "Gap to dense (the best parametrisation run on the rule at each point, probes not counted; "
        "`-`: not run; the heatmap of `scaling.png`):",
        "",
        "| method | " + " | ".join(f"d={d}" for d in widths) + " |",
        "|---|" + "---|" * len(widths),
    ]
    for method in _methods(list(best.values())):
        cells = [_gap_cell(best[(method, d)]) if (method, d) in best else "-" for d in widths]
        out.append(f"| {method} | " + " | ".join(cells) + " |")
    out += ["", "The same per parametrisation:", "", *_per_parametrisation(s["table"], widths)]
    out += [
        "",
        "Each method at its best lr measured at that width (the transferred one, the best of a local "
        "sweep, or a probe: a single run off the rule, its lr marked *):",
        "",
        "| d | parametrisation | method | lr | seeds | loss (mean) | gap | steps to dense's loss |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {row['d']} | {row['parametrisation']} | {row['method']} | "
            f"{row['lr']:.3g}{'*' if row.get('probe') else ''} | "
            f"{row.get('seeds', 1)} | {row['loss']:.3f} | {_pct(row.get('gap'))} | "
            f"{_times(row.get('steps_to_dense'))} |"
            for row in s["table"]
        ),
        "",
        "Transfer checks (a local sweep at a wider width from one grid point each way of the "
        "transferred lr, extended until its best point is interior; goal: the transferred lr within "
        "one grid point of the local best; tied: its loss within 1% of the best's, level within "
        "the seed noise):",
        "",
        "| d | parametrisation | method | transferred lr | local losses (lr: loss; two seeds' mean "
        "within 2% of the best) | local best | holds | within one | tied |",
        "|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {t['d']} | {t.get('parametrisation', 'mup')} | {t['method']} | {t['lr']:.3g} | "
            f"{', '.join(f'{float(k):.3g}: {v:.3f}' for k, v in t['check']['losses'].items())} | "
            f"{t['check'].get('best', float('nan')):.3g} | {t['check']['holds']} | "
            f"{t['check'].get('within_one', '-')} | {t['check'].get('tied', '-')} |"
            for t in s["transfer"]
            if t["check"]
        ),
        "",
        *_coordinate_lines(s.get("coordinate")),
        *_law_lines(s.get("law")),
    ]
    return out


def _per_parametrisation(table: list[dict], widths: list[int]) -> list[str]:
    """The gap table with a row per method and parametrisation (the rule's runs, no probes)."""
    ruled = [row for row in table if "gap" in row and not row.get("probe") and row["kind"] != "dense"]
    rows: dict[tuple[str, str], dict[int, dict]] = {}
    for row in ruled:
        rows.setdefault((row["method"], row["parametrisation"]), {})[row["d"]] = row
    lines = [
        "| method | parametrisation | " + " | ".join(f"d={d}" for d in widths) + " |",
        "|---|---|" + "---|" * len(widths),
    ]
    for method in _methods(ruled):
        for par in sorted(p for m, p in rows if m == method):
            by_width = rows[(method, par)]
            cells = [_gap_cell(by_width[d]) if d in by_width else "-" for d in widths]
            lines.append(f"| {method} | {par} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _coordinate_lines(c: dict | None) -> list[str]:
    if not c:
        return []
    return [
        "Coordinate check: each quantity's exponent in d (log-log slope over the widths) after the "
        "check's steps; ~0 is width-stable.",
        "",
        "| method | parametrisation | writes | logits | writes moved | logits moved |",
        "|---|---|---|---|---|---|",
        *(
            f"| {e['method']} | {e['parametrisation']} | {e['writes']:+.2f} | {e['logits']:+.2f} | "
            f"{e['writes_moved']:+.2f} | {e['logits_moved']:+.2f} |"
            for e in c["exponents"]
        ),
        "",
    ]


def _law_lines(law: dict | None) -> list[str]:
    if not law:
        return []
    if "error" in law:
        return [f"Law: not fitted ({law['error']}).", ""]
    return [
        f"Law (subspace, {law['points']} points from {law['grid_points']} grid points): "
        f"`{law['formula']}`; residual sd {100 * law['sigma']:.2f} points; "
        f"leave-one-grid-point-out error at most {100 * law['loo_error']:.2f} points "
        f"(goal: {100 * LAW_GOAL:g}).",
        "",
        *_noise_lines(law["left_out"]),
        "| left out | gap | predicted | the gap's standard error (seeds) |",
        "|---|---|---|---|",
        *(
            f"| d={x['d']} k={x['k']} | {_pct(x['gap'])} | {_pct(x['predicted'])} | {_se(x)} |"
            for x in law["left_out"]
        ),
        "",
        "Extrapolated (far outside the grid; the uncertainty is one sd, at least the leave-out error):",
        "",
        "| d | k | steps | predicted gap |",
        "|---|---|---|---|",
        *(
            f"| {p['d']} | {p['k']} | {p['steps']} | {_pct(p['gap'])} ± {100 * p['uncertainty']:.1f} |"
            for p in law["predictions"]
        ),
        "",
        *_exponent_lines(law.get("alphas", {})),
    ]


def _noise_lines(left_out: list[dict]) -> list[str]:
    """How closely the measurements themselves pin the gaps down: the floor under the leave-out error."""
    errors = [x["standard_error"] for x in left_out if x.get("standard_error") is not None]
    if not errors:
        return []
    coarse = sum(e > LAW_GOAL for e in errors)
    return [
        f"The measured gaps are uncertain themselves: their standard error from the seeds' spread is "
        f"{100 * statistics.median(errors):.1f} points at the median grid point, {100 * max(errors):.1f} at "
        f"the worst; {coarse} of the {len(errors)} points with two seeds are measured more coarsely than "
        f"the goal's {100 * LAW_GOAL:g} point (one-seed points: {len(left_out) - len(errors)}).",
        "",
    ]


def _se(row: dict) -> str:
    se = row.get("standard_error")
    return f"{100 * se:.1f} points" if se is not None else "one seed"


def _exponent_lines(alphas: dict[str, float]) -> list[str]:
    """Dense's loss-vs-steps exponent per optimizer: how `swarm plan` turns a gap into steps."""
    if not alphas:
        return []
    each = ", ".join(f"{optimizer} {alpha:.3f}" for optimizer, alpha in sorted(alphas.items()))
    return [
        f"Dense's loss ~ steps^-alpha from its best runs (`swarm plan` turns a gap g into (1 + g)^(1/alpha) "
        f"times the steps, with the optimizer's own alpha): {each}.",
        "",
    ]


def plots(r: dict, out: Path) -> None:
    """``scaling.png``: loss against width per method, the gap heatmap, and the coordinate check."""
    if "scaling" not in r:
        return
    s = r["scaling"]
    best = best_gaps(s["table"])
    widths = sorted({d for _, d in best})
    fig, (loss_ax, heat_ax, coord_ax) = plt.subplots(1, 3, figsize=(18, 5))
    for method in _methods(list(best.values()), compressed=False):
        xs = [d for d in widths if (method, d) in best]
        loss_ax.plot(xs, [best[(method, d)]["loss"] for d in xs], marker="o", label=method)
    loss_ax.set_xscale("log", base=2)
    loss_ax.set_xlabel("d_model")
    loss_ax.set_ylabel("final validation loss (best lr)")
    loss_ax.legend(fontsize=7)
    compressed = _methods(list(best.values()))
    grid = [[best[(m, d)]["gap"] * 100 if (m, d) in best else math.nan for d in widths] for m in compressed]
    if compressed:
        image = heat_ax.imshow(grid, cmap="RdYlGn_r", vmin=-5, vmax=10, aspect="auto")
        heat_ax.set_xticks(range(len(widths)), [str(d) for d in widths])
        heat_ax.set_yticks(range(len(compressed)), compressed, fontsize=7)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if math.isfinite(v):
                    heat_ax.text(j, i, f"{v:+.1f}", ha="center", va="center", fontsize=7)
        fig.colorbar(image, ax=heat_ax, label="gap to dense (%)")
    heat_ax.set_title("gap to dense, width x rank")
    c = s.get("coordinate")
    if c:
        for method, par in sorted({(x["method"], x["parametrisation"]) for x in c["rows"]}):
            last = max(x["step"] for x in c["rows"])
            rows = sorted(
                (
                    x
                    for x in c["rows"]
                    if (x["method"], x["parametrisation"], x["step"]) == (method, par, last)
                ),
                key=lambda x: x["d"],
            )
            coord_ax.plot(
                [x["d"] for x in rows], [x["logits_moved"] for x in rows], marker="o", label=f"{method} {par}"
            )
        coord_ax.set_xscale("log", base=2)
        coord_ax.set_yscale("log")
        coord_ax.set_xlabel("d_model")
        coord_ax.set_ylabel("RMS change of the logits after the check's steps")
        coord_ax.set_title("coordinate check")
        coord_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=120)
    plt.close(fig)
