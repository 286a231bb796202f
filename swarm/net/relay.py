"""A relay for boundary streams whose two ends can only dial out (both behind NAT, or a broken route).

Both nodes of a relayed link dial the relay; it pairs their TCP connections by a rendezvous key
and copies bytes between them. It never terminates TLS: the gRPC stream's TLS handshake (and,
under mutual TLS, the certificate pinning of the plan) and the Hello's link secret run end to end
through it, so under mutual TLS a relay can stall or break a link but cannot read or alter what
crosses it (a flipped byte fails the TLS record check and breaks the stream). Under plain TLS
the plan pins no certificate: a relay holding a node certificate could pose as either end (the
coordinator takes volunteers' relays only under mutual TLS); under ``--insecure`` nothing is
protected, as on any other path.

Every connection to a relay starts with a fixed header, :data:`HEADER_BYTES` long: the magic
``b"SWRL"``, the protocol version, a role and the 32-byte key.

* ``ROLE_PING``: the relay answers :data:`PONG` and closes (the coordinator's liveness probe).
* ``ROLE_ACCEPT``: the connection parks until a dialler of the same key arrives (at most
  ``park_s``); the relay then writes :data:`GO` to it and splices the two. The accepting node
  (:class:`RelayAcceptor`) then connects the parked socket to its own Stage server and parks a
  fresh one for the next connection.
* ``ROLE_DIAL``: paired with a parked acceptor of its key (waiting at most ``pair_s`` for one),
  else closed. The dialling node (:class:`RelayForwarder`) offers its gRPC channel a loopback
  address whose every connection it carries to the relay this way.

The key is an HMAC of the boundary's link secret (:func:`rendezvous_key`): only the link's two
nodes can compute it and the relay learns nothing of the secret. Limits (:class:`RelayLimits`)
bound what one relay serves: spliced links, parked connections, bytes per second per link.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import logging
import resource
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from swarm.net.netaddr import split_host_port

log = logging.getLogger(__name__)

MAGIC = b"SWRL"
VERSION = 1
ROLE_DIAL, ROLE_ACCEPT, ROLE_PING = 1, 2, 3
KEY_BYTES = 32
HEADER_BYTES = len(MAGIC) + 2 + KEY_BYTES
GO = b"\x01"  # to a parked acceptor: a dialler is spliced to you from the next byte on
PONG = b"PONG"
CHUNK = 1 << 16
PROBE_TIMEOUT_S = 2.0


def rendezvous_key(link_secret: str, boundary: int, upstream: str, downstream: str, epoch: int) -> bytes:
    """The key both ends of a relayed link present: derived from the boundary's secret for this
    epoch and the pair of nodes, so replicas of a stage get distinct keys and the relay cannot
    recover the secret."""
    message = f"swarm-relay|{epoch}|{boundary}|{upstream}|{downstream}".encode()
    return hmac.new(link_secret.encode(), message, hashlib.sha256).digest()


def header(role: int, key: bytes = bytes(KEY_BYTES)) -> bytes:
    """The first bytes of a connection to a relay: magic, version, ``role`` and ``key``."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a relay key is {KEY_BYTES} bytes, not {len(key)}")
    return MAGIC + bytes((VERSION, role)) + key


async def pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    counted: Callable[[int], None] = lambda n: None,
    pace: _Pace | None = None,
) -> None:
    """Copy ``reader`` to ``writer`` until end of stream, then half-close ``writer``."""
    try:
        while data := await reader.read(CHUNK):
            if pace is not None:
                await pace.take(len(data))
            writer.write(data)
            await writer.drain()
            counted(len(data))
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    counted: Callable[[int], None] = lambda n: None,
    rate_bytes_s: float = 0.0,
) -> None:
    """Copy bytes both ways between two connections until both directions end; close both."""
    try:
        await asyncio.gather(
            pipe(a[0], b[1], counted, _Pace(rate_bytes_s) if rate_bytes_s > 0 else None),
            pipe(b[0], a[1], counted, _Pace(rate_bytes_s) if rate_bytes_s > 0 else None),
        )
    finally:
        for _, writer in (a, b):
            writer.close()


class _Pace:
    """Holds a byte stream to ``rate`` bytes per second (a token bucket with a 50 ms burst)."""

    def __init__(self, rate: float):
        self.rate, self._free_at = rate, 0.0

    async def take(self, nbytes: int) -> None:
        now = asyncio.get_running_loop().time()
        self._free_at = max(self._free_at, now - 0.05) + nbytes / self.rate
        if self._free_at > now:
            await asyncio.sleep(self._free_at - now)


@dataclass(frozen=True)
class RelayLimits:
    """What one relay serves at most: ``links`` spliced at once, ``parked`` acceptor connections
    (``parked_per_key`` per link), ``connections`` open in all (``per_host`` from one address: a
    home router's nodes share one), ``link_mbps`` per link and direction (0: unlimited); how long a
    header may take (``header_s``), a dialler may wait for its acceptor (``pair_s``) and an
    acceptor may stay parked (``park_s``)."""

    links: int = 256
    parked: int = 512
    parked_per_key: int = 4
    connections: int = 1536
    per_host: int = 128
    link_mbps: float = 0.0
    header_s: float = 5.0
    pair_s: float = 10.0
    park_s: float = 300.0


class RelayMetrics:
    """The relay's counters, on ``registry`` (a coordinator's or its own)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = r = registry
        self.links = Counter("swarm_relay_links", "Connections the relay paired and spliced", registry=r)
        self.active = Gauge("swarm_relay_active_links", "Connections spliced now", registry=r)
        self.bytes = Counter("swarm_relay_bytes", "Bytes the relay copied between paired ends", registry=r)
        self.refused = Counter(
            "swarm_relay_refused",
            "Relay connections closed unpaired: bad_header, full (a limit), unpaired (no acceptor "
            "in time), expired (parked too long)",
            ["reason"],
            registry=r,
        )


@dataclass(eq=False)
class _Parked:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    claim: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _Listener:
    """An asyncio server whose every connection handler runs as a tracked task, so that closing the
    server also ends the connections it is handling (a handler is the top of its task: being
    cancelled ends it quietly)."""

    def __init__(self, handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]):
        self._handle = handle
        self._server: asyncio.Server | None = None
        self.handling: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); the bound port."""
        self._server = await asyncio.start_server(self._tracked, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def _tracked(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.handling.add(task)
        try:
            await self._handle(reader, writer)
        except asyncio.CancelledError:
            pass
        finally:
            self.handling.discard(task)

    async def close(self) -> None:
        """Stop listening and end every connection being handled."""
        if self._server is not None:
            self._server.close()
        for task in list(self.handling):
            task.cancel()
        await asyncio.gather(*self.handling, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


class RelayServer:
    """The relay: pairs dialling and parked connections by key and splices them (see the module)."""

    def __init__(self, limits: RelayLimits = RelayLimits(), metrics: RelayMetrics | None = None):
        self.limits = limits
        self.metrics = metrics or RelayMetrics(CollectorRegistry())
        self._parked: dict[bytes, list[_Parked]] = {}
        self._arrived = asyncio.Condition()
        self._listener = _Listener(self._handle)
        self._active = 0  # pairs claimed or spliced now (a claim reserves its slot)
        self._parked_count = 0
        self._per_host: collections.Counter[str] = collections.Counter()
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host:port`` (0: a free port); the bound port. Raises this process's open-file
        limit to its hard limit: every relayed link holds two sockets."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        self.port = await self._listener.start(host, port)
        return self.port

    async def close(self) -> None:
        """Stop listening and drop every parked and spliced connection."""
        await self._listener.close()

    async def __aenter__(self) -> RelayServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def parked(self) -> int:
        """Acceptor connections parked now."""
        return self._parked_count

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if peer else ""
        # this connection's own handler is already among those handled
        if (
            len(self._listener.handling) > self.limits.connections
            or self._per_host[host] >= self.limits.per_host
        ):
            self._refuse("full")
            writer.close()
            return
        self._per_host[host] += 1
        try:
            await self._serve(reader, writer)
        except (OSError, asyncio.IncompleteReadError):
            pass  # a peer's reset ends its connection quietly
        finally:
            self._per_host[host] -= 1
            if not self._per_host[host]:
                del self._per_host[host]
            writer.close()

    def _refuse(self, reason: str) -> None:
        self.metrics.refused.labels(reason).inc()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readexactly(HEADER_BYTES), self.limits.header_s)
        except (TimeoutError, asyncio.IncompleteReadError):
            self._refuse("bad_header")
            return
        magic, version, role, key = head[:4], head[4], head[5], head[6:]
        if magic != MAGIC or version != VERSION or role not in (ROLE_DIAL, ROLE_ACCEPT, ROLE_PING):
            self._refuse("bad_header")
            return
        if role == ROLE_PING:
            writer.write(PONG)
            await writer.drain()
        elif role == ROLE_ACCEPT:
            await self._park(key, reader, writer)
        else:
            await self._pair(key, reader, writer)

    async def _park(self, key: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Hold an acceptor's connection until a dialler claims it (then splice the two), it hangs
        up, or ``park_s`` passes."""
        waiting = self._parked.get(key, [])
        if len(waiting) >= self.limits.parked_per_key or self._parked_count >= self.limits.parked:
            self._refuse("full")
            return
        parked = _Parked(reader, writer)
        self._parked[key] = [*waiting, parked]
        self._parked_count += 1
        async with self._arrived:
            self._arrived.notify_all()
        hangup = asyncio.ensure_future(reader.read(1))  # an acceptor says nothing before GO
        try:
            ends = {hangup, parked.claim}
            await asyncio.wait(ends, timeout=self.limits.park_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hangup.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                await hangup
            self._unpark(key, parked)
        if not parked.claim.done():
            parked.claim.cancel()
            if hangup.cancelled():  # still parked when park_s ran out (not hung up)
                self._refuse("expired")
            return
        dialler = parked.claim.result()  # the dialler's handler reserved the link's slot
        self.metrics.links.inc()
        try:
            writer.write(GO)
            await writer.drain()
            rate = self.limits.link_mbps * 1e6 / 8
            await splice(dialler, (reader, writer), self.metrics.bytes.inc, rate)
        finally:
            self._active -= 1
            self.metrics.active.set(self._active)
            parked.done.set_result(None)

    def _unpark(self, key: bytes, parked: _Parked) -> None:
        waiting = self._parked.get(key, [])
        if parked in waiting:
            waiting.remove(parked)
            self._parked_count -= 1
        if not waiting:
            self._parked.pop(key, None)

    async def _pair(self, key: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Hand a dialler to a parked acceptor of its key (waiting ``pair_s`` for one), whose
        handler splices the two; returns when the splice ends."""

        def claimable() -> _Parked | None:
            return next((p for p in self._parked.get(key, []) if not p.claim.done()), None)

        try:
            async with self._arrived:
                parked = await asyncio.wait_for(self._arrived.wait_for(claimable), self.limits.pair_s)
                if self._active >= self.limits.links:
                    self._refuse("full")
                    return
                self._active += 1  # reserved at the claim: waiting diallers cannot overshoot
                self.metrics.active.set(self._active)
                parked.claim.set_result((reader, writer))
        except TimeoutError:
            self._refuse("unpaired")
            return
        await asyncio.shield(parked.done)


async def ping(address: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a relay answers at ``address`` within ``timeout``."""
    try:
        host, port = split_host_port(address)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError, ValueError):
        return False
    try:
        writer.write(header(ROLE_PING))
        return await asyncio.wait_for(reader.readexactly(len(PONG)), timeout) == PONG
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        writer.close()


class RelayForwarder:
    """The dialling end of a relayed link: a loopback listener whose every connection is carried
    to the relay at ``relay`` as a dialler of ``key``."""

    def __init__(self, relay: str, key: bytes):
        self.relay, self.key = relay, key
        self._listener = _Listener(self._carry)

    async def start(self) -> str:
        """Start listening; the loopback address to dial instead of the peer's."""
        return f"127.0.0.1:{await self._listener.start('127.0.0.1', 0)}"

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            host, port = split_host_port(self.relay)
            relay_reader, relay_writer = await asyncio.open_connection(host, port)
        except (OSError, ValueError) as e:
            log.warning("relay %s: cannot connect: %s", self.relay, e)
            writer.close()
            return
        relay_writer.write(header(ROLE_DIAL, self.key))
        await splice((reader, writer), (relay_reader, relay_writer))

    async def close(self) -> None:
        """Stop listening and end every connection carried to the relay."""
        await self._listener.close()


class RelayAcceptor:
    """The accepting end of a relayed link: keeps one connection parked at ``relay`` under ``key``;
    each one a dialler is spliced to is connected to ``target`` (this node's Stage server) and a
    fresh one is parked, at most ``MAX_SPLICED`` at once (a boundary needs one; more are retries or
    someone else holding the key). A relay that cannot be reached is retried until :meth:`close`;
    a parked connection that hears nothing for longer than the relay keeps it is parked anew (a
    relay or NAT mapping that vanished silently)."""

    RETRY_S = (0.2, 5.0)  # first and longest wait between attempts to park
    MAX_SPLICED = 4
    PARKED_S = RelayLimits.park_s + 30.0

    def __init__(self, relay: str, key: bytes, target: str):
        self.relay, self.key, self.target = relay, key, target
        self._task: asyncio.Task | None = None
        self._spliced: set[asyncio.Task] = set()

    def start(self) -> None:
        """Start parking (in the background, until :meth:`close`)."""
        self._task = asyncio.create_task(self._park_forever())

    async def _park_forever(self) -> None:
        wait = self.RETRY_S[0]
        while True:
            if len(self._spliced) >= self.MAX_SPLICED:
                await asyncio.wait(self._spliced, return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                paired = await self._park_one()
            except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError) as e:
                log.debug("relay %s: parking failed: %s", self.relay, e)
                paired = False
            if paired:
                wait = self.RETRY_S[0]
            else:
                await asyncio.sleep(wait)
                wait = min(wait * 2, self.RETRY_S[1])

    async def _park_one(self) -> bool:
        """Park one connection and, once a dialler claims it, splice it to the target (in the
        background); whether it was claimed."""
        host, port = split_host_port(self.relay)
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(header(ROLE_ACCEPT, self.key))
            await writer.drain()
            if await asyncio.wait_for(reader.read(1), self.PARKED_S) != GO:  # dropped: expired, full
                writer.close()
                return False
            local_host, local_port = split_host_port(self.target)
            local = await asyncio.open_connection(local_host, local_port)
        except BaseException:  # also cancelled by close(): the socket goes now, not at collection
            writer.close()
            raise
        task = asyncio.create_task(splice((reader, writer), local))
        self._spliced.add(task)
        task.add_done_callback(self._spliced.discard)
        return True

    async def close(self) -> None:
        """Stop parking and end every connection spliced through this end."""
        tasks = [t for t in (self._task, *self._spliced) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
