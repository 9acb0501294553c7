"""The one backoff every retry loop uses: waits that double up to a limit, cut short by a stop event."""

from __future__ import annotations

import asyncio
import contextlib

import attrs


@attrs.define
class Backoff:
    """`await backoff.wait(stop)` after each failure; `reset()` after a success."""

    first_s: float = 0.05
    limit_s: float = 2.0
    delay_s: float = attrs.field(init=False)  # the next wait

    def __attrs_post_init__(self) -> None:
        self.delay_s = self.first_s

    async def wait(self, stop: asyncio.Event | None = None) -> None:
        """Sleep the next delay (or until `stop` is set), then double it up to the limit."""
        delay, self.delay_s = self.delay_s, min(self.delay_s * 2, self.limit_s)
        if stop is None:
            await asyncio.sleep(delay)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)

    def reset(self) -> None:
        self.delay_s = self.first_s
