"""The run as operators see it: recent rates, a JSON document and a terminal table.

One source for ``swarm status`` (the table), the coordinator's HTTP ``/status`` (the
JSON) and its ``swarm_run_*`` gauges. Node ids are credentials until per-node
credentials exist, so only their first 8 characters are ever shown.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from swarm._proto.swarm.v1 import coordinator_pb2 as cpb

RATE_WINDOW = 10  # completed steps the rates are computed over
ID_CHARS = 8


def short_id(node_id: str) -> str:
    return node_id[:ID_CHARS]


def run_rates(steps: Sequence[cpb.StepSummary], d_model: int, boundaries: int) -> cpb.RunRates:
    """Rates over ``steps`` (ascending, the most recent completed ones).

    Tokens/s spans the completions of the first and last step (so gaps between steps
    count), falling back to the steps' own durations when only one step is known.
    The compression ratio compares with dense bf16 activations and gradients: 2·d bytes
    per token per boundary in each direction.
    """
    if not steps:
        return cpb.RunRates()
    rates = cpb.RunRates(steps=len(steps))
    if steps[-1].HasField("loss"):
        rates.loss = steps[-1].loss
    span = steps[-1].completed_at - steps[0].completed_at
    if len(steps) > 1 and span > 0:
        rates.tokens_per_second = sum(s.tokens for s in steps[1:]) / span
    elif steps[-1].wall_seconds > 0:
        rates.tokens_per_second = steps[-1].tokens / steps[-1].wall_seconds
    tokens = sum(s.tokens for s in steps)
    wire = sum(s.bytes_sent_forward + s.bytes_sent_backward for s in steps)
    if tokens and boundaries:
        rates.bytes_per_token = wire / tokens / boundaries
        rates.compression_ratio = tokens * boundaries * 2 * (2 * d_model) / wire if wire else 0.0
    return rates


def phase_name(phase: int) -> str:
    return cpb.NodePhase.Name(phase).removeprefix("NODE_PHASE_").lower()


def inbound(node: cpb.NodeStatus) -> str:
    """Whether neighbours can dial ``node``: "open" (the coordinator reached its address at Join),
    "unreachable" (it announced one the coordinator could not reach) or "dial-only" (none)."""
    return "open" if node.reachable else "unreachable" if node.address else "dial-only"


def status_document(reply: cpb.StatusReply) -> dict:
    """The run and its nodes as plain JSON (no secrets; node ids shortened)."""
    r = reply.rates
    return {
        "run_id": reply.run_id,
        "step": reply.step,
        "steps_completed": reply.steps_completed,
        "run_complete": reply.run_complete,
        "plan_epoch": reply.plan_epoch,
        "resume_step": reply.resume_step,
        "latest_cut": reply.latest_cut - 1 if reply.latest_cut else None,
        "epochs_restarted": reply.epochs_restarted,
        "subspace_version": reply.subspace_version,
        "plan_problems": list(reply.plan_problems),
        "relayed_links": list(reply.relayed_links),
        "snapshot_holding": reply.snapshot_holding,
        "bad_holders": list(reply.bad_holders),
        "rebuilt_stages": list(reply.rebuilt_stages),
        "commitment_checks": reply.commitment_checks,
        "commitment_mismatches": list(reply.commitment_mismatches),
        "audits": {
            "matched": reply.audits_matched,
            "mismatched": reply.audits_mismatched,
            "unavailable": reply.audits_unavailable,
        },
        "audit_lines": list(reply.audit_lines),
        "rates": {
            "steps": r.steps,
            "loss": r.loss if r.HasField("loss") else None,
            "tokens_per_second": r.tokens_per_second,
            "bytes_per_token": r.bytes_per_token,
            "compression_ratio": r.compression_ratio,
        },
        "nodes": [
            {
                "node": short_id(n.node_id),
                "name": n.node_name,
                "alive": n.alive,
                "state": "alive" if n.alive else "left" if n.left else "dead",
                "phase": phase_name(n.phase),
                "stages": list(n.stages),
                "last_stages": list(n.last_stages),
                "step": n.step,
                "tokens_per_second": n.tokens_per_second,
                "last_heartbeat_age_s": round(n.last_heartbeat_age_s, 3),
                "subspace_version": n.subspace_version,
                "plan_epoch": n.plan_epoch,
                "device": n.device,
                "inbound": inbound(n),
                "drifted_frames": n.drifted_frames,
            }
            for n in reply.nodes
        ],
    }


def render(reply: cpb.StatusReply, coordinator: str) -> str:
    """``swarm status``: the run on a few lines, then one row per node (alive ones first)."""
    doc = status_document(reply)
    r = doc["rates"]
    loss = f"{r['loss']:.4f}" if r["loss"] is not None else "-"
    state = "complete" if doc["run_complete"] else f"epoch {doc['plan_epoch']} from step {doc['resume_step']}"
    cut = doc["latest_cut"] if doc["latest_cut"] is not None else "-"
    audits = doc["audits"]
    lines = [
        f"run {doc['run_id']} at {coordinator} ({time.strftime('%H:%M:%S')}): {state}",
        f"  step {doc['step'] if doc['steps_completed'] else '-'}  loss {loss}  "
        f"{r['tokens_per_second']:.0f} tokens/s  {r['bytes_per_token']:.1f} B/token/boundary  "
        f"compression {r['compression_ratio']:.1f}x  (last {r['steps']} steps)",
        f"  subspace v{doc['subspace_version']}  latest cut {cut}  "
        f"epochs restarted {doc['epochs_restarted']}  "
        f"frame commitments checked {doc['commitment_checks']}",
        *(f"  plan problem: {problem}" for problem in doc["plan_problems"]),
        *(f"  relayed: {link}" for link in doc["relayed_links"]),
        *([f"  {doc['snapshot_holding']}"] if doc["snapshot_holding"] else []),
        *(f"  bad snapshot holder: {line}" for line in doc["bad_holders"]),
        *(f"  {line}" for line in doc["rebuilt_stages"]),
        *(f"  frame commitments disagree: {line}" for line in doc["commitment_mismatches"]),
        *(
            [
                f"  audits: {audits['matched']} matched, {audits['mismatched']} mismatched, "
                f"{audits['unavailable']} unavailable"
            ]
            if any(audits.values())
            else []
        ),
        *(f"  audit: {line}" for line in doc["audit_lines"]),
        *(
            f"  screen: {n['drifted_frames']} activation frames from node {n['node']} ({n['name']}) "
            "drifted from their moving statistics"
            for n in doc["nodes"]
            if n["drifted_frames"]
        ),
        "",
    ]
    header = ("node", "name", "state", "phase", "stages", "inbound", "step", "tok/s", "heartbeat", "subspace")
    # stages: what a node hosts, or for a node that is gone what it hosted last
    rows = [
        (
            n["node"],
            n["name"],
            n["state"],
            n["phase"],
            ",".join(map(str, n["last_stages"])) or ("standby" if n["alive"] else "-"),
            n["inbound"],
            str(n["step"]),
            f"{n['tokens_per_second']:.0f}",
            f"{n['last_heartbeat_age_s']:.1f}s ago",
            f"v{n['subspace_version']}",
        )
        for n in sorted(
            doc["nodes"], key=lambda n: (not n["alive"], n["last_stages"] or [1 << 30], n["name"])
        )
    ]
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=False)]
    for row in (header, *rows):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)
