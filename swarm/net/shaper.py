"""An emulated link in the transport: a rate limit and a one-way delay on one stream's sends.

The kernel of these machines has no ``netem``, so demos and benchmarks that need a
slow, distant link shape it here. Transmission is serialised at ``mbps`` (a message of
n bytes occupies the link for ``8 n / rate`` seconds) and each message is delivered
``latency_ms`` after its transmission ends; consecutive messages pipeline, as on a
real link, so latency is paid once per round trip and not once per message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkProfile:
    mbps: float = 0.0  # 0: unlimited
    latency_ms: float = 0.0  # one-way delay

    @property
    def shaped(self) -> bool:
        return self.mbps > 0 or self.latency_ms > 0


class ShapedSender:
    """Calls ``write(msg)`` for each sent message as the emulated link would deliver it."""

    def __init__(self, write: Callable[[object], Awaitable[None]], profile: LinkProfile):
        self.write, self.profile = write, profile
        self._link_free_at = 0.0
        self._in_flight: asyncio.Queue[tuple[float, object] | None] = asyncio.Queue()
        self._deliverer = asyncio.create_task(self._deliver())

    async def send(self, message: object, nbytes: int) -> None:
        """Occupy the link for the message's transmission time, then hand it to the delay line.

        Raises what an earlier delivery raised: the link is then broken for good.
        """
        if self._deliverer.done():
            self._deliverer.result()  # re-raises the delivery's exception
            raise RuntimeError("the emulated link is closed")
        now = time.monotonic()
        start = max(now, self._link_free_at)
        tx = 8 * nbytes / (self.profile.mbps * 1e6) if self.profile.mbps > 0 else 0.0
        self._link_free_at = start + tx
        if self._link_free_at > now:
            await asyncio.sleep(self._link_free_at - now)
        await self._in_flight.put((self._link_free_at + self.profile.latency_ms / 1e3, message))

    async def _deliver(self) -> None:
        while (item := await self._in_flight.get()) is not None:
            due, message = item
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.write(message)

    async def close(self) -> None:
        """Deliver what is in flight, then stop."""
        await self._in_flight.put(None)
        await self._deliverer


UNSHAPED = LinkProfile()
