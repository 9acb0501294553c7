"""Dynamic micro-batching: concurrent single requests ranked and recorded together.

A router sends one request per prefill; answered one at a time, each pays a whole
backend call and a KV_DECISIONS round trip of its own. The batcher gathers the single
requests that arrive within `window_s` of the first one (at most `max_batch`) and answers
them with one call of the service's `answer` (one ranking, one pipelined recording), then
hands each caller its own part. A reply still leaves only after its record is
acknowledged: `answer` returns once KV_DECISIONS has acked every answer of the batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol


class _Answers(Protocol):
    parts: tuple[bytes, ...]
    refused: frozenset[int]


Answer = Callable[[Sequence[object]], Awaitable[_Answers]]


class MicroBatcher:
    """`await batcher.submit(body)` → (this body's answer bytes, whether it was refused)."""

    def __init__(self, answer: Answer, *, window_s: float, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._answer = answer
        self._window_s = window_s
        self._max_batch = max_batch
        self._pending: list[tuple[object, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._running: set[asyncio.Task] = set()

    async def submit(self, body: object) -> tuple[bytes, bool]:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((body, future))
        if len(self._pending) >= self._max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._window_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._run(batch), name="decide-micro-batch")
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[tuple[object, asyncio.Future]]) -> None:
        try:
            answers = await self._answer([body for body, _ in batch])
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as failure:  # every caller of the batch hears why
            for _, future in batch:
                if not future.done():
                    future.set_exception(failure)
            return
        for position, (_, future) in enumerate(batch):
            if not future.done():  # its caller may have gone (a cancelled request)
                future.set_result((answers.parts[position], position in answers.refused))

    async def close(self) -> None:
        """Answer what is pending now, and wait for every batch under way."""
        self._flush()
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
