"""Turn benchmark results into Markdown tables and PNG plots."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import data as data_bench
from bench import quality_report, scaling_report, state, verification


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """``columns``: (header, key, format spec)."""
    head = "| " + " | ".join(h for h, _, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = []
    for row in rows:
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            cells.append("—" if value is None else format(value, fmt) if fmt else str(value))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])


def markdown(r: dict) -> str:
    m, w = r["machine"], r["wire"]
    ps = w["paper_setting"]
    refs = "\n".join(f"- {k}: {v} B" for k, v in w["reference_rows"].items())
    out = [
        f"# Benchmarks ({'quick' if r['quick'] else 'full'} run)",
        f"{m['date']} on {m['platform']}, {m['cpu_count']} CPUs, torch {m['torch']}, CUDA {m['cuda']}."
        + (
            " Rerun since, on "
            f"{r['rerun']['platform']} ({r['rerun']['cpu_count']} CPUs): "
            + ", ".join(f"{name} {date}" for name, date in r["rerun"]["sections"].items())
            + "."
            if "rerun" in r
            else ""
        ),
        "",
        f"## Wire bytes per token per boundary, d={ps['d']}, k={ps['k']} (synthetic coordinates)",
        "Serialized `StageMessage` bytes (protobuf framing included) of one frame of "
        f"{ps['tokens_per_frame']} tokens; token ids are uint16.",
        refs,
        "",
        _table(
            w["paper"],
            [
                ("codec", "codec", ""),
                ("forward B/token", "forward_B_per_token", ".1f"),
                ("backward B/token", "backward_B_per_token", ".1f"),
                ("forward vs bf16", "forward_ratio_vs_bf16", ".1f"),
            ],
        ),
        "",
        f"## Wire bytes per token per boundary, the benchmark model (d={w['model']['config']['d_model']}, "
        f"k={w['model']['config']['subspace_rank']}, real activations)",
        "Per-step boundary state (MAPL gradient shares, RVQ codebook deltas) is amortised over a step.",
        "",
        _table(
            w["measured"],
            [
                ("codec", "codec", ""),
                ("forward B/token", "forward_B_per_token", ".1f"),
                ("backward B/token", "backward_B_per_token", ".1f"),
                ("sync B/token", "sync_B_per_token", ".1f"),
                ("forward vs bf16", "forward_ratio_vs_bf16", ".1f"),
            ],
        ),
        "",
        "## Convergence at equal steps (single-process pipeline, real codecs at every boundary)",
        "",
        _table(
            r["convergence"],
            [
                ("codec", "codec", ""),
                ("wire B/token", "wire_B_per_token", ".1f"),
                ("vs bf16", "compression_vs_bf16", ".1f"),
                ("val loss start", "initial_val_loss", ".3f"),
                ("val loss end", "final_val_loss", ".3f"),
                ("train loss (last 10)", "final_train_loss_avg10", ".3f"),
            ],
        ),
        "",
        "## Codec overhead (encode + decode of one microbatch's activation and gradient frames)",
        "",
        _table(
            r["overhead"],
            [
                ("codec", "codec", ""),
                ("codec µs/token", "codec_us_per_token", ".2f"),
                ("stage fwd+bwd µs/token", "stage_us_per_token", ".1f"),
                ("overhead", "overhead_fraction", ".1%"),
            ],
        ),
        "",
        "## Throughput of a local swarm on emulated links",
        "`netns+tbf`: every node in its own network namespace behind a `tc tbf` access link of that rate "
        "(full duplex); `transport`: the transport's shaper. One-way delay always comes from the transport "
        "shaper (no netem in this kernel). Bound: min(compute-only tokens/s, link rate / B per token on "
        "the busiest uplink), where a middle node's uplink carries activations and gradients.",
        "",
        _table(
            r["throughput"],
            [
                ("link", "link", ""),
                ("shaper", "shaper", ""),
                ("codec", "codec", ""),
                ("tokens/s", "tokens_per_s", ".0f"),
                ("speedup vs dense bf16", "speedup_vs_dense_bf16", ".2f"),
                ("wire fwd B/token", "wire_forward_B_per_token", ".1f"),
                ("busiest uplink B/token", "busiest_uplink_B_per_token", ".1f"),
                ("bound tokens/s", "physical_bound_tokens_per_s", ".0f"),
                ("efficiency", "efficiency", ".0%"),
            ],
        ),
        "",
        *_peer_section(r),
        *_paper_scale_section(r.get("paper_scale"), "Paper scale with emulated compute"),
        *(
            line
            for ps in r.get("gpu_scale", [])
            for line in _paper_scale_section(ps, "Paper-size models on a measured GPU's compute")
        ),
        *_churn_section(r),
        *_multihost_section(r),
        *_generation_section(r),
        *_averaging_section(r),
        *_replicas_section(r),
        *_replica_sync_section(r),
        *_wan_replicas_section(r),
        *quality_report.section(r),
        *_precision_section(r),
        *_relay_section(r),
        *(state.section(r["state"]) if "state" in r else []),
        *(data_bench.section(r["data"]) if "data" in r else []),
        *scaling_report.section(r),
        *(verification.section(r["verification"]) if "verification" in r else []),
        f"Section times (s): {', '.join(f'{k} {v:.0f}' for k, v in r['seconds'].items())}.",
    ]
    return "\n".join(out) + "\n"


def _paper_scale_section(ps: dict | None, title: str) -> list[str]:
    """A paper-size model on its links with emulated compute, and the paper's own numbers beside ours."""
    if ps is None:
        return []
    prof, model, train = ps["profile"], ps["model"], ps["train"]
    paper = ps["paper_tokens_per_s"]
    rows = [
        x | {"utilisation": sum(x["stage_compute_utilisation"]) / len(x["stage_compute_utilisation"])}
        for x in ps["rows"]
    ]
    return [
        f"## {title}: d={model['d_model']}, k={model['subspace_rank']}, "
        f"{model['n_layers']} layers on {ps['n_stages']} nodes",
        f"Compute profile `{prof['name']}`: forward {prof['forward_us_per_token_layer']:.2f} µs and backward "
        f"{prof['backward_us_per_token_layer']:.2f} µs per token per layer, subspace boundary maps "
        f"{prof.get('boundary_us_per_token', 0.0):.2f} µs per token ({prof['device']}). "
        f"Source: {prof['source']}",
        f"{train['microbatches']} microbatches of {train['batch_size'] // train['microbatches']} x "
        f"{train['seq_len']} tokens per step; every node in its own network "
        "namespace. Bound: min(stage compute rate, uplink rate / B per token on the busiest uplink). "
        "GPipe bound: the same with the links' delay and GPipe's phases (per phase M + P - 1 slots of "
        "the slower of a stage's compute and a link's transfer of one microbatch, plus a round trip "
        f"through the pipeline per step). The paper (80 Mbit/s): {paper['dense']} tokens/s uncompressed, "
        f"{paper['compressed']} compressed.",
        "",
        _table(
            rows,
            [
                ("link", "link", ""),
                ("schedule", "schedule", ""),
                ("codec", "codec", ""),
                ("tokens/s", "tokens_per_s", ".0f"),
                ("vs dense", "speedup_vs_dense", ".2f"),
                ("byte ratio", "byte_ratio_vs_dense", ".1f"),
                ("busiest uplink B/token", "busiest_uplink_B_per_token", ".0f"),
                ("bound tokens/s", "physical_bound_tokens_per_s", ".0f"),
                ("binds", "binds", ""),
                ("efficiency", "efficiency", ".0%"),
                ("GPipe bound", "gpipe_bound_tokens_per_s", ".0f"),
                ("vs GPipe bound", "gpipe_efficiency", ".0%"),
                ("bubble ceiling", "schedule_ceiling", ".0%"),
                ("compute utilisation", "utilisation", ".0%"),
            ],
        ),
        "",
    ]


def _peer_section(r: dict) -> list[str]:
    """The peer system next to our swarm on the same links (rate-only links: the peer has no delay)."""
    if "peer" not in r:
        return []
    ours = {(row["link"], row["codec"]): row["tokens_per_s"] for row in r["throughput"]}
    rows = []
    for row in r["peer"]:
        entry = dict(row)
        for codec in ("dense bf16", "subspace bf16"):
            if (row["link"], codec) in ours:
                entry[codec] = ours[(row["link"], codec)]
                entry[f"{codec} / peer"] = ours[(row["link"], codec)] / row["tokens_per_s"]
        rows.append(entry)
    return [
        "## A peer in the same run: torch.distributed.pipelining (GPipe, gloo, fp32 activations)",
        "Same model, batch, microbatches and links; threads per process equal on both sides.",
        "",
        _table(
            rows,
            [
                ("link", "link", ""),
                ("shaper", "shaper", ""),
                ("peer tokens/s", "tokens_per_s", ".0f"),
                ("swarm dense bf16", "dense bf16", ".0f"),
                ("swarm subspace bf16", "subspace bf16", ".0f"),
                ("subspace / peer", "subspace bf16 / peer", ".2f"),
            ],
        ),
        "",
    ]


def _relay_section(r: dict) -> list[str]:
    if "relay" not in r:
        return []
    rows, cpu = r["relay"]["swarm"], r["relay"]["cpu"]
    plan = r["plan"]["relay"]
    return [
        "## Relays: a link between two dial-only nodes",
        f"The same 2-stage swarm ({plan['model']['d_model']}-wide model, {plan['train']['steps']} steps) "
        "twice: stage 1 accepting the stream directly, then both nodes dial-only so the link runs "
        "through the coordinator's relay (`swarm up --dial-only 2 --relay`). The link is shaped in "
        "the nodes' transport; the relay is on loopback (no separate relay host here), so the ratio "
        "is the relay's own overhead. Steady-state tokens/s.",
        "",
        _table(
            rows,
            [
                ("link", "link", ""),
                ("path", "path", ""),
                ("tokens/s", "tokens_per_s", ".0f"),
                ("vs direct", "ratio_to_direct", ".2f"),
                ("same losses as direct", "losses_equal_direct", ""),
            ],
        ),
        "",
        f"The relay process carried {cpu['megabytes']} MB through one spliced pair on loopback at "
        f"{cpu['megabytes_per_s']:.0f} MB/s, using {cpu['relay_cpu_seconds_per_gb']:.2f} CPU seconds "
        "per GB relayed (user + system). A relayed byte also crosses the relay host's link twice.",
        "",
    ]


def _churn_table(rows: list[dict]) -> list[str]:
    return [
        _table(
            rows,
            [
                ("replicas", "replicas", ""),
                ("keepers", "keepers", ""),
                ("churn", "churn", ""),
                ("lost stage", "lost_stage", ""),
                ("tokens/s", "tokens_per_s", ".0f"),
                ("retained", "retained", ".0%"),
                ("final loss vs undisturbed", "loss_vs_undisturbed", "+.2%"),
                ("kills", "kills", ""),
                ("epochs restarted", "epochs_restarted", ""),
                ("mean recovery s", "mean_recovery_s", ".1f"),
                ("max recovery s", "max_recovery_s", ".1f"),
                ("steps redone / failure", "mean_steps_redone", ".1f"),
            ],
        ),
        "",
    ]


def _churn_section(r: dict) -> list[str]:
    if "churn" not in r:
        return []
    plan = r["plan"]["churn"]
    return [
        "## Churn: a random stage host killed (kill -9) every few seconds",
        f"{plan['n_stages']} stages + {plan['standbys']} standby (a fresh node joins for each one "
        f"killed), snapshot cut every {plan['checkpoint_interval']} steps, death timeout "
        f"{plan['dead_after_s']:.0f} s, {plan['link_latency_ms']:.0f} ms one-way delay; with replicas, "
        "every stage has that many hosts averaging every step (the extra standbys that become them "
        "join first). Tokens/s over the whole run (wall clock, so recoveries count), retained against "
        "the undisturbed run with as many replicas; recovery: kill to the first redone step "
        "completing again.",
        "",
        *_churn_table(r["churn"]),
        *_lost_stage_section(r),
    ]


def _lost_stage_section(r: dict) -> list[str]:
    if "lost_stage" not in r:
        return []
    plan = r["plan"]["churn"]
    return [
        "## Lost stage: no copy of a middle stage left",
        "The churn section's swarm, one host per stage, undisturbed and then with a middle stage's host "
        "and every standby (the keepers of its snapshots) killed together "
        f"{plan['lost_stage_after_s']:.0f} s in (a fresh node joins for each). `rollback` "
        "(`checkpoint.lost_stage`, the default) resumes every stage from an older cut that still has "
        "all of them (or step 0); `rebuild` rebuilds the lost stage from its two neighbours' snapshots "
        "of the newest cut (CheckFree: their layers averaged, a fresh optimizer). Steps redone per "
        "kill, tokens/s over the whole run, the final loss against the "
        "undisturbed run's.",
        "",
        *_churn_table(r["lost_stage"]),
    ]


def _multihost_section(r: dict) -> list[str]:
    if "multihost" not in r:
        return []
    if isinstance(r["multihost"], dict):
        return [
            "## The README's multi-host recipe on emulated hosts",
            f"Skipped: {r['multihost']['skipped']}.",
            "",
        ]
    plan = r["plan"]["multihost"]
    return [
        "## The README's multi-host recipe on emulated hosts",
        f"The README's `swarm-coordinator serve` / `swarm-node join` commands as written, one network "
        f"namespace per host on a bridge, each node behind a {plan['mbps']:.0f} Mbit/s tbf access link: "
        "a coordinator host and four node hosts (two inbound, one dial-only, one that cannot reach the "
        "DHT), DHT on. Tokens/s past the first two steps; bytes and compression from the coordinator's "
        "`/status` (last 10 steps).",
        "",
        _table(
            r["multihost"],
            [
                ("codec", "codec", ""),
                ("tokens/s", "tokens_per_s", ".0f"),
                ("speed-up", "speedup_vs_first", ".2f"),
                ("B/token/boundary", "bytes_per_token", ".1f"),
                ("compression vs dense bf16", "compression_ratio", ".1f"),
                ("nodes on the DHT", "dht_joined", ""),
                ("DHT fallbacks", "dht_fallback", ""),
            ],
        ),
        "",
    ]


def _averaging_section(r: dict) -> list[str]:
    if "averaging" not in r:
        return []
    plan = r["plan"]["averaging"]
    return [
        "## Averaging a stage across its replicas (hivemind all-reduce, loopback)",
        f"A middle stage of {plan['n_stages']} ({r['averaging'][0]['parameters']:,} trainable parameters, "
        "random gradients), each replica on its own P2P daemon, equal shares, float64 parts on the wire; "
        f"median of {plan['rounds']} rounds. The last column is the busiest replica's bytes at "
        f"{plan['link_mbps']:.0f} Mbit/s (full duplex): what a step pays on such a link.",
        "",
        _table(
            r["averaging"],
            [
                ("replicas", "replicas", ""),
                ("busiest replica MB sent", "busiest_mb", ".1f"),
                ("B/parameter", "bytes_per_parameter", ".1f"),
                ("round s (loopback)", "seconds", ".2f"),
                ("s at link", "seconds_at_link", ".1f"),
            ],
        ),
        "",
    ]


def _replicas_section(r: dict) -> list[str]:
    if "replicas" not in r:
        return []
    plan, rows = r["plan"]["replicas"], r["replicas"]
    return [
        "## Replicas of the slowest stage (local swarm, loopback)",
        f"{plan['n_stages']} stages of the {plan['model']['d_model']}-wide model; stage "
        f"{rows[0]['slow_stage']} computes {plan['slowdown']:g}x as long (emulated: a wait). Extra nodes "
        "join as standbys and become replicas of the slowest stage once capacities are measured; the "
        f"stage's replicas split each step's {plan['train']['microbatches']} microbatches and average "
        "gradients (hivemind all-reduce) every step. Averaging columns: per replica and step, the most any "
        "replica sent.",
        "",
        _table(
            rows,
            [
                ("replicas", "replicas", ""),
                ("tokens/s", "tokens_per_s", ".0f"),
                ("speed-up", "speedup_vs_one", ".2f"),
                ("averaging B/step", "averaging_bytes_per_replica_step", ",.0f"),
                ("averaging s/round", "averaging_s_per_round", ".3f"),
                ("boundary B/step", "boundary_bytes_per_step", ",.0f"),
            ],
        ),
        "",
    ]


def _replica_sync_section(r: dict) -> list[str]:
    if "replica_sync" not in r:
        return []
    rs, plan = r["replica_sync"], r["plan"]["replica_sync"]
    return [
        "## Keeping replicas identical: per-step averaging against outer steps (loopback)",
        f"{rs['replicas']} replicas of a one-stage {plan['model']['d_model']}-wide, "
        f"{plan['model']['n_layers']}-layer model ({rs['rows'][0]['parameters']:,} trainable parameters), "
        f"{rs['steps']} steps on the same batches, each replica on half of every step's microbatches "
        "(`replica_sync` in the run configuration). Bytes: what one replica sent, per trainable "
        f"parameter; seconds at link: those bytes per step at {rs['link_mbps']:g} Mbit/s; loss: the "
        f"mean training loss of the last {plan['tail']} steps.",
        "",
        _table(
            rs["rows"],
            [
                ("mode", "mode", ""),
                ("B/param/sync", "bytes_per_parameter_per_sync", ".3f"),
                ("B/param/step", "bytes_per_parameter_per_step", ".3f"),
                ("x fewer bytes", "bytes_vs_per_step", ".0f"),
                ("s/step at link", "seconds_per_step_at_link", ".4f"),
                ("loss", "loss_at_equal_tokens", ".3f"),
                ("loss / per-step", "loss_vs_per_step", ".3f"),
            ],
        ),
        "",
    ]


def _wan_replicas_section(r: dict) -> list[str]:
    rows, plan = r.get("wan_replicas"), r["plan"].get("wan_replicas")
    if not rows or "skipped" in rows:
        return []
    model, mbps = plan["model"], rows[0]["link_mbps"]
    return [
        f"## Replicas on emulated {mbps:g} Mbit/s hosts: per-step averaging against outer steps",
        f"The multi-host recipe's swarm in network namespaces (TLS, DHT, every host behind a "
        f"{rows[0]['link_mbps']:g} Mbit/s access link): 2 stages of a d={model['d_model']}, "
        f"{model['n_layers']}-layer model, stage 1 computing {plan['slowdown']:g}x as long (a wait), "
        "alone or with a second replica on a third host; tokens/s over the second half of the steps "
        "(after the replica joined). Averaging columns: per replica, from the nodes' summaries.",
        "",
        _table(
            rows,
            [
                ("mode", "mode", ""),
                ("tokens/s", "tokens_per_s", ".0f"),
                ("vs 1 replica", "tokens_vs_one_replica", ".2f"),
                ("averaging B/step", "averaging_bytes_per_replica_step", ",.0f"),
                ("averaging s/round", "averaging_s_per_round", ".3f"),
                ("restarts", "epochs_restarted", "d"),
            ],
        ),
        "",
    ]


def _precision_section(r: dict) -> list[str]:
    if "precision" not in r:
        return []
    p, plan = r["precision"], r["plan"]["precision"]
    model, train = plan["model"], plan["train"]
    peak = "no known peak"
    if p["peak_bf16_tflops"]:
        peak = f"its dense bf16 peak, {p['peak_bf16_tflops']:.0f} TFLOP/s"
    return [
        "## Mixed precision: the single-process trainer in fp32 and bf16",
        f"On {p['device']} ({peak}; fp32 matmul precision {p['float32_matmul_precision']!r}): "
        f"d={model['d_model']}, {model['n_layers']} layers, batch {train['batch_size']} x {train['seq_len']} "
        f"in {train['microbatches']} microbatches, random tokens, {plan['steps']} timed steps after "
        f"{plan['warmup_steps']} warm-up. {p['flops_per_token'] / 1e6:.1f} model MFLOP per token "
        "(forward + backward); MFU against the bf16 peak for both precisions. Several stages hand their "
        "boundaries over on the device (carried, as `swarm train` does) or serialise and decode every "
        "crossing (the wire's code path), side by side. Compiled rows run each layer through "
        "torch.compile (`--compile`); their compile time is in the warm-up column.",
        "",
        _table(
            p["rows"],
            [
                ("stages", "n_stages", ""),
                ("boundaries", "boundaries", ""),
                ("compiled", "compiled", ""),
                ("precision", "precision", ""),
                ("tokens/s", "tokens_per_s", ",.0f"),
                ("model TFLOP/s", "model_tflops_per_s", ".3f"),
                ("MFU", "mfu", ".1%"),
                ("vs fp32", "speedup_vs_fp32", ".2f"),
                ("vs eager", "speedup_vs_eager", ".2f"),
                ("vs fewest stages", "vs_first_stage_count", ".2f"),
                ("warm-up s", "warmup_seconds", ".1f"),
                ("loss at last step", "final_loss", ".3f"),
            ],
        ),
        "",
    ]


def _generation_section(r: dict) -> list[str]:
    if "generation" not in r:
        return []
    title = "## Generation through a swarm: subspace coordinates against dense activations"
    if isinstance(r["generation"], dict):
        return [title, f"Skipped: {r['generation']['skipped']}.", ""]
    plan = r["plan"]["generation"]
    return [
        title,
        f"{plan['n_stages']} stage servers (`swarm-node serve`, bf16 frames), one per emulated host behind a "
        "tbf access link; the client on an unshaped host routes every token through them (two hops per "
        f"boundary). Greedy, {plan['prompt_tokens']}-token prompt, {plan['new_tokens']} new tokens; dense "
        "and subspace servers run side by side and the client alternates "
        f"({plan['repeats']} runs each, median).",
        "",
        _table(
            r["generation"],
            [
                ("link Mbit/s", "link_mbps", ".0f"),
                ("boundary", "boundary", ""),
                ("tokens/s", "tokens_per_s", ".1f"),
                ("speed-up", "speedup_vs_dense", ".2f"),
                ("prompt s", "prefill_s", ".3f"),
                ("B/token/boundary", "bytes_per_token", ".0f"),
                ("prompt B/token/boundary", "prefill_bytes_per_token", ".0f"),
            ],
        ),
        "",
    ]


def plots(r: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in r["convergence"]:
        losses = row["losses"]
        smooth = [
            sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1])
            for i in range(len(losses))
        ]
        ax.plot(smooth, label=f"{row['codec']} ({row['wire_B_per_token']:.0f} B/tok)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_title("Convergence at equal steps")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "convergence.png", dpi=120)
    plt.close(fig)

    rows = r["throughput"]
    links = list(dict.fromkeys(row["link"] for row in rows))
    codecs = list(dict.fromkeys(row["codec"] for row in rows))
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(codecs)
    for j, codec in enumerate(codecs):
        values = [
            next(x["tokens_per_s"] for x in rows if x["link"] == link and x["codec"] == codec)
            for link in links
        ]
        ax.bar([i + j * width for i in range(len(links))], values, width, label=codec)
    ax.set_xticks([i + width * (len(codecs) - 1) / 2 for i in range(len(links))], links, fontsize=7)
    ax.set_ylabel("tokens/s")
    ax.set_title("Local swarm throughput on emulated links")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    plt.close(fig)
    quality_report.plots(r, out)
    scaling_report.plots(r, out)
