"""The one backoff every retry loop uses: waits that double up to a limit, cut short by a stop event."""

from __future__ import annotations

import asyncio
import contextlib
import random

import attrs


@attrs.define
class Backoff:
    """`await backoff.wait(stop)` after each failure; `reset()` after a success."""

    first_s: float = 0.05
    limit_s: float = 2.0
    # Each wait is shortened by up to this fraction, at random, so that many callers failing
    # together (clients of one restarted service) do not all come back at the same instant.
    jitter: float = 0.0
    failures: int = attrs.field(init=False, default=0)

    def delay_after(self, failures: int) -> float:
        """The wait after the `failures`-th failure in a row (1 for the first)."""
        base = self._base(failures)
        return base * (1.0 - self.jitter * random.random()) if self.jitter else base

    @property
    def delay_s(self) -> float:
        """The next wait, before its jitter."""
        return self._base(self.failures + 1)

    def _base(self, failures: int) -> float:
        # The doubling stops at 2**63: past about a thousand failures in a row (a client
        # allowed thousands of attempts, a stage retrying through a long outage) the
        # float product overflowed and the retry loop died instead of waiting its limit.
        return min(self.first_s * 2 ** min(failures - 1, 63), self.limit_s)

    async def wait(self, stop: asyncio.Event | None = None) -> None:
        """Sleep the next delay (or until `stop` is set)."""
        self.failures += 1
        delay = self.delay_after(self.failures)
        if stop is None:
            await asyncio.sleep(delay)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)

    def reset(self) -> None:
        self.failures = 0
