"""Dynamic micro-batching: concurrent single requests ranked and recorded together.

A router sends one request per prefill; answered one at a time, each pays a whole
backend call and a KV_DECISIONS round trip of its own. The batcher gathers the single
requests that arrive within `window_s` of the first one (at most `max_batch`) and answers
them with one call of the service's `answer` (one ranking, one pipelined recording), then
hands each caller its own part: `submit` returns it to an awaiting caller, `enqueue` has
the batch's own task send it (a NATS request's reply then costs no task of its own). A
reply still leaves only once its record is on its way to being acknowledged: `answer`
returns once KV_DECISIONS has acked every answer of the batch, except those whose caller
takes the ack itself (`decide.serving.recorder.Record.ack_to`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol

log = logging.getLogger("kvledger.decide")


class _Answers(Protocol):
    parts: tuple[bytes, ...]
    refused: frozenset[int]


Answer = Callable[[Sequence[object]], Awaitable[_Answers]]
# Sends one request's reply: its bytes, and whether they are its answer (not a refusal, not a failure).
Deliver = Callable[[bytes, bool], Awaitable[object]]
FailureReply = Callable[[Exception], bytes]  # the reply to every request of a batch that failed


class MicroBatcher:
    """`await batcher.submit(body)` → (this body's answer bytes, whether it was refused);
    `batcher.enqueue(body, deliver)` → `await deliver(answer bytes, answered)` once the batch is answered."""

    def __init__(self, answer: Answer, *, window_s: float, max_batch: int, failure_reply: FailureReply) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._answer = answer
        self._window_s = window_s
        self._max_batch = max_batch
        self._failure_reply = failure_reply
        self._pending: list[tuple[object, asyncio.Future | Deliver]] = []
        # What closes the open batch: a timer (a window), or a task that takes what is pending when it starts.
        self._closing: asyncio.TimerHandle | asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()

    @property
    def answers_alone(self) -> bool:
        """No window and no request waiting: one that comes now need not wait for others (`answer_alone`)."""
        return self._window_s <= 0 and not self._pending

    async def submit(self, body: object) -> tuple[bytes, bool]:
        future = asyncio.get_running_loop().create_future()
        self._add(body, future)
        return await future

    def enqueue(self, body: object, deliver: Deliver) -> None:
        self._add(body, deliver)

    async def answer_alone(self, body: object, deliver: Deliver) -> None:
        """Answer one request now, in the caller's task: for a caller that knows nothing else is
        waiting and whose answer waits on nothing (it would hold the caller up)."""
        await self._run([(body, deliver)])

    def _add(self, body: object, receiver: asyncio.Future | Deliver) -> None:
        self._pending.append((body, receiver))
        if len(self._pending) >= self._max_batch:
            self._flush()
        elif self._closing is None:
            if self._window_s > 0:
                self._closing = asyncio.get_running_loop().call_later(self._window_s, self._flush)
            else:
                # The batch closes when the loop next turns: the task that answers it starts
                # then and takes what came before it (a timer would cost one more turn).
                self._closing = self._start(self._take_pending())

    async def _take_pending(self) -> None:
        self._closing = None
        batch, self._pending = self._pending, []
        if batch:
            await self._run(batch)

    def _flush(self) -> None:
        # A task about to take what is pending is left to run: it finds what came after this.
        if isinstance(self._closing, asyncio.TimerHandle):
            self._closing.cancel()
            self._closing = None
        batch, self._pending = self._pending, []
        if batch:
            self._start(self._run(batch))

    def _start(self, work: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(work, name="decide-micro-batch")
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

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
                    await self._deliver(receiver, reply, False)
            return
        for position, (_, receiver) in enumerate(batch):
            if isinstance(receiver, asyncio.Future):
                if not receiver.done():  # its caller may have gone (a cancelled request)
                    receiver.set_result((answers.parts[position], position in answers.refused))
            else:
                await self._deliver(receiver, answers.parts[position], position not in answers.refused)

    @staticmethod
    async def _deliver(deliver: Deliver, reply: bytes, answered: bool) -> None:
        try:
            await deliver(reply, answered)
        except Exception:  # one reply that cannot be sent (a closed connection) stops no other
            log.exception("decide: a reply could not be sent")

    async def close(self) -> None:
        """Answer what is pending now, and wait for every batch under way."""
        self._flush()
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
