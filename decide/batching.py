"""Dynamic micro-batching: concurrent single requests ranked and recorded together.

A router sends one request per prefill; answered one at a time, each pays a whole
backend call and a KV_DECISIONS round trip of its own. The batcher gathers the single
requests that arrive within `window_s` of the first one (at most `max_batch`) and answers
them with one call of the service's `answer` (one ranking, one pipelined recording), then
hands each caller its own part: `submit` returns it to an awaiting caller, `enqueue` has
the batch's own task send it (a NATS request's reply then costs no task of its own). A
reply still leaves only after its record is acknowledged: `answer` returns once
KV_DECISIONS has acked every answer of the batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

log = logging.getLogger("kvledger.decide")


class _Answers(Protocol):
    parts: tuple[bytes, ...]
    refused: frozenset[int]


Answer = Callable[[Sequence[object]], Awaitable[_Answers]]
Deliver = Callable[[bytes], Awaitable[object]]  # sends one request's reply
FailureReply = Callable[[Exception], bytes]  # the reply to every request of a batch that failed


class MicroBatcher:
    """`await batcher.submit(body)` → (this body's answer bytes, whether it was refused);
    `batcher.enqueue(body, deliver)` → `await deliver(answer bytes)` once the batch is answered."""

    def __init__(self, answer: Answer, *, window_s: float, max_batch: int, failure_reply: FailureReply) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._answer = answer
        self._window_s = window_s
        self._max_batch = max_batch
        self._failure_reply = failure_reply
        self._pending: list[tuple[object, asyncio.Future | Deliver]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._running: set[asyncio.Task] = set()

    async def submit(self, body: object) -> tuple[bytes, bool]:
        future = asyncio.get_running_loop().create_future()
        self._add(body, future)
        return await future

    def enqueue(self, body: object, deliver: Deliver) -> None:
        self._add(body, deliver)

    def _add(self, body: object, receiver: asyncio.Future | Deliver) -> None:
        self._pending.append((body, receiver))
        if len(self._pending) >= self._max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._window_s, self._flush)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._run(batch), name="decide-micro-batch")
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[tuple[object, asyncio.Future | Deliver]]) -> None:
        try:
            answers = await self._answer([body for body, _ in batch])
        except asyncio.CancelledError:
            for _, receiver in batch:
                if isinstance(receiver, asyncio.Future):
                    receiver.cancel()
            raise
        except Exception as failure:  # every caller of the batch hears why
            reply = self._failure_reply(failure)
            for _, receiver in batch:
                if isinstance(receiver, asyncio.Future):
                    if not receiver.done():
                        receiver.set_exception(failure)
                else:
                    await self._deliver(receiver, reply)
            return
        for position, (_, receiver) in enumerate(batch):
            if isinstance(receiver, asyncio.Future):
                if not receiver.done():  # its caller may have gone (a cancelled request)
                    receiver.set_result((answers.parts[position], position in answers.refused))
            else:
                await self._deliver(receiver, answers.parts[position])

    @staticmethod
    async def _deliver(deliver: Deliver, reply: bytes) -> None:
        try:
            await deliver(reply)
        except Exception:  # one reply that cannot be sent (a closed connection) stops no other
            log.exception("decide: a reply could not be sent")

    async def close(self) -> None:
        """Answer what is pending now, and wait for every batch under way."""
        self._flush()
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
