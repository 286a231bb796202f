"""What a node must hear of at once: a new plan epoch, a cut request, the end of the run.

Nodes heartbeat by long poll: the coordinator holds a heartbeat's reply up to the hold the node
asks for (about one heartbeat interval), and answers as soon as one of those changes. A plan then
reaches every node in a round trip instead of up to a heartbeat interval later (twice per lost
replica: its siblings' epoch, then the newcomer's), while an idle node still heartbeats about
once per interval.
"""

from __future__ import annotations

import asyncio
import contextlib

MAX_HOLD_MS = 10_000  # the longest a heartbeat's reply is held: well inside a node's call deadline


class Bulletin:
    """Wakes every waiter at each :meth:`post`; a waiter then checks whether the news is its own."""

    def __init__(self) -> None:
        self._posted = asyncio.Event()

    def post(self) -> None:
        """Something nodes must hear of changed."""
        self._posted.set()
        self._posted = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        """Until the next :meth:`post`, or ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._posted.wait(), timeout)
