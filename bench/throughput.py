"""Throughput of a real local swarm (coordinator + one node process per stage) on emulated links.

Links are shaped in the transport (:mod:`swarm.net.shaper`: rate limit plus
one-way delay on every stream's sends), the same for every codec, measured side by
side in one run. Throughput is steady-state: tokens over the summed step durations,
leaving out the first steps (process start-up, caches). The physical bound of each
row is ``min(compute-only tokens/s, link rate / bytes per token on the busiest uplink)``:
a middle node's access link carries its activations downstream *and* its gradients
upstream (:func:`busiest_uplink_bytes`); compute-only is the same codec's swarm on
unshaped loopback.

``shaper="netns"`` (where :func:`bench.netns.available`) rate-limits real links instead:
every node runs in its own network namespace behind a ``tc tbf`` access link of the
link's rate (:class:`bench.netns.EmulatedNetwork`), the coordinator in an unshaped one.
The kernel has no ``netem``, so a link's one-way delay still comes from the transport
shaper. Each row records what shaped it: ``"netns+tbf"``, ``"transport"``, or ``"none"``
(unshaped loopback); ``"netns"`` falls back to ``"transport"`` where namespaces are unavailable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import warnings
from pathlib import Path

from bench.codecs import CodecCase
from bench.netns import EmulatedNetwork
from swarm.core.config import ModelConfig, RunConfig, TrainConfig
from swarm.core.subspace import initial_artifacts
from swarm.io.artifacts import ArtifactCache, digest, matrix_to_bytes
from swarm.launch.local_swarm import up


@dataclasses.dataclass(frozen=True)
class Link:
    name: str
    mbps: float  # 0: unshaped loopback
    one_way_ms: float = 0.0


def threads_per_node(n_stages: int) -> int:
    """Each node's share of this machine's CPUs, as if it had a host of its own (same as the peer's)."""
    return max(1, (os.cpu_count() or 1) // n_stages)


def resolve_shaper(shaper: str) -> str:
    """The shaper a run gets: ``"netns"`` only where the machine allows it, else ``"transport"``."""
    if shaper not in ("transport", "netns"):
        raise ValueError(f"unknown shaper {shaper!r}; choose transport or netns")
    if shaper == "netns":
        ok, reason = EmulatedNetwork.available()
        if ok:
            return "netns"
        warnings.warn(f"network namespaces unavailable ({reason}); shaping in the transport", stacklevel=2)
    return "transport"


def run_config(case: CodecCase, model: ModelConfig, train: TrainConfig, n_stages: int) -> RunConfig:
    """The run a codec case trains: the model constrained when the codec needs it."""
    return RunConfig(
        model=dataclasses.replace(model, constrain_writes=case.constrained),
        codec=case.codec,
        train=train,
        n_stages=n_stages,
    )


def busiest_uplink_bytes(forward: float, backward: float, n_stages: int) -> float:
    """Bytes per token on the busiest node uplink: a middle stage sends its activations downstream
    and its gradients upstream through the same access link; with two stages each sends one kind."""
    return forward + backward if n_stages > 2 else max(forward, backward)


def preload_embedding(run_dir: Path, config: RunConfig, nodes: int) -> None:
    """Put the fixed embedding in every local node's artifact cache, as after its one-time fetch
    (so a benchmark's start-up does not download it through the emulated links)."""
    fixed, _ = initial_artifacts(config)
    data = matrix_to_bytes(fixed)
    key = digest(data)
    for i in range(nodes):
        ArtifactCache(run_dir / f"node{i}" / "artifacts").put(key, data)


def run_swarm(config: RunConfig, name: str, link: Link, shaper: str = "transport") -> dict:
    """One run on one link; ``shaper`` as resolved by :func:`resolve_shaper`."""
    n_stages = config.n_stages
    netns = shaper == "netns" and link.mbps > 0
    threads = ["env", f"OMP_NUM_THREADS={threads_per_node(n_stages)}"]
    with contextlib.ExitStack() as stack:
        run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="swarm-bench-")))
        preload_embedding(run_dir, config, n_stages)
        placement = {"launch_prefix": lambda i: threads}
        if netns:
            net = stack.enter_context(EmulatedNetwork(n_stages, link.mbps, control=True))
            placement = dict(
                launch_prefix=lambda i: [*net.exec_prefix(i), *threads],
                node_host=net.host_ip,
                coordinator_prefix=net.control_prefix,
                coordinator_host=net.control_ip,
            )
        s = up(
            config,
            run_dir,
            link_mbps=0.0 if netns else link.mbps,
            link_latency_ms=link.one_way_ms,
            progress=False,
            use_dht=False,
            dead_after=120.0,  # heartbeats share a saturated 2 Mbit/s link with the frames
            timeout=1800,
            **placement,
        )
    steady = s.steady_steps
    tokens = sum(x.tokens for x in steady)
    boundaries = max(1, n_stages - 1)
    fwd = sum(x.bytes_sent_forward for x in steady) / boundaries / tokens
    bwd = sum(x.bytes_sent_backward for x in steady) / boundaries / tokens
    uplink = busiest_uplink_bytes(fwd, bwd, n_stages)
    return {
        "codec": name,
        "link": link.name,
        "tokens_per_s": s.tokens_per_second,
        "step_seconds": [x.wall_seconds for x in steady],
        "wire_forward_B_per_token": fwd,
        "wire_backward_B_per_token": bwd,
        "busiest_uplink_B_per_token": uplink,
        "link_bound_tokens_per_s": link.mbps * 1e6 / 8 / uplink if link.mbps else None,
        "final_loss": s.losses[-1],
        "shaper": "netns+tbf" if netns else "transport" if link.mbps or link.one_way_ms else "none",
        "threads_per_node": threads_per_node(n_stages),
    }


def attempt(config: RunConfig, name: str, link: Link, shaper: str) -> dict:
    """:func:`run_swarm`, tried twice: a swarm that fails twice is an error the report must show."""
    try:
        return run_swarm(config, name, link, shaper)
    except RuntimeError as first:
        warnings.warn(f"{name} on {link.name} failed, retrying: {first}", stacklevel=2)
        return run_swarm(config, name, link, shaper)


def run(
    cases: list[CodecCase],
    model: ModelConfig,
    train: TrainConfig,
    n_stages: int,
    links: list[Link],
    shaper: str = "transport",
) -> list[dict]:
    """Every codec on every link; adds the ratio to the first codec and the efficiency against the bound.

    ``shaper``: ``"transport"`` or ``"netns"`` (tbf-limited namespaces where available).
    """
    shaper = resolve_shaper(shaper)
    unshaped = Link("loopback (compute-only)", 0.0)
    rows = []
    configs = {c.name: run_config(c, model, train, n_stages) for c in cases}
    compute = {name: attempt(config, name, unshaped, "transport") for name, config in configs.items()}
    rows.extend(compute.values())
    for link in links:
        for case in cases:
            row = attempt(configs[case.name], case.name, link, shaper)
            bound = min(compute[case.name]["tokens_per_s"], row["link_bound_tokens_per_s"])
            row["physical_bound_tokens_per_s"] = bound
            row["efficiency"] = row["tokens_per_s"] / bound
            rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["link"] == row["link"] and r["codec"] == cases[0].name)
        row["speedup_vs_" + cases[0].name.replace(" ", "_")] = row["tokens_per_s"] / base["tokens_per_s"]
    return rows
