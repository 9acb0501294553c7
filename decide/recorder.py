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
import numpy as np
from nats.aio.msg import Msg

from kvledger.decision_codec import MAX_RELIED_BLOCKS, RELIED_PREFIX_HEADER, REQUEST_HEADER
from kvledger.events import WorkerId
from kvledger.reuse import ReuseRequest
from kvledger.runtime.jetstream_ack import AckError, read_ack

from decide.compiled import compiled as _compiled
from decide.kernels import _HEX_PAIRS, _BYTE
from decide.ranked import RequestArrays


@attrs.frozen
class Record:
    """One answer as KV_DECISIONS keeps it: the reply's bytes, keyed by request id, and the
    hashes of the blocks it relies on (`decide.ranked.AnswerBatch.relied_prefixes`)."""

    request_id: str
    answer: bytes
    relied_prefix: bytes = b""
    ack_to: str | None = None  # where JetStream acks it when the caller takes the ack; None: the recorder waits for it
    headers: Mapping[str, str] | None = None  # what else the record carries: a shadow answer
    request: str = ""  # its `REQUEST_HEADER` (`request_texts`); "": none


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
        if record.request:
            headers[REQUEST_HEADER] = record.request
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


# --- each record's request, written for a whole batch at once ------------------------------

# `kvledger.decision_codec.request_header` wrote one request in about 5.5 µs (a struct.pack,
# a hex and a msgspec encoding), more than ranking it with reuse off. Here the batch's local
# hashes, as the backend already converted them (`AnswerTexts.arrays`), are written by one
# compiled call into the same JSON, byte for byte, and split like the answers.
def _name_texts(workers: list[WorkerId | None]) -> tuple[np.ndarray, np.ndarray]:
    # A worker's name needs no JSON escapes (publishers are NATS subject tokens: letters,
    # digits, '_' and '-'), so the names are quoted end to end.
    names = ['"' + worker.name + '"' if worker is not None else "" for worker in workers]
    bounds = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, names), dtype=np.int64, count=len(names)), out=bounds[1:])
    return np.frombuffer("".join(names).encode(), dtype=np.uint8), bounds


_NO_NAME = np.zeros(1, dtype=np.uint8)


def request_texts(requests: Sequence[ReuseRequest], arrays: RequestArrays | None = None) -> list[str]:
    """Each request's `REQUEST_HEADER` value (`kvledger.decision_codec.request_header`'s text), from the
    batch's arrays (made here when the backend did not keep them)."""
    count = len(requests)
    if not count:
        return []
    if arrays is None:
        arrays = RequestArrays.of(requests)
    no_names = np.zeros(count + 1, dtype=np.int64)
    targets = [request.target for request in requests]
    target_text, target_bounds = _name_texts(targets) if targets.count(None) != count else (_NO_NAME, no_names)
    fallbacks = [request.fallback for request in requests]
    fallback_text, fallback_bounds = (_name_texts(fallbacks) if fallbacks.count(None) != count
                                      else (_NO_NAME, no_names))
    buffer, bounds = _request_texts(arrays.local, arrays.offsets, arrays.block_sizes, target_text, target_bounds,
                                    fallback_text, fallback_bounds, MAX_RELIED_BLOCKS)
    # One ASCII decoding for the batch, then a slice each: the headers are str (nats-py's type).
    text = buffer.tobytes().decode("ascii")
    ends = bounds.tolist()
    return [text[start:end] for start, end in zip(ends, ends[1:])]


_OPEN = np.frombuffer(b'{"block_size":', dtype=np.uint8)
_BLOCKS = np.frombuffer(b',"blocks":', dtype=np.uint8)
_HASHES = np.frombuffer(b',"local_hashes":"', dtype=np.uint8)
_TARGET = np.frombuffer(b'","target":', dtype=np.uint8)
_FALLBACK = np.frombuffer(b',"fallback":', dtype=np.uint8)


@_compiled
def _put(out, position, text):
    for offset in range(text.size):
        out[position + offset] = text[offset]
    return position + text.size


@_compiled
def _put_span(out, position, text, start, end):
    for offset in range(end - start):
        out[position + offset] = text[start + offset]
    return position + end - start


@_compiled
def _put_int(out, position, value):
    digits = 1
    rest = value // 10
    while rest:
        digits += 1
        rest //= 10
    for place in range(digits - 1, -1, -1):
        out[position + place] = 48 + value % 10
        value //= 10
    return position + digits


@_compiled
def _request_texts(local, offsets, block_sizes, targets, target_bounds, fallbacks, fallback_bounds, max_blocks):
    count = offsets.size - 1
    bounds = np.zeros(count + 1, dtype=np.int64)
    fixed = _OPEN.size + _BLOCKS.size + _HASHES.size + _TARGET.size + _FALLBACK.size + 2 + 40
    for request in range(count):
        blocks = min(offsets[request + 1] - offsets[request], max_blocks)
        bounds[request + 1] = (bounds[request] + fixed + blocks * 16 + target_bounds[request + 1] - target_bounds[request]
                               + fallback_bounds[request + 1] - fallback_bounds[request])
    out = np.empty(bounds[count], dtype=np.uint8)
    written = np.zeros(count + 1, dtype=np.int64)
    position = 0
    for request in range(count):
        start, end = offsets[request], offsets[request + 1]
        position = _put(out, position, _OPEN)
        position = _put_int(out, position, block_sizes[request])
        position = _put(out, position, _BLOCKS)
        position = _put_int(out, position, end - start)
        position = _put(out, position, _HASHES)
        for block in range(start, min(end, start + max_blocks)):
            value = local[block]
            for byte in range(8):
                pair = _HEX_PAIRS[(value >> np.uint64(8 * byte)) & _BYTE]
                out[position] = pair & 0xFF
                out[position + 1] = pair >> 8
                position += 2
        if target_bounds[request + 1] > target_bounds[request]:
            position = _put(out, position, _TARGET)
            position = _put_span(out, position, targets, target_bounds[request], target_bounds[request + 1])
        else:
            out[position] = 34  # the closing quote of the hashes
            position += 1
        if fallback_bounds[request + 1] > fallback_bounds[request]:
            position = _put(out, position, _FALLBACK)
            position = _put_span(out, position, fallbacks, fallback_bounds[request], fallback_bounds[request + 1])
        out[position] = 125  # }
        position += 1
        written[request + 1] = position
    return out[:position], written
