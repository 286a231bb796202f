"""The relays the coordinator may plan links through, and which of them answer.

A relay (:mod:`swarm.net.relay`) carries a boundary link whose two ends cannot accept each other's
stream. The coordinator knows them from ``--relay HOST:PORT`` (a ``swarm-coordinator relay``
process anywhere reachable), ``--relay-port P`` (one in its own process, planned as ``:P``: the
nodes dial it at the host they reach the coordinator at) and from volunteers that offer one at
Join (``swarm-node join --relay-port``), for as long as they stay in the run. It pings each every
few seconds; a link goes through a relay that answered the last ping, the same one for a pair of
nodes while the set of answering relays stays the same (so load spreads, and a dead relay's links
move to another).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from swarm.net.relay import ping

log = logging.getLogger("swarm.coordinator")
PROBE_INTERVAL_S = 3.0


@dataclass(frozen=True)
class Relay:
    """A relay as the plan names it (``planned``), where the coordinator pings it (``probed``), and
    the node that offered it (``owner``; empty for the operator's relays)."""

    planned: str
    probed: str
    owner: str = ""


class RelayPool:
    """The relays of a run, and which answered their last ping."""

    def __init__(self, relays: list[Relay] | None = None):
        self.relays = list(relays or [])
        self.alive: list[str] = []  # planned addresses, in the order given

    def add(self, relay: Relay) -> None:
        self.relays.append(relay)

    def drop(self, owner: str) -> bool:
        """Forget the relays ``owner`` offered (it left the run); whether any was answering."""
        gone = {r.planned for r in self.relays if r.owner == owner}
        if not gone:
            return False
        self.relays = [r for r in self.relays if r.owner != owner]
        answering = bool(gone & set(self.alive))
        self.alive = [a for a in self.alive if a not in gone]
        return answering

    def choose(self, upstream: str, downstream: str) -> str:
        """The relay for the link between two nodes ("" when none answers)."""
        if not self.alive:
            return ""
        return self.alive[zlib.crc32(f"{upstream}|{downstream}".encode()) % len(self.alive)]

    async def probe(self) -> bool:
        """Ping every relay (concurrently, bounded); whether the answering set changed."""
        answers = await asyncio.gather(*(ping(r.probed) for r in self.relays))
        alive = [r.planned for r, ok in zip(self.relays, answers, strict=True) if ok]
        changed = alive != self.alive
        for relay, ok in zip(self.relays, answers, strict=True):
            if ok != (relay.planned in self.alive):
                (log.info if ok else log.warning)(
                    "relay %s %s", relay.planned, "answers" if ok else "does not answer: its links move"
                )
        self.alive = alive
        return changed

    async def probe_forever(self, changed: Callable[[], None], interval: float = PROBE_INTERVAL_S) -> None:
        """Probe now and every ``interval`` seconds; call ``changed`` when the answering set changes."""
        while True:
            if await self.probe():
                changed()
            await asyncio.sleep(interval)
