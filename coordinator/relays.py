"""The relays the coordinator may plan links through, and which of them answer.

A relay (:mod:`swarm.net.relay`) carries a boundary link whose two ends cannot accept each other's
stream. The coordinator knows them from ``--relay HOST:PORT`` (a ``swarm-coordinator relay``
process anywhere reachable), ``--relay-port P`` (one in its own process, planned as ``:P``: the
nodes dial it at the host they reach the coordinator at) and from volunteers that offer one at
Join (``swarm-node join --relay-port``), for as long as they stay in the run. It pings each every
few seconds; a link goes through a relay that answers, chosen per pair of nodes by rendezvous
hashing (load spreads, and when a relay dies or comes only its own pairs move). A relay counts as
gone after :data:`MISSES_TO_DROP` pings in a row go unanswered, so one ping lost to a busy host does
not move its links (and restart the epoch).
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
MISSES_TO_DROP = 2  # consecutive unanswered pings before a relay's links move


@dataclass(frozen=True)
class Relay:
    """A relay as the plan names it (``planned``), where the coordinator pings it (``probed``), and
    the node that offered it (``owner``; empty for the operator's relays)."""

    planned: str
    probed: str
    owner: str = ""


class RelayPool:
    """The relays of a run, and which answer (did not miss the last :data:`MISSES_TO_DROP` pings)."""

    def __init__(self, relays: list[Relay] | None = None):
        self.relays = list(relays or [])
        self.alive: list[str] = []  # planned addresses, in the order given
        self._avoided: dict[tuple[str, str], set[str]] = {}  # (upstream, downstream) -> relays that failed it
        self._misses: dict[str, int] = {}  # planned address -> pings in a row it did not answer
        self._probing = asyncio.Lock()  # one probe at a time: a slow one cannot undo a newer one

    def add(self, relay: Relay) -> None:
        """Plan with ``relay`` too, once it answers a :meth:`probe`."""
        self.relays.append(relay)

    def drop(self, owner: str) -> None:
        """Forget the relays ``owner`` offered (it left the run)."""
        gone = {r.planned for r in self.relays if r.owner == owner}
        self.relays = [r for r in self.relays if r.owner != owner]
        self.alive = [a for a in self.alive if a not in gone]

    def choose(self, upstream: str, downstream: str) -> str:
        """The relay for the link between two nodes ("" when none answers): one that has not failed
        this pair, else (all have) any that answers."""
        avoided = self._avoided.get((upstream, downstream), set())
        candidates = [r for r in self.alive if r not in avoided] or self.alive
        pair = f"{upstream}|{downstream}|"
        return max(candidates, key=lambda r: zlib.crc32((pair + r).encode()), default="")

    def avoid(self, upstream: str, downstream: str, relay: str) -> None:
        """The pair's link failed through ``relay`` in two consecutive epochs although the relay
        answers pings (full, or not splicing): choose another for this pair while there is one."""
        self._avoided.setdefault((upstream, downstream), set()).add(relay)

    async def probe(self) -> bool:
        """Ping every relay (concurrently, each bounded by the ping's timeout); whether the
        answering set changed."""
        async with self._probing:
            relays = list(self.relays)  # add() and drop() may change the list while pings run
            answers = await asyncio.gather(*(ping(r.probed) for r in relays))
            known = {r.planned for r in self.relays}  # dropped meanwhile: not alive, whatever it said
            for relay, ok in zip(relays, answers, strict=True):
                self._misses[relay.planned] = 0 if ok else self._misses.get(relay.planned, 0) + 1
            alive = [
                r.planned
                for r, ok in zip(relays, answers, strict=True)
                if r.planned in known
                and (ok or (r.planned in self.alive and self._misses[r.planned] < MISSES_TO_DROP))
            ]
            for relay in relays:
                if (relay.planned in alive) != (relay.planned in self.alive):
                    up = relay.planned in alive
                    (log.info if up else log.warning)(
                        "relay %s %s", relay.planned, "answers" if up else "does not answer: its links move"
                    )
            changed, self.alive = alive != self.alive, alive
            return changed

    async def probe_forever(self, changed: Callable[[], None], interval: float = PROBE_INTERVAL_S) -> None:
        """Probe now and every ``interval`` seconds; call ``changed`` when the answering set changes."""
        while True:
            if await self.probe():
                changed()
            await asyncio.sleep(interval)
