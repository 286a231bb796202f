"""A node's uplink, measured from its own boundary traffic.

A boundary stream's writes are paced by the link (gRPC's flow control, or an emulated link's
shaper) whenever the stream is backlogged: the next message is already waiting when one is written.
Those writes' bytes over their durations, across the recent ones, estimate what the uplink carries;
writes with nothing waiting behind them measure the producer, not the link, and are left out.
Concurrent backlogged streams each see a share of the link, so the estimate errs low (a cap set
from it errs on the side of the boundary traffic it protects).
"""

from __future__ import annotations

import collections
import time

WINDOW_S = 30.0  # samples older than this are forgotten
MIN_SECONDS = 0.05  # backlogged write time before an estimate is given


class UplinkMeter:
    """Goodput of backlogged writes over the last :data:`WINDOW_S` seconds (running totals, so a
    read costs only the samples it forgets)."""

    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._samples: collections.deque[tuple[float, int, float]] = collections.deque()  # (at, bytes, s)
        self._bytes, self._seconds = 0, 0.0

    def record(self, nbytes: int, seconds: float) -> None:
        """One backlogged write of ``nbytes`` that took ``seconds``."""
        if nbytes > 0 and seconds > 0:
            self._samples.append((self.clock(), nbytes, seconds))
            self._bytes, self._seconds = self._bytes + nbytes, self._seconds + seconds

    def mbps(self) -> float | None:
        """The estimate in Mbit/s, or None while too little was measured recently."""
        horizon = self.clock() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            _, nbytes, seconds = self._samples.popleft()
            self._bytes, self._seconds = self._bytes - nbytes, self._seconds - seconds
        if not self._samples or self._seconds < MIN_SECONDS:
            return None
        return 8 * self._bytes / self._seconds / 1e6
