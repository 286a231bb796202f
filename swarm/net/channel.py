"""gRPC channel and server options shared by every endpoint: message limits and keepalive.

Keepalive pings run on every channel and server, with or without calls in flight, so a
half-open connection (a peer frozen, unplugged or partitioned) fails its calls and
streams within ``time_s + timeout_s`` seconds instead of at a step timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from swarm.net.tls import INSECURE, Security

MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class KeepAlive:
    time_s: float = 5.0  # ping after this long without traffic
    timeout_s: float = 10.0  # a ping unanswered this long closes the connection


DEFAULT_KEEPALIVE = KeepAlive()


def _common(keepalive: KeepAlive) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", int(keepalive.time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive.timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect quickly once a restarted peer is back (gRPC's default backoff grows to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def channel_options(keepalive: KeepAlive = DEFAULT_KEEPALIVE) -> list[tuple[str, int]]:
    return _common(keepalive)


def server_options(keepalive: KeepAlive = DEFAULT_KEEPALIVE) -> list[tuple[str, int]]:
    """Server side: accept the clients' pings (at most one per second) and ping them too."""
    return [
        *_common(keepalive),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


def open_channel(
    address: str,
    security: Security = INSECURE,
    keepalive: KeepAlive = DEFAULT_KEEPALIVE,
    server_name: str | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel with our limits and keepalive (``server_name``: :meth:`Security.aio_channel`)."""
    return security.aio_channel(address, channel_options(keepalive), server_name)
