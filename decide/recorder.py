"""Appending answers to KV_DECISIONS: one publish per answer, one subscription for every ack.

`JetStreamContext.publish` costs a request (a future, a `wait_for` and its timer) per
message, which made recording a batch of 1 024 answers take longer than ranking it.
Here each answer is a plain publish whose reply subject names its batch and position
under one inbox; the acks of every batch arrive on a single wildcard subscription and are
checked as they come. Each answer keeps its own `Nats-Msg-Id` (its request id), so a
retried request is still recorded once.

An answer whose caller takes the acknowledgement itself (`Record.ack_to`, a subject under
the caller's inbox) is published with that reply subject and not waited for: JetStream
acks it to the caller, who accepts the answer only then (docs/decide.md, "On record").
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence

import attrs
import nats
from nats.aio.msg import Msg

from kvledger.decision_codec import RELIED_PREFIX_HEADER
from kvledger.runtime.jetstream_ack import AckError, read_ack


@attrs.frozen
class Record:
    """One answer as KV_DECISIONS keeps it: the reply's bytes, keyed by request id, and the
    hashes of the blocks it relies on (`decide.ranked.AnswerBatch.relied_prefixes`)."""

    request_id: str
    answer: bytes
    relied_prefix: bytes = b""
    ack_to: str | None = None  # where JetStream acks it when the caller takes the ack; None: the recorder waits for it
    headers: Mapping[str, str] | None = None  # what else the record carries: the request, a shadow answer


class DecisionsNotRecorded(RuntimeError):
    """KV_DECISIONS refused an answer or did not acknowledge it in time; the message says which and why."""


@attrs.define
class _PendingAcks:
    answers: Sequence[Record]  # by position
    waiting: set[int]
    done: asyncio.Future


class DecisionRecorder:
    """`await recorder.record([Record(…), …])` returns once every answer is acknowledged, or
    published where its caller takes the acknowledgement."""

    def __init__(self, nc: nats.NATS, subject: str, stream: str, *, timeout_s: float = 5.0) -> None:
        self._nc = nc
        self._subject = subject
        self._stream = stream
        self._timeout_s = timeout_s
        self._prefix = nc.new_inbox() + "."
        self._batches: dict[str, _PendingAcks] = {}
        self._tokens = itertools.count()
        self.subscription = None

    async def start(self) -> None:
        self.subscription = await self._nc.subscribe(self._prefix + "*.*", cb=self._on_ack)

    async def record(self, answers: Sequence[Record]) -> None:
        waited = [record for record in answers if record.ack_to is None]
        for record in answers:
            if record.ack_to is not None:
                await self._publish(record, record.ack_to)
        if not waited:
            return
        token = str(next(self._tokens))
        pending = _PendingAcks(waited, set(range(len(waited))), asyncio.get_running_loop().create_future())
        self._batches[token] = pending
        reply = f"{self._prefix}{token}."
        try:
            for number, record in enumerate(waited):
                await self._publish(record, f"{reply}{number}")
            # A large batch gets more time: its acks come back one by one.
            timeout = self._timeout_s + len(waited) / 10_000
            try:
                await asyncio.wait_for(asyncio.shield(pending.done), timeout)
            except asyncio.TimeoutError:
                raise DecisionsNotRecorded(
                    f"{len(pending.waiting)} of {len(waited)} answers not acknowledged by {self._stream} "
                    f"within {timeout:.1f} s") from None
        finally:
            self._batches.pop(token, None)

    async def _publish(self, record: Record, reply: str) -> None:
        headers = {"Nats-Msg-Id": record.request_id, "Nats-Expected-Stream": self._stream}
        if record.relied_prefix:
            headers[RELIED_PREFIX_HEADER] = record.relied_prefix.decode()
        if record.headers:
            headers.update(record.headers)
        await self._nc.publish(self._subject, record.answer, reply=reply, headers=headers)

    async def _on_ack(self, msg: Msg) -> None:
        token, _, number_text = msg.subject[len(self._prefix):].partition(".")
        pending = self._batches.get(token)
        if pending is None or pending.done.done():
            return  # a late ack of a batch that already failed or timed out
        number = int(number_text)
        headers = msg.headers or {}
        try:
            read_ack(headers.get("Status"), headers.get("Description", ""), msg.data)
        except AckError as error:
            pending.done.set_exception(DecisionsNotRecorded(
                f"{self._stream} refused the answer to request {pending.answers[number].request_id!r}: {error}"))
            return
        pending.waiting.discard(number)
        if not pending.waiting:
            pending.done.set_result(None)
