"""``swarm-node join``: host pipeline stages of a run on this machine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import uvloop
from swarm.node.coordinator_client import CoordinatorUnreachable, Fenced, JoinRefused
from swarm.node.daemon import NodeDaemon
from swarm.node.settings import NodeSettings, Timeouts

from swarm.io.manifest import CHUNK_BYTES, MAX_CHUNK_BYTES
from swarm.launch.argv import command_line
from swarm.net import join_token, tls
from swarm.net.shaper import LinkProfile
from swarm.ops import logs
from swarm.ops.logs import say
from swarm.runtime.faults import FaultSpec
from swarm.serve.inference import BOUNDARIES, FORMATS


def build_parser() -> argparse.ArgumentParser:
    """The ``swarm-node`` parser: ``join`` and ``serve``."""
    parser = argparse.ArgumentParser(prog="swarm-node", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("join", help="join a run and train until it ends")
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    join_token.add_arguments(p)
    p.add_argument(
        "--listen",
        default="127.0.0.1:0",
        help="HOST:PORT for the Stage service; '' to only dial out (no inbound)",
    )
    p.add_argument(
        "--announce",
        default="",
        help="HOST:PORT neighbours dial (default: the listen address; for 0.0.0.0, this host's "
        "address on the interface that reaches the coordinator)",
    )
    p.add_argument(
        "--relay-port",
        type=int,
        help="also relay links between nodes that cannot accept streams (behind NAT), on the --listen "
        "host at this port (0: a free one); the coordinator uses it while this node is in the run",
    )
    p.add_argument(
        "--snapshot-mbps",
        type=float,
        default=0.0,
        help="most Mbit/s this node spends serving snapshot chunks to peers (0: --snapshot-share decides)",
    )
    p.add_argument(
        "--snapshot-share",
        type=float,
        default=NodeSettings.snapshot_share,
        help="without --snapshot-mbps: serve snapshot chunks at most at this share of the uplink measured "
        "on the boundary streams (0: no cap; unpaced until one is measured)",
    )
    p.add_argument(
        "--snapshot-chunk-kb",
        type=int,
        default=CHUNK_BYTES >> 10,
        help="chunk size of the snapshots this node takes (a fetch spreads over holders chunk by chunk)",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda:0 ...")
    p.add_argument(
        "--stages", type=int, default=1, help="how many consecutive stages this node offers to host"
    )
    p.add_argument(
        "--data-dir", default="swarm-node-data", help="cache folder (embedding, tokenizer, tokens)"
    )
    p.add_argument("--metrics-port", type=int, default=-1, help="Prometheus port (0: any free port; -1: off)")
    p.add_argument(
        "--metrics-host",
        default="",
        help="address /metrics and /healthz bind (default: the listen host, else the interface "
        "that reaches the coordinator; 0.0.0.0 for every interface)",
    )
    p.add_argument(
        "--link-mbps", type=float, default=0.0, help="emulate a link of this rate on sends (0: off)"
    )
    p.add_argument("--link-latency-ms", type=float, default=0.0, help="emulated one-way delay on sends")
    p.add_argument(
        "--no-dht", action="store_true", help="skip DHT discovery; use the coordinator's addresses"
    )
    p.add_argument("--public-dht", action="store_true", help="allow NAT port mapping (production only)")
    p.add_argument(
        "--dht-listen",
        default="",
        help="DHT multiaddr, e.g. /ip4/0.0.0.0/tcp/7101 (default: a free TCP port on the "
        "metrics host default)",
    )
    p.add_argument("--name", default="", help="node name shown in status")
    p.add_argument("--fault", type=FaultSpec.parse, help=argparse.SUPPRESS)  # tests: MODE[:FRACTION][@AFTER]
    tls.add_arguments(p)
    p.add_argument("--log-format", choices=logs.FORMATS, default="text", help="text lines or JSON lines")
    defaults = Timeouts()
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=defaults.connect_s,
        help="seconds to open a boundary stream (dial retries, or waiting to be dialled)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=defaults.step_s,
        help="seconds a neighbour may stay silent inside a step before the step fails",
    )
    p.add_argument(
        "--coordinator-down",
        type=float,
        default=defaults.coordinator_down_s,
        help="seconds the coordinator may stay unreachable (retried with backoff) before the node gives up",
    )
    p.add_argument(
        "--linger-s",
        type=float,
        default=0.0,
        help="after the run ends, keep serving --metrics-port this many seconds (a signal ends it early)",
    )
    serve = sub.add_parser("serve", help="serve one stage of a trained model for generation sessions")
    serve.add_argument("--model", required=True, help="model folder (swarm train --out, a coordinator's)")
    serve.add_argument("--stage", type=int, required=True, help="the pipeline stage to serve")
    serve.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT of the Inference service")
    serve.add_argument("--boundary", choices=BOUNDARIES, default="subspace", help="what crosses a boundary")
    serve.add_argument("--format", choices=FORMATS, default="bf16", help="tensor format of boundary frames")
    serve.add_argument("--session-timeout", type=float, default=300.0, help="seconds a session may stay idle")
    serve.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda:0 ...")
    serve.add_argument(
        "--metrics-port", type=int, default=-1, help="HTTP /metrics, /healthz (0: free, -1: off)"
    )
    serve.add_argument("--log-format", choices=logs.FORMATS, default="text", help="text lines or JSON lines")
    tls.add_arguments(serve)
    return parser


def join_command(
    coordinator: str,
    *,
    listen: str | None = None,
    stages: int | None = None,
    data_dir: str | Path | None = None,
    device: str | None = None,
    link_mbps: float | None = None,
    link_latency_ms: float | None = None,
    name: str | None = None,
    use_dht: bool = True,
    metrics_port: int | None = None,
    connect_timeout: float | None = None,
    security: Sequence[str] = (),
) -> list[str]:
    """A ``swarm-node join`` command line: the arguments after ``python -m swarm.node.cli`` (what
    :func:`main` takes). ``None`` leaves a flag at its default; ``security``: transport flags
    (:func:`swarm.net.tls.cli_flags`, or ``["--insecure"]``). The join token stays off it (``$SWARM_TOKEN``).
    """
    options = {
        "--coordinator": coordinator,
        "--listen": listen,
        "--stages": stages,
        "--data-dir": data_dir,
        "--device": device,
        "--link-mbps": link_mbps,
        "--link-latency-ms": link_latency_ms,
        "--name": name,
        "--metrics-port": metrics_port,
        "--connect-timeout": connect_timeout,
    }
    return command_line("join", options, use_dht, security)


def serve_stage(args: argparse.Namespace) -> int:
    """``swarm-node serve``: load the stage, serve it until SIGINT/SIGTERM."""
    from swarm.node.inference_service import serve

    from swarm.core.device import pick_device
    from swarm.io import model_io
    from swarm.ops.metrics import Metrics
    from swarm.serve.inference import InferenceStage

    security = tls.from_args(args, "swarm-node serve", [args.listen])
    try:
        trained = model_io.load(args.model)
        stage = InferenceStage(trained, args.stage, args.boundary, args.format, pick_device(args.device))
    except ValueError as e:
        print(f"swarm-node serve: {e}", file=sys.stderr)
        return 2

    async def run() -> None:
        task = asyncio.current_task()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
        metrics = Metrics("node")
        if args.metrics_port >= 0:
            http = metrics.serve(args.metrics_port, args.listen.rpartition(":")[0] or "127.0.0.1")
            say(f"node metrics on {http.host}:{http.port} (/metrics, /healthz)")
        with contextlib.suppress(asyncio.CancelledError):
            await serve(stage, args.listen, args.session_timeout, metrics, security)

    try:
        uvloop.run(run())
    except RuntimeError as e:  # e.g. the port is taken
        print(f"swarm-node serve: {e}", file=sys.stderr)
        return 1
    return 0


async def _run(settings: NodeSettings, linger_s: float = 0.0) -> int:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    daemon = NodeDaemon(settings)

    def leave() -> None:
        """SIGTERM: leave gracefully (final snapshot cut, Leave); a second signal stops at once."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        daemon.request_leave()

    def stop() -> None:
        """SIGINT: cancel the node once; a further signal must not interrupt its shutdown (DHT, server)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: None)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, leave)
    loop.add_signal_handler(signal.SIGINT, stop)
    try:
        return await _follow(daemon, settings, linger_s)
    finally:
        await daemon.close()


async def _follow(daemon: NodeDaemon, settings: NodeSettings, linger_s: float) -> int:
    try:
        result = await daemon.run()
    except asyncio.CancelledError:
        say("node stopped by signal")
        return 130
    except Fenced as e:
        say(f"node fenced: {e}")
        return 3
    except CoordinatorUnreachable as e:
        say(f"node gave up: {e}")
        return 4
    except JoinRefused as e:
        say(f"node not admitted: {e}")
        return 5
    if result.left_early:
        cut = result.final_cut
        where = f" after a snapshot cut at step {cut} (stages {result.stages})" if cut is not None else ""
        say(f"node {result.node_id[:8]} left the run{where}")
        return 0
    say(f"node {result.node_id[:8]} finished {result.steps} steps on stages {result.stages}")
    if linger_s > 0 and settings.metrics_port >= 0:
        # The run is complete: a signal only ends the wait.
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(daemon.leaving.wait(), linger_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.setup(args.log_format, logging.WARNING)
    if args.command == "serve":
        return serve_stage(args)
    endpoints = [args.coordinator, args.listen, args.announce]
    if args.relay_port is not None and not args.listen:
        print("swarm-node: --relay-port needs a --listen address others can reach", file=sys.stderr)
        return 2
    security = tls.from_args(args, "swarm-node", endpoints, server=bool(args.listen))
    token = join_token.from_args(args, "swarm-node")
    if token is None:
        print(f"swarm-node: no join token: set ${join_token.ENV} or --token-file", file=sys.stderr)
        return 2
    settings = NodeSettings(
        coordinator=args.coordinator,
        token=token,
        listen=args.listen,
        announce=args.announce,
        device=args.device,
        max_stages=args.stages,
        data_dir=Path(args.data_dir),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        dht_listen=args.dht_listen,
        link=LinkProfile(args.link_mbps, args.link_latency_ms),
        use_dht=not args.no_dht,
        public_dht=args.public_dht,
        name=args.name,
        relay_port=args.relay_port,
        snapshot_mbps=max(0.0, args.snapshot_mbps),
        snapshot_share=min(max(0.0, args.snapshot_share), 1.0),
        snapshot_chunk_bytes=min(max(1, args.snapshot_chunk_kb) << 10, MAX_CHUNK_BYTES),
        security=security,
        fault=args.fault,
        timeouts=dataclasses.replace(
            Timeouts(),
            connect_s=args.connect_timeout,
            step_s=args.step_timeout,
            coordinator_down_s=args.coordinator_down,
        ),
    )
    try:
        return uvloop.run(_run(settings, args.linger_s))
    except (RuntimeError, ValueError, OSError) as e:
        print(f"swarm-node: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
