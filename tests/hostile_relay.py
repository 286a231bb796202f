"""A relay that turns hostile: ``python -m tests.hostile_relay HOW AFTER_BYTES [relay flags]``.

It runs the real relay (``swarm-coordinator relay``) with its byte copying wrapped: once, past the
first ``AFTER_BYTES`` bytes of one direction of a spliced connection, it flips one bit (``flip``),
drops a chunk (``drop``) or sends a chunk twice (``replay``); before and after that it relays
honestly.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

from swarm.coordinator import cli

from swarm.net import relay

HOW = ("flip", "drop", "replay")


class Tampered:
    """A reader that alters the stream once (for every reader of the process), past its first
    ``after`` bytes: ``how`` is one of :data:`HOW`."""

    done = False

    def __init__(self, reader: asyncio.StreamReader, how: str, after: int):
        self.reader, self.how, self.after, self.seen = reader, how, after, 0

    async def read(self, n: int) -> bytes:
        data = await self.reader.read(n)
        self.seen += len(data)
        if Tampered.done or self.seen < self.after or len(data) < 64:
            return data
        Tampered.done = True
        print(f"tampered ({self.how}) after {self.seen} bytes", flush=True)
        if self.how == "flip":
            return data[:32] + bytes([data[32] ^ 0x10]) + data[33:]
        if self.how == "drop":
            return await self.reader.read(n)
        return data + data


def tampering(how: str, after: int) -> Callable[..., Awaitable[None]]:
    """:func:`swarm.net.relay.pipe` with its reader :class:`Tampered`."""
    if how not in HOW:
        raise ValueError(f"unknown tampering {how!r}; choose from {HOW}")
    honest = relay.pipe
    return lambda reader, *a, **k: honest(Tampered(reader, how, after), *a, **k)


if __name__ == "__main__":
    relay.pipe = tampering(sys.argv[1], int(sys.argv[2]))
    sys.exit(cli.main(["relay", *sys.argv[3:]]))
