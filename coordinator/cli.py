"""``swarm-coordinator serve``: run the coordinator of one training run.

Once it serves, the command prints exactly one line on stdout::

    coordinator listening on HOST:PORT metrics=PORT run=RUN_ID [relay=PORT] [data=URL]

(``metrics=-1`` when ``--metrics-port -1`` disables the HTTP endpoint, which serves
``/metrics``, ``/healthz`` and the run as JSON at ``/status``; ``relay=`` with ``--relay-port``;
``data=`` with ``--data``: the base URL nodes fetch the prepared corpus from)
and runs until SIGINT or
SIGTERM, then stops the gRPC server with a grace period, shuts the DHT
down, closes the state file and exits 0. Everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sqlite3
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import uvloop
from prometheus_client import CollectorRegistry
from swarm.coordinator.relays import Relay
from swarm.coordinator.service import CoordinatorServer, CoordinatorService, host_port
from swarm.coordinator.settings import CoordinatorSettings
from swarm.coordinator.state import CoordinatorState
from swarm.coordinator.tokens import JoinTokens

from swarm.core.config import RunConfig
from swarm.io.data_server import DataServer
from swarm.launch.argv import command_line
from swarm.net import join_token, tls
from swarm.net.netaddr import is_wildcard
from swarm.net.relay import RelayLimits, RelayMetrics, RelayServer
from swarm.ops import logs
from swarm.ops.metrics import Metrics, MetricsServer
from swarm.ops.status import status_document

log = logging.getLogger("swarm.coordinator")

DHT_SHUTDOWN_S = 3.0
STOP_GRACE_S = 2.0
STATUS_TIMEOUT_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-coordinator", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve one run")
    serve.add_argument("--config", help="run configuration TOML (default: the embedded small run)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one)")
    join_token.add_arguments(serve)  # none given: a random one, kept in STATE.token (mode 0600)
    serve.add_argument(
        "--state", default="./coordinator.sqlite", help="SQLite state file (resumed if present)"
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="HTTP port of /metrics, /status, /healthz (0: free, -1: off)",
    )
    serve.add_argument("--metrics-host", help="address the HTTP endpoint binds (default: --host)")
    serve.add_argument("--no-dht", action="store_true", help="run without the stage-discovery DHT")
    serve.add_argument(
        "--dht-listen", help="DHT multiaddr, e.g. /ip4/0.0.0.0/tcp/7001 (default: a free TCP port on --host)"
    )
    serve.add_argument(
        "--dht-announce",
        action="append",
        default=[],
        help="multiaddr nodes dial the DHT at, e.g. /ip4/PUBLIC_IP/tcp/7001 behind NAT (repeatable; "
        "default: the listening interfaces' non-loopback addresses)",
    )
    serve.add_argument(
        "--public-dht", action="store_true", help="let the DHT map NAT ports (UPnP/NAT-PMP; production only)"
    )
    serve.add_argument(
        "--dead-after",
        type=float,
        default=CoordinatorSettings.dead_after_s,
        help="seconds without heartbeat before death",
    )
    serve.add_argument(
        "--reach-timeout",
        type=float,
        default=CoordinatorSettings.reach_timeout_s,
        help="seconds the dial-back of a joining node's announced address may take; unanswered, the "
        "node is placed as dial-only (0: no dial-back, announced addresses are trusted)",
    )
    serve.add_argument(
        "--snapshot-keepers",
        type=int,
        default=CoordinatorSettings.snapshot_keepers,
        help="nodes besides its host that keep each stage snapshot (fetched from its holders; the "
        "coordinator keeps manifests only); 0: snapshots are uploaded to the coordinator",
    )
    serve.add_argument(
        "--relay-port",
        type=int,
        help="also run a relay on --host at this port (0: a free one) for links neither of whose nodes "
        "accepts; nodes dial it at the coordinator's host",
    )
    serve.add_argument(
        "--relay",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a `swarm-coordinator relay` to plan such links through (repeatable)",
    )
    add_relay_limits(serve)
    serve.add_argument(
        "--data",
        metavar="DIR",
        help="serve this prepared corpus (swarm data prepare) over HTTP with Range requests on --host; "
        "name its URL (printed as data=) in the run's data.source",
    )
    serve.add_argument("--data-port", type=int, default=0, help="port of --data (0: a free one)")
    serve.add_argument("--log-format", choices=logs.FORMATS, default="text", help="text lines or JSON lines")
    tls.add_arguments(serve)
    relay = sub.add_parser(
        "relay",
        help="run a relay for boundary links between nodes that cannot accept streams (behind NAT)",
        description="Splices the two nodes' connections; their TLS runs end to end through it, so it "
        "cannot read or alter frames. Give its address to the coordinator with --relay. Prints "
        "`relay listening on HOST:PORT metrics=PORT` once it serves.",
    )
    relay.add_argument("--host", default="127.0.0.1", help="address to listen on")
    relay.add_argument("--port", type=int, default=0, help="port (0: a free one)")
    relay.add_argument(
        "--metrics-port", type=int, default=-1, help="HTTP port of /metrics (0: free, -1: off)"
    )
    add_relay_limits(relay)
    export = sub.add_parser(
        "export",
        help="write the run's trained model (latest complete checkpoint cut) as a model folder",
        description="Reads the state file only: works while the coordinator serves, or after the run. "
        "The coordinator also writes STATE.model/ by itself once the final cut is stored.",
    )
    export.add_argument("--state", default="./coordinator.sqlite", help="the coordinator's SQLite state file")
    export.add_argument("--out", required=True, help="model folder to write (replaced if present)")
    token = sub.add_parser(
        "token",
        help="create, list or revoke join tokens (works while the coordinator serves)",
        description="Tokens are kept in the state file as SHA-256 digests; a new token is printed once. "
        "Revoking one refuses its Join at once and evicts the nodes admitted with it at their next call.",
    )
    state = argparse.ArgumentParser(add_help=False)
    state.add_argument("--state", default="./coordinator.sqlite", help="the coordinator's SQLite state file")
    actions = token.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", parents=[state], help="create a token (printed once, on stdout)")
    create.add_argument("--label", default="", help="who or what the token is for")
    actions.add_parser("list", parents=[state], help="ids, labels, creation and revocation times")
    revoke = actions.add_parser("revoke", parents=[state], help="revoke a token")
    revoke.add_argument("id", help="the token's id (or a unique prefix of it)")
    return parser


def add_relay_limits(parser: argparse.ArgumentParser) -> None:
    """The flags that bound what a relay serves."""
    parser.add_argument(
        "--relay-max-links", type=int, default=RelayLimits.links, help="connections a relay splices at once"
    )
    parser.add_argument(
        "--relay-link-mbps",
        type=float,
        default=RelayLimits.link_mbps,
        help="Mbit/s per relayed connection and direction (0: unlimited)",
    )


def relay_limits(args: argparse.Namespace) -> RelayLimits:
    return RelayLimits(links=args.relay_max_links, link_mbps=args.relay_link_mbps)


async def run_relay(host: str, port: int, limits: RelayLimits, metrics_port: int) -> None:
    """``swarm-coordinator relay``: serve a relay until SIGINT/SIGTERM."""
    registry = CollectorRegistry()
    http = MetricsServer(registry, host, metrics_port) if metrics_port != -1 else None
    try:
        async with RelayServer(limits, RelayMetrics(registry)) as relay:
            bound = await relay.start(host, port)
            stop = _stop_on_signals()
            served = f"relay listening on {host_port(host, bound)} metrics={http.port if http else -1}"
            print(served, flush=True)
            await stop.wait()
    finally:
        if http is not None:
            http.close()


def _stop_on_signals() -> asyncio.Event:
    """An event SIGINT and SIGTERM set."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def serve_command(
    *,
    config: str | Path | None = None,
    host: str | None = None,
    port: int | None = None,
    state: str | Path | None = None,
    metrics_port: int | None = None,
    dead_after: float | None = None,
    use_dht: bool = True,
    security: Sequence[str] = (),
    relay_port: int | None = None,
    snapshot_keepers: int | None = None,
) -> list[str]:
    """A ``swarm-coordinator serve`` command line: the arguments after ``python -m swarm.coordinator.cli``
    (what :func:`main` takes). ``None`` leaves a flag at its default; ``security``: transport flags
    (:func:`swarm.net.tls.cli_flags`, or ``["--insecure"]``). The join token stays off it (``$SWARM_TOKEN``).
    """
    options = {
        "--config": config,
        "--host": host,
        "--port": port,
        "--state": state,
        "--metrics-port": metrics_port,
        "--dead-after": dead_after,
        "--relay-port": relay_port,
        "--snapshot-keepers": snapshot_keepers,
    }
    return command_line("serve", options, use_dht, security)


def load_config(path: str | None) -> RunConfig:
    """The run configuration from ``path``, or the embedded default run (:class:`RunConfig`'s defaults)."""
    return RunConfig() if path is None else RunConfig.from_toml(path)


@dataclass(frozen=True)
class Endpoints:
    """Where the coordinator serves: gRPC ``host:port``, the HTTP endpoint (port -1: off), the DHT."""

    host: str = "127.0.0.1"
    port: int = 0
    metrics_host: str | None = None  # None: host
    metrics_port: int = 0
    dht: str | None = "local"  # None (no discovery DHT), "local" (no NAT port mapping) or "public"
    dht_listen: str | None = None  # None: a free TCP port on host
    dht_announce: tuple[str, ...] = ()
    relay_port: int | None = None  # a relay in this process on host (0: a free port); None: none
    relay_limits: RelayLimits = field(default_factory=RelayLimits)
    data: str | None = None  # a prepared corpus folder served over HTTP on host; None: none
    data_port: int = 0


async def serve(service: CoordinatorService, where: Endpoints) -> None:
    """Serve ``service`` until SIGINT/SIGTERM, printing the listening line once ready."""
    data = None if where.data is None else DataServer(where.data, where.host, where.data_port)
    dht_node = None
    if where.dht is not None:
        # Imported here: hivemind is slow to import and unneeded without a DHT.
        from swarm.net.discovery import listen_maddr, start_dht, visible_maddrs

        dht_node = await start_dht(
            host_maddrs=[where.dht_listen or listen_maddr(where.host)],
            public=where.dht == "public",
            announce_maddrs=where.dht_announce,
        )
        service.dht_peers = await visible_maddrs(dht_node)
        log.info("DHT at %s", " ".join(service.dht_peers))
    server = CoordinatorServer(service, where.host, where.port)
    await server.start()
    log.info("gRPC over %s", service.security)
    relay = None
    if where.relay_port is not None:
        relay = RelayServer(where.relay_limits, RelayMetrics(service.metrics.registry))
        port = await relay.start(where.host, where.relay_port)
        local = "127.0.0.1" if is_wildcard(where.host) else where.host
        await service.add_relay(Relay(f":{port}", host_port(local, port)))
        log.info("relay on port %d (nodes dial it at the host they reach this coordinator at)", port)
    http = None
    if where.metrics_port != -1:
        loop = asyncio.get_running_loop()

        def status() -> dict:  # called on the HTTP thread: the service lives on the event loop
            async def reply():
                return service.status()

            return status_document(asyncio.run_coroutine_threadsafe(reply(), loop).result(STATUS_TIMEOUT_S))

        http = service.metrics.serve(where.metrics_port, where.metrics_host or where.host, status)
    stop = _stop_on_signals()
    metrics_port = http.port if http is not None else -1
    relaying = f" relay={relay.port}" if relay is not None else ""
    relaying += f" data={data.url}" if data is not None else ""
    print(
        f"coordinator listening on {server.address} metrics={metrics_port} run={service.run_id}{relaying}",
        flush=True,
    )
    await stop.wait()
    log.info("stopping")
    await server.stop(STOP_GRACE_S)
    if relay is not None:
        await relay.close()
    if http is not None:
        http.close()
    if data is not None:
        data.close()
    if dht_node is not None:
        # Bounded: when Ctrl-C reached p2pd too, hivemind's shutdown can wait on a dead daemon.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(dht_node.shutdown(), timeout=DHT_SHUTDOWN_S)


def export(state: str, out: str) -> int:
    """``swarm-coordinator export``: the model folder of the latest complete cut."""
    from swarm.coordinator.export import NoCheckpoint, export_from_state
    from swarm.coordinator.service import MAX_SNAPSHOT_BYTES

    try:
        manifest = export_from_state(state, out, MAX_SNAPSHOT_BYTES)
    except (OSError, sqlite3.Error, NoCheckpoint, ValueError) as e:
        print(f"swarm-coordinator export: {e}", file=sys.stderr)
        return 1
    print(
        f"model at step {manifest['step']} (subspace version {manifest['subspace_version']}) written to {out}"
    )
    return 0


def manage_tokens(args: argparse.Namespace) -> int:
    """``swarm-coordinator token create|list|revoke``: the new token alone on stdout (create)."""
    state = CoordinatorState(args.state)
    try:
        tokens = JoinTokens(state.db)
        if args.action == "create":
            secret, record = tokens.create(args.label)
            print(secret)
            print(f"token {record.id} created; it is shown only this once", file=sys.stderr)
        elif args.action == "revoke":
            record = tokens.revoke(args.id)
            print(f"token {record.id} ({record.label or 'no label'}) revoked")
        else:
            for r in tokens.list():
                created = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.created))
                revoked = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.revoked)) if r.revoked else "-"
                print(f"{r.id}  created {created}  revoked {revoked:16}  {r.label}")
    except (ValueError, sqlite3.Error) as e:
        print(f"swarm-coordinator token: {e}", file=sys.stderr)
        return 2
    finally:
        state.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point of ``swarm-coordinator``."""
    args = build_parser().parse_args(argv)
    if args.command == "export":
        return export(args.state, args.out)
    if args.command == "token":
        return manage_tokens(args)
    if args.command == "relay":
        logs.setup("text", logging.INFO)
        try:
            uvloop.run(run_relay(args.host, args.port, relay_limits(args), args.metrics_port))
        except OSError as e:
            print(f"swarm-coordinator relay: {e}", file=sys.stderr)
            return 1
        return 0
    logs.setup(args.log_format, logging.INFO)
    try:
        config = load_config(args.config)
    except (OSError, ValueError, TypeError, tomllib.TOMLDecodeError) as e:
        print(f"swarm-coordinator: cannot load run configuration {args.config}: {e}", file=sys.stderr)
        return 2
    security = tls.from_args(args, "swarm-coordinator", [host_port(args.host, args.port)])
    token = join_token.from_args(args, "swarm-coordinator")  # None: the state's, or STATE.token
    where = Endpoints(
        host=args.host,
        port=args.port,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        dht=None if args.no_dht else "public" if args.public_dht else "local",
        dht_listen=args.dht_listen,
        dht_announce=tuple(args.dht_announce),
        relay_port=args.relay_port,
        relay_limits=relay_limits(args),
        data=args.data,
        data_port=args.data_port,
    )
    try:
        service = CoordinatorService(
            config,
            token,
            args.state,
            None,
            Metrics("coordinator"),
            [],
            CoordinatorSettings(
                dead_after_s=args.dead_after,
                reach_timeout_s=args.reach_timeout,
                relays=tuple(args.relay),
                snapshot_keepers=max(0, args.snapshot_keepers),
            ),
            security=security,
        )
        uvloop.run(serve(service, where))
    except (ValueError, sqlite3.Error) as e:  # a state file holding another run, or an unusable one
        print(f"swarm-coordinator: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"swarm-coordinator: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
