"""``swarm-coordinator serve``: run the coordinator of one training run.

Once it serves, the command prints exactly one line on stdout::

    coordinator listening on HOST:PORT metrics=PORT run=RUN_ID

(``metrics=-1`` when ``--metrics-port -1`` disables the Prometheus endpoint) and runs
until SIGINT or SIGTERM, then stops the gRPC server with a grace period, shuts the DHT
down, closes the state file and exits 0. Everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sqlite3
import sys
import tomllib

import uvloop

from coordinator.service import CoordinatorServer, CoordinatorService
from swarm.config import RunConfig
from swarm.metrics import Metrics

log = logging.getLogger("swarm.coordinator")

DHT_SHUTDOWN_S = 3.0
STOP_GRACE_S = 2.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-coordinator", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve one run")
    serve.add_argument("--config", help="run configuration TOML (default: the embedded small run)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one)")
    serve.add_argument("--token", help="join secret (default: $SWARM_TOKEN, else a random one, logged)")
    serve.add_argument(
        "--state", default="./coordinator.sqlite", help="SQLite state file (resumed if present)"
    )
    serve.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: a free one, -1: off)")
    serve.add_argument("--no-dht", action="store_true", help="run without the stage-discovery DHT")
    serve.add_argument(
        "--public-dht", action="store_true", help="let the DHT map NAT ports (UPnP/NAT-PMP; production only)"
    )
    serve.add_argument(
        "--dead-after", type=float, default=15.0, help="seconds without heartbeat before death"
    )
    return parser


def load_config(path: str | None) -> RunConfig:
    """The run configuration from ``path``, or the embedded default run."""
    if path is None:
        from swarm.cli import DEFAULT_RUN

        return RunConfig.from_dict(DEFAULT_RUN)
    return RunConfig.from_toml(path)


async def serve(
    service: CoordinatorService, host: str, port: int, metrics_port: int, dht: str | None = "local"
) -> None:
    """Serve ``service`` until SIGINT/SIGTERM, printing the listening line once ready.

    ``dht``: ``None`` (no discovery DHT), ``"local"`` (no NAT port mapping) or ``"public"``.
    """
    dht_node = None
    if dht is not None:
        # Imported here: hivemind is slow to import and unneeded without a DHT.
        from swarm.discovery import start_dht, visible_maddrs

        dht_node = await start_dht(public=dht == "public")
        service.dht_peers = await visible_maddrs(dht_node)
    server = CoordinatorServer(service, host, port)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"coordinator listening on {server.address} metrics={metrics_port} run={service.run_id}", flush=True
    )
    await stop.wait()
    log.info("stopping")
    await server.stop(STOP_GRACE_S)
    if dht_node is not None:
        # Bounded: when Ctrl-C reached p2pd too, hivemind's shutdown can wait on a dead daemon.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(dht_node.shutdown(), timeout=DHT_SHUTDOWN_S)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point of ``swarm-coordinator``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config)
    except (OSError, ValueError, TypeError, tomllib.TOMLDecodeError) as e:
        print(f"swarm-coordinator: cannot load run configuration {args.config}: {e}", file=sys.stderr)
        return 2
    token = args.token or os.environ.get("SWARM_TOKEN")
    if not token:
        token = secrets.token_urlsafe(24)
        log.warning("no --token or SWARM_TOKEN given; generated join token %s", token)
    dht = None if args.no_dht else "public" if args.public_dht else "local"
    metrics = Metrics("coordinator")
    try:
        service = CoordinatorService(
            config, token, args.state, None, metrics, [], dead_after_s=args.dead_after
        )
        metrics_port = -1 if args.metrics_port == -1 else metrics.serve(args.metrics_port, host=args.host)
        uvloop.run(serve(service, args.host, args.port, metrics_port, dht))
    except (ValueError, sqlite3.Error) as e:  # a state file holding another run, or an unusable one
        print(f"swarm-coordinator: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"swarm-coordinator: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
