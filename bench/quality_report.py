"""The quality section as Markdown tables and PNG plots (loss against steps, and against time per link)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.quality import loss_at

GOAL_NOTE = (
    "Goals (issue 20): at >= 60x, loss at equal steps within 3% of dense and dense's final loss reached "
    "at 80 Mbit/s / 50 ms RTT at least 10x sooner than dense with H200 compute; at >= 100x, at most 1.5x "
    "dense's steps to its mid-run loss."
)


def _steps(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.0f}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    if value >= 3600:
        return f"{value / 3600:.1f} h"
    return f"{value:.0f} s" if value >= 10 else f"{value:.2f} s"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}x"


def section(r: dict) -> list[str]:
    """The ``quality`` results as Markdown lines (nothing when the section did not run)."""
    if "quality" not in r:
        return []
    q = r["quality"]
    rows, links = q["rows"], [link["name"] for link in q["links"]]
    steps = rows[0]["val_curve"][-1][0]
    mid, end = steps // 2, steps
    out = [
        "## Quality at high compression: time to dense's loss",
        f"Validation loss every few steps over {steps} steps; targets are dense bf16's validation loss at "
        "25%, 50% and 100% of its run. Gap = loss / dense's loss - 1 at equal steps; trend compares the "
        "gap at mid-run and at the end; off-subspace = ||(I-P)G|| / ||G|| of the boundary gradients over "
        "the last evaluation interval (the part of the gradient the subspace cannot follow). " + GOAL_NOTE,
        "",
        "| variant | params | B/token fwd+bwd | vs dense bf16 | loss @mid | gap @mid | loss @end | gap @end "
        "| trend | steps to 25% / 50% / 100% target | vs dense | off-subspace @end |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        gaps, t = row["gap_vs_dense"], row["targets"]
        reached = " / ".join(_steps(t[f]["steps"]) for f in ("0.25", "0.5", "1.0"))
        ratios = " / ".join(_ratio(t[f]["steps_vs_dense"]) for f in ("0.25", "0.5", "1.0"))
        curve = row["val_curve"]
        out.append(
            f"| {_name(row)} | {row['parameters'] / 1e6:.2f}M | {row['wire_B_per_token']:.1f} "
            f"| {row['compression_vs_dense_bf16']:.0f}x | {loss_at(curve, mid):.3f} | {_gap(gaps, mid)} "
            f"| {loss_at(curve, end):.3f} | {_gap(gaps, end)} | {row['gap_trend']} | {reached} | {ratios} "
            f"| {_off(row.get('off_subspace_curve'))} |"
        )
    swept = [row for row in rows if row.get("lr_sweep")]
    if swept:
        sweeps = "; ".join(
            f"{row['variant']}: " + ", ".join(f"{lr}: {loss:.3f}" for lr, loss in row["lr_sweep"].items())
            for row in swept
        )
        tuning = q.get("tuning", {})
        ties = (
            f"; lrs within {100 * tuning['seed_noise']:g}% of the best ranked on the mean with seed "
            f"{tuning['tie_seed']}"
            if tuning.get("tie_seed") is not None
            else "; one seed"
        )
        confirm = tuning.get("confirm_seeds")
        if confirm:
            ties += f"; every variant's lr then run on seed {', '.join(map(str, confirm))} too"
        edges = [row["variant"] for row in swept if not row.get("lr_interior", True)]
        out += [
            "",
            f"Each variant at its own learning rate: the best of a factor-{tuning.get('factor', 2):g} sweep "
            f"extended until the best has worse neighbours (`bench/lr_search.py`{ties}). "
            f"Final losses per lr: {sweeps}."
            + (f" No interior best (an edge of the sweep): {', '.join(edges)}." if edges else ""),
        ]
    if any(len(row.get("seed_finals", {})) > 1 for row in rows):
        out += ["", *_seed_lines(rows)]
    levers = [row for row in rows if row["lever"]]
    if levers:
        out += ["", "Levers: " + "; ".join(f"{row['variant']}: {row['lever']}" for row in levers) + "."]
    for row in q.get("diverged", []):
        out += ["", f"Diverged (no curve): {row['variant']}: {row['diverged']}."]
    out += [
        "",
        "Time to dense's loss at 50% and at 100% of its run: `swarm` = steps x the variant's median step "
        "time measured on a local swarm on that link (this machine's CPU compute); `H200 est.` = steps x "
        "an analytic step of the 2B, 8-stage model with the measured H200 profile "
        f"(`{q['profile']}`) whose boundaries shrink by the variant's ratio — an estimate, not a run.",
        "",
        "| variant | " + " | ".join(f"{link} swarm | {link} H200 est." for link in links) + " |",
        "|---|" + "---|---|" * len(links),
    ]
    for row in rows:
        cells = []
        for link in links:
            for setting in ("swarm", "paper_h200_estimate"):
                cells.append(" / ".join(_time_to(row["targets"][f], link, setting) for f in ("0.5", "1.0")))
        out.append(f"| {row['variant']} | " + " | ".join(cells) + " |")
    note = "(each cell: to the 50% / the 100% target; in parentheses: how much sooner than dense)"
    return [*out, "", note, ""]


def _seed_lines(rows: list[dict]) -> list[str]:
    """Final losses over every seed each variant ran at its lr, and the gap of their means to dense's
    over the seeds both ran (the table above is the first seed's run; one seed's gap can be off by a
    point or two)."""
    dense = _finals(rows[0])
    out = [
        "Final loss over the seeds run at each variant's lr; the gap compares means over the seeds "
        "both it and dense ran:",
        "",
        "| variant | seeds | final losses | mean | gap of the means |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        finals = _finals(row)
        shared = [s for s in finals.keys() & dense.keys() if math.isfinite(finals[s] + dense[s])]
        mean = sum(finals.values()) / len(finals)
        gap = sum(finals[s] for s in shared) / sum(dense[s] for s in shared) - 1 if shared else None
        seeds = ", ".join(sorted(finals))
        losses = ", ".join(f"{loss:.3f}" for _, loss in sorted(finals.items()))
        gap_text = f"{gap:+.1%}" if gap is not None else "—"
        out.append(f"| {_name(row)} | {seeds} | {losses} | {mean:.3f} | {gap_text} |")
    return out


def _finals(row: dict) -> dict[str, float]:
    """Seed -> final loss at the row's lr (the plan's seed alone where the row was not tuned)."""
    return row.get("seed_finals") or {"0": row["final_val_loss"]}


def _name(row: dict) -> str:
    """The variant's name, with the lr it was tuned to where it was."""
    return f"{row['variant']} (lr {row['lr']:.3g})" if "lr" in row else row["variant"]


def _time_to(target: dict, link: str, setting: str) -> str:
    seconds, speedup = target["seconds"][link][setting], target["speedup_vs_dense"][link][setting]
    return f"{_seconds(seconds)} ({_ratio(speedup)})" if seconds is not None else "not reached"


def _off(curve: list | None) -> str:
    """The boundary gradients' off-subspace fraction over the run's last evaluation interval."""
    return f"{curve[-1][1]:.2f}" if curve else "—"


def _gap(gaps: dict, step: int) -> str:
    key = min(gaps, key=lambda s: abs(int(s) - step))
    return f"{gaps[key]:+.1%}"


def plots(r: dict, out: Path) -> None:
    """``quality.png``: validation loss against steps, and against time on each link."""
    if "quality" not in r:
        return
    q = r["quality"]
    links = [link["name"] for link in q["links"]]
    fig, axes = plt.subplots(1, 1 + len(links), figsize=(6 * (1 + len(links)), 5), squeeze=False)
    for i, row in enumerate(q["rows"]):
        steps, losses = zip(*row["val_curve"], strict=True)
        label = f"{row['variant']} ({row['compression_vs_dense_bf16']:.0f}x)"
        # dense in black; the others 20 distinct colours, dashed after the first ten
        style = {"color": "black", "linewidth": 2} if i == 0 else {"color": plt.cm.tab20((i - 1) % 20)}
        style["linestyle"] = "--" if i > 10 else "-"
        axes[0][0].plot(steps, losses, label=label, **style)
        for ax, link in zip(axes[0][1:], links, strict=True):
            step_s = row.get("step_seconds", {}).get(link)
            if step_s:
                ax.plot([s * step_s / 3600 for s in steps], losses, label=label, **style)
    dense = q["rows"][0]["val_curve"]
    lowest = min(loss for row in q["rows"] for _, loss in row["val_curve"])
    top = loss_at(dense, dense[-1][0] // 10) + 1.0  # the start of training is off the chart
    for ax in axes[0]:
        ax.set_ylim(lowest - 0.05, top)
    axes[0][0].set_xlabel("step")
    axes[0][0].set_title("validation loss at equal steps")
    for ax, link in zip(axes[0][1:], links, strict=True):
        ax.set_xlabel("hours on a local swarm (measured step time)")
        ax.set_title(f"validation loss against time, {link}")
    for ax in axes[0]:
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "quality.png", dpi=120)
    plt.close(fig)
