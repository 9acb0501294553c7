"""Appending answers to KV_DECISIONS: a batch's records framed by one compiled call, one subscription for every ack.

`JetStreamContext.publish` costs a request (a future, a `wait_for` and its timer) per
message, and even nats-py's plain `publish` builds each message's headers in Python (a
regular expression, a strip and an encoding per header, then the protocol line): for a
batch of answers that took longer than ranking it. Here the protocol text of a whole
batch's records (`HPUB` line, headers, answer) is written by one compiled call
(`write_frames`) and handed to the connection as one write; each record's reply subject
names its batch and position under one inbox, and the acks of every batch arrive on a
single wildcard subscription and are checked as they come. Each answer keeps its own
`Nats-Msg-Id` (its request id), so a retried request is still recorded once. Where the
nats-py client lacks the internals this writes through, each record is published the
plain way, with the same headers.

An answer whose caller takes the acknowledgement itself (`RecordBatch.ack_to`, a subject under
the caller's inbox) is published with that reply subject and not waited for: JetStream
acks it to the caller, who accepts the answer only then (docs/decide.md, "On record").
Every record of a batch is on the connection before `record` returns, so a reply sent
after it follows its record.
"""

from __future__ import annotations

import asyncio
import itertools
import operator
from collections.abc import Sequence
from typing import NamedTuple

import attrs
import nats
import nats.errors
import numpy as np
from nats.aio.msg import Msg

from kvledger.core.decision_codec import (
    MAX_RELIED_BLOCKS, RELIED_PREFIX_HEADER, REQUEST_HEADER, SHADOW_HEADER, request_header,
)
from kvledger.core.reuse import ReuseRequest
from kvledger.runtime.jetstream_ack import AckError, read_ack

from kvledger.decide.compiled import compiled as _compiled
from kvledger.decide.compiled import inlined as _inlined
from kvledger.decide.ranking.kernels import copy_bytes
from kvledger.decide.ranking.ranked import BatchTargets, RequestArrays


@attrs.frozen(eq=False)
class Texts:
    """Texts end to end in one uint8 buffer: text i is `buffer[bounds[i]:bounds[i + 1]]` (empty: none)."""

    buffer: np.ndarray
    bounds: np.ndarray

    @classmethod
    def of(cls, texts: Sequence[bytes]) -> Texts:
        bounds = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)), out=bounds[1:])
        return cls(np.frombuffer(b"".join(texts), dtype=np.uint8), bounds)

    @classmethod
    def empty(cls, count: int) -> Texts:
        return cls(_NO_TEXT, np.zeros(count + 1, dtype=np.int64))

    def __len__(self) -> int:
        return self.bounds.size - 1

    def text(self, item: int) -> str:
        return self.buffer[self.bounds[item]:self.bounds[item + 1]].tobytes().decode()

    def texts(self) -> list[str]:
        """Every text as a str (one decoding, then a slice each)."""
        text = self.buffer.tobytes().decode("ascii")
        ends = (self.bounds - self.bounds[0]).tolist()
        return [text[start:end] for start, end in zip(ends, ends[1:])]


_NO_TEXT = np.zeros(0, dtype=np.uint8)
_NO_TEXT.flags.writeable = False  # as every text from bytes is: numba compiles read-only arrays as another type


def _read_only(buffer: np.ndarray) -> np.ndarray:
    """`buffer` as a read-only view: the texts reach `write_frames` one way, so it is compiled once."""
    if not buffer.flags.writeable:
        return buffer
    view = buffer.view()
    view.flags.writeable = False
    return view


@attrs.frozen(eq=False)
class RecordBatch:
    """A batch's answers as KV_DECISIONS keeps them: per answer, its reply's bytes keyed by request
    id, the hashes of the blocks it relies on (`decide.ranking.ranked.AnswerTexts.relied_prefixes`, hex), and
    optionally its request (`REQUEST_HEADER`, `request_header_texts`) and shadow answer (`SHADOW_HEADER`)."""

    request_ids: Sequence[str]
    answers: Sequence[bytes]
    relied_prefixes: Sequence[bytes]
    requests: Texts | None = None
    shadows: Texts | None = None
    # Per answer, where JetStream acks it when its caller takes the ack; None (or no list): the recorder waits for it.
    ack_to: Sequence[str | None] | None = None
    ids: Texts | None = None  # the request ids' UTF-8, when the backend already made it

    def __len__(self) -> int:
        return len(self.answers)

    def headers(self, item: int) -> dict[str, str]:
        """Record `item`'s headers beyond the two every record has, as nats-py takes them."""
        headers = {}
        if self.relied_prefixes[item]:
            headers[RELIED_PREFIX_HEADER] = self.relied_prefixes[item].decode()
        for name, texts in ((REQUEST_HEADER, self.requests), (SHADOW_HEADER, self.shadows)):
            if texts is not None and texts.bounds[item + 1] > texts.bounds[item]:
                headers[name] = texts.text(item)
        return headers


class DecisionsNotRecorded(RuntimeError):
    """KV_DECISIONS refused an answer or did not acknowledge it in time; the message says which and why."""


@attrs.define
class _PendingAcks:
    batch: RecordBatch
    positions: list[int]  # each waited record's position in the batch, by its number
    waiting: set[int]
    done: asyncio.Future


# What `_send_frames` reads and calls of a nats-py client: what its own `publish` does after building the text.
_CLIENT_INTERNALS = ("_send_command", "_flush_pending", "_flush_queue", "_max_payload", "_max_pending_size",
                     "_pending_data_size", "stats")


# Below this many records, publishing each costs less than making the arrays `write_frames`
# reads (a few µs of numpy calls a batch): a lone single request's record goes the plain way.
FRAMED_FROM = 8


class DecisionRecorder:
    """`await recorder.record(RecordBatch(…))` returns once every answer is acknowledged, or
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
        self.framed = all(hasattr(nc, name) for name in _CLIENT_INTERNALS)  # else one publish per record
        self._hpub = np.frombuffer(f"HPUB {subject} ".encode(), dtype=np.uint8)
        self._stream_line = np.frombuffer(f"\r\nNats-Expected-Stream: {stream}\r\n".encode(), dtype=np.uint8)

    async def start(self) -> None:
        self.subscription = await self._nc.subscribe(self._prefix + "*.*", cb=self._on_ack)

    async def record(self, batch: RecordBatch) -> None:
        count = len(batch)
        if not count:
            return
        ack_to = batch.ack_to
        positions = list(range(count)) if not ack_to else [p for p, to in enumerate(ack_to) if to is None]
        token = str(next(self._tokens))
        pending = None
        if positions:
            pending = _PendingAcks(batch, positions, set(range(len(positions))),
                                   asyncio.get_running_loop().create_future())
            self._batches[token] = pending
        try:
            await self._send(batch, f"{self._prefix}{token}.")
            if pending is None:
                return
            # A large batch gets more time: its acks come back one by one.
            timeout = self._timeout_s + len(positions) / 10_000
            try:
                await asyncio.wait_for(asyncio.shield(pending.done), timeout)
            except asyncio.TimeoutError:
                raise DecisionsNotRecorded(
                    f"{len(pending.waiting)} of {len(positions)} answers not acknowledged by {self._stream} "
                    f"within {timeout:.1f} s") from None
        finally:
            self._batches.pop(token, None)

    async def _send(self, batch: RecordBatch, reply_prefix: str) -> None:
        """Every record of the batch onto the connection: record i's reply is `ack_to[i]`, or
        `reply_prefix` + its number among the records waited for."""
        if not self.framed or len(batch) < FRAMED_FROM:
            await self._publish_each(batch, reply_prefix)
            return
        count = len(batch)
        ids = batch.ids if batch.ids is not None else Texts(*request_ids_of_texts(batch.request_ids))
        ack_to = Texts.empty(count) if not batch.ack_to else Texts.of([(to or "").encode() for to in batch.ack_to])
        requests = batch.requests if batch.requests is not None else Texts.empty(count)
        shadows = batch.shadows if batch.shadows is not None else Texts.empty(count)
        answers, relied = Texts.of(batch.answers), Texts.of(batch.relied_prefixes)
        frames, largest = write_frames(
            self._hpub, np.frombuffer(reply_prefix.encode(), dtype=np.uint8), ack_to.buffer, ack_to.bounds,
            _read_only(ids.buffer), ids.bounds, self._stream_line, relied.buffer, relied.bounds,
            _read_only(requests.buffer), requests.bounds, _read_only(shadows.buffer), shadows.bounds,
            answers.buffer, answers.bounds,
        )
        await _send_frames(self._nc, frames.tobytes(), count, int(answers.bounds[-1] - answers.bounds[0]),
                           int(largest))

    async def _publish_each(self, batch: RecordBatch, reply_prefix: str) -> None:
        number = 0
        for item in range(len(batch)):
            reply = batch.ack_to[item] if batch.ack_to else None
            if reply is None:
                reply, number = f"{reply_prefix}{number}", number + 1
            headers = {"Nats-Msg-Id": batch.request_ids[item], "Nats-Expected-Stream": self._stream,
                       **batch.headers(item)}
            await self._nc.publish(self._subject, batch.answers[item], reply=reply, headers=headers)

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
            request_id = pending.batch.request_ids[pending.positions[number]]
            pending.done.set_exception(DecisionsNotRecorded(
                f"{self._stream} refused the answer to request {request_id!r}: {error}"))
            return
        pending.waiting.discard(number)
        if not pending.waiting:
            pending.done.set_result(None)


def request_ids_of_texts(request_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Request ids' UTF-8 end to end, and the bounds of each (as `decide.ranking.ranked.request_ids_of`)."""
    text = "".join(request_ids).encode()
    bounds = np.zeros(len(request_ids) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, request_ids), dtype=np.int64, count=len(request_ids)), out=bounds[1:])
    if bounds[-1] != len(text):  # not all ASCII: bounds in UTF-8 bytes
        np.cumsum(np.fromiter((len(id_text.encode()) for id_text in request_ids), dtype=np.int64,
                              count=len(request_ids)), out=bounds[1:])
    return np.frombuffer(text, dtype=np.uint8), bounds


async def _send_frames(nc: nats.NATS, frames: bytes, messages: int, payload_bytes: int, largest: int) -> None:
    """What nats-py's `Client.publish` does with one message's text, for a batch's: the same checks
    (a whole record, headers too, against the server's payload limit, which counts them), then one write."""
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    if not nc.is_connected and (nc._max_pending_size <= 0
                                or len(frames) + nc._pending_data_size > nc._max_pending_size):
        raise nats.errors.OutboundBufferLimitError
    if largest > nc._max_payload:
        raise nats.errors.MaxPayloadError
    nc.stats["out_msgs"] += messages
    nc.stats["out_bytes"] += payload_bytes
    await nc._send_command(frames)
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()


# --- a batch's records as NATS protocol text, in one call -------------------------------------

_NATS_ID = np.frombuffer(b"NATS/1.0\r\nNats-Msg-Id: ", dtype=np.uint8).copy()
_RELIED_LINE = np.frombuffer(f"{RELIED_PREFIX_HEADER}: ".encode(), dtype=np.uint8).copy()
_REQUEST_LINE = np.frombuffer(f"{REQUEST_HEADER}: ".encode(), dtype=np.uint8).copy()
_SHADOW_LINE = np.frombuffer(f"{SHADOW_HEADER}: ".encode(), dtype=np.uint8).copy()


@_inlined
def _put(out, position, text):
    # A few bytes: a plain loop (a vectorised copy's set-up costs more than it saves).
    for offset in range(text.size):
        out[position + offset] = text[offset]
    return position + text.size


@_inlined
def _put_span(out, position, buffer, bounds, item):
    return copy_bytes(out, position, buffer, bounds[item], bounds[item + 1] - bounds[item])


@_inlined
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


@_inlined
def _put_crlf(out, position):
    out[position] = 13
    out[position + 1] = 10
    return position + 2


@_inlined
def _header_line(out, position, label, buffer, bounds, item):
    """`label` and text `item` and CRLF, where the text is not empty."""
    if bounds[item + 1] > bounds[item]:
        position = _put(out, position, label)
        position = _put_span(out, position, buffer, bounds, item)
        position = _put_crlf(out, position)
    return position


@_inlined
def _span(bounds, item):
    return bounds[item + 1] - bounds[item]


@_compiled
def write_frames(hpub, reply_prefix, ack_to, ack_bounds, ids, id_bounds, stream_line, relied, relied_bounds,
                 requests, request_bounds, shadows, shadow_bounds, answers, answer_bounds):
    """Every record as nats-py's `publish` writes it (`HPUB subject reply hdr_len total_len`, the
    headers `Nats-Msg-Id`, `Nats-Expected-Stream`, and each of relied-on prefix, request and shadow
    that is not empty, then the answer), end to end; and the largest record (headers and answer).

    Record i's reply is `ack_to` text i, or where that is empty `reply_prefix` and the record's
    number among those."""
    count = answer_bounds.size - 1
    size = 0
    for item in range(count):
        size += (hpub.size + reply_prefix.size + _span(ack_bounds, item) + 64 + _NATS_ID.size + _span(id_bounds, item)
                 + stream_line.size + _RELIED_LINE.size + _span(relied_bounds, item) + _REQUEST_LINE.size
                 + _span(request_bounds, item) + _SHADOW_LINE.size + _span(shadow_bounds, item) + 10
                 + _span(answer_bounds, item))
    out = np.empty(size, dtype=np.uint8)
    position = 0
    number = 0
    largest = 0
    for item in range(count):
        header_size = (_NATS_ID.size + _span(id_bounds, item) + stream_line.size + 2)
        for label, bounds in ((_RELIED_LINE, relied_bounds), (_REQUEST_LINE, request_bounds),
                              (_SHADOW_LINE, shadow_bounds)):
            if _span(bounds, item) > 0:
                header_size += label.size + _span(bounds, item) + 2
        total = header_size + _span(answer_bounds, item)
        largest = max(largest, total)
        position = _put(out, position, hpub)
        if _span(ack_bounds, item) > 0:
            position = _put_span(out, position, ack_to, ack_bounds, item)
        else:
            position = _put(out, position, reply_prefix)
            position = _put_int(out, position, number)
            number += 1
        out[position] = 32
        position = _put_int(out, position + 1, header_size)
        out[position] = 32
        position = _put_int(out, position + 1, total)
        position = _put_crlf(out, position)
        position = _put(out, position, _NATS_ID)
        position = _put_span(out, position, ids, id_bounds, item)
        position = _put(out, position, stream_line)
        position = _header_line(out, position, _RELIED_LINE, relied, relied_bounds, item)
        position = _header_line(out, position, _REQUEST_LINE, requests, request_bounds, item)
        position = _header_line(out, position, _SHADOW_LINE, shadows, shadow_bounds, item)
        position = _put_crlf(out, position)
        position = _put_span(out, position, answers, answer_bounds, item)
        position = _put_crlf(out, position)
    return out[:position], largest


# --- each record's request, written for a whole batch at once ------------------------------

# `kvledger.core.decision_codec.request_header` wrote one request in about 5.5 µs (a struct.pack,
# a hex and a msgspec encoding), more than ranking it with reuse off. Here the batch's local
# hashes, as the backend already converted them (`AnswerTexts.arrays`), are written by one
# compiled call into the same JSON, byte for byte, which `write_frames` copies into the
# records as it is: no Python value per request.
class NameSpans(NamedTuple):
    """One worker name per request, or none: request i's is `buffer[starts[i]:starts[i] + lengths[i]]`,
    none where its length is 0."""

    buffer: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray

    @classmethod
    def none(cls, count: int) -> NameSpans:
        zeros = np.zeros(count, dtype=np.int64)
        return cls(_NO_TEXT, zeros, zeros)


def _names(requests: Sequence[ReuseRequest], field: str) -> NameSpans:
    """The named workers (`target` or `fallback`) of requests, "" for none, one a line (`_line_spans`)."""
    # A worker's name needs no JSON escapes (publishers are NATS subject tokens: letters,
    # digits, '_' and '-'), so the kernel quotes it as it is; nor a line break, so the names
    # are joined by one and a compiled call finds their bounds (cheaper than a len each).
    workers = map(operator.attrgetter(field), requests)
    text = "\n".join(["" if worker is None else worker.publisher if worker.dp_rank == 0 else worker.name
                      for worker in workers]).encode()
    buffer = np.frombuffer(text, dtype=np.uint8)
    return NameSpans(buffer, *_line_spans(buffer, len(requests)))


@_compiled
def _line_spans(buffer, count):
    """Where each of `count` texts joined by line breaks starts, and its length."""
    starts = np.empty(count, dtype=np.int64)
    lengths = np.empty(count, dtype=np.int64)
    item, start = 0, 0
    for position in range(buffer.size):
        if buffer[position] == 10:
            starts[item], lengths[item] = start, position - start
            item += 1
            start = position + 1
    starts[item], lengths[item] = start, buffer.size - start
    return starts, lengths


@_compiled
def _slot_spans(slots, named, name_bounds):
    """Each request's target name read off the index's names by slot (JSON strings: the name between
    the quotes); none where it named no target."""
    count = slots.size
    starts = np.zeros(count, dtype=np.int64)
    lengths = np.zeros(count, dtype=np.int64)
    for request in range(count):
        slot = slots[request]
        if named[request] and slot >= 0:
            starts[request] = name_bounds[slot] + 1
            lengths[request] = name_bounds[slot + 1] - name_bounds[slot] - 2
    return starts, lengths


def _target_names(requests: Sequence[ReuseRequest], targets: BatchTargets | None) -> NameSpans:
    """The requests' target names: off the index's names by the slots the ranking read where every named
    target is one the index knows (no Python value per request), else from the requests."""
    if targets is not None and len(targets.slots) == len(requests) and targets.all_known:
        buffer, bounds = targets.names
        return NameSpans(buffer, *_slot_spans(targets.slots, targets.named, bounds))
    return _names(requests, "target")


_fallback = operator.attrgetter("fallback")


def request_header_texts(requests: Sequence[ReuseRequest], arrays: RequestArrays | None = None,
                         targets: BatchTargets | None = None) -> Texts:
    """Each request's `REQUEST_HEADER` value (`kvledger.core.decision_codec.request_header`'s text), from the
    batch's arrays and targets as ranked (found here when the backend did not keep them)."""
    count = len(requests)
    if not count:
        return Texts.empty(0)
    if count == 1:  # a lone single request: the arrays' numpy calls cost more than writing it in Python
        text = request_header(requests[0]).encode()
        return Texts(np.frombuffer(text, dtype=np.uint8), np.array([0, len(text)], dtype=np.int64))
    if arrays is None:
        arrays = RequestArrays.of(requests)
    target_names = _target_names(requests, targets)
    fallbacks = _names(requests, "fallback") if any(map(_fallback, requests)) else NameSpans.none(count)
    return Texts(*_request_texts(arrays.local, arrays.offsets, arrays.block_sizes, *target_names, *fallbacks,
                                 MAX_RELIED_BLOCKS))


def compile_record_kernels() -> None:
    """Compile (or load from the kernel cache) the kernels that write records, as the service calls them,
    so the first large batch does not wait for them."""
    from kvledger.core.events import WorkerId

    warm = [ReuseRequest("warm-up", (1, 2, 3), 16, WorkerId("w")), ReuseRequest("warm-up-2", (), 16)]
    requests = request_header_texts(warm)
    texts = Texts.of([b"{}", b"{}"])
    empty = Texts.empty(2)
    text = np.frombuffer(b"x", dtype=np.uint8)
    write_frames(text, text, empty.buffer, empty.bounds, texts.buffer, texts.bounds, text, texts.buffer, texts.bounds,
                 _read_only(requests.buffer), requests.bounds, empty.buffer, empty.bounds, texts.buffer, texts.bounds)


def request_texts(requests: Sequence[ReuseRequest], arrays: RequestArrays | None = None) -> list[str]:
    """`request_header_texts` as one str per request."""
    return request_header_texts(requests, arrays).texts() if requests else []



_OPEN = np.frombuffer(b'{"block_size":', dtype=np.uint8).copy()
_BLOCKS = np.frombuffer(b',"blocks":', dtype=np.uint8).copy()
_HASHES = np.frombuffer(b',"local_hashes":"', dtype=np.uint8).copy()
_TARGET = np.frombuffer(b'","target":"', dtype=np.uint8).copy()
_FALLBACK = np.frombuffer(b',"fallback":"', dtype=np.uint8).copy()
_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_SIX = np.uint64(0x0606060606060606)
_ONES = np.uint64(0x0101010101010101)
_ZEROS = np.uint64(0x3030303030303030)


@_inlined
def _hex_word(low32):
    """The 8 hex digits of a u32's four bytes, lowest byte first, each byte's high digit first,
    as a u64 whose bytes in memory (little-endian) are those digits: arithmetic, no table."""
    x = np.uint64(low32)
    # Byte i of the value to 16-bit lane i; then in each lane the high nibble to its low byte.
    x = (x & np.uint64(0xFFFF)) | ((x & np.uint64(0xFFFF0000)) << np.uint64(16))
    x = (x & np.uint64(0x000000FF000000FF)) | ((x & np.uint64(0x0000FF000000FF00)) << np.uint64(8))
    x = ((x >> np.uint64(4)) & np.uint64(0x000F000F000F000F)) | ((x & np.uint64(0x000F000F000F000F)) << np.uint64(8))
    # Per byte: '0' + nibble, and 'a' - '0' - 10 more where the nibble is 10 or more.
    letters = ((x + _SIX) >> np.uint64(4)) & _ONES
    return x + _ZEROS + letters * np.uint64(39)


@_inlined
def _hex_words(words, local, first_word, first, count):
    for block in range(count):
        value = local[first + block]
        words[first_word + 2 * block] = _hex_word(value & np.uint64(0xFFFFFFFF))
        words[first_word + 2 * block + 1] = _hex_word(value >> np.uint64(32))


@_compiled
def _request_texts(local, offsets, block_sizes, targets, target_starts, target_lengths, fallbacks, fallback_starts,
                   fallback_lengths, max_blocks):
    count = offsets.size - 1
    # The hashes' hex first, 16 digits (two u64 words) a hash, in loops that do nothing else
    # (so they vectorise): all of them at once where no request is past `max_blocks`.
    written = 0
    for request in range(count):
        written += min(offsets[request + 1] - offsets[request], max_blocks)
    words = np.empty(2 * written, dtype=np.uint64)
    if written == local.size:
        _hex_words(words, local, 0, 0, local.size)
    else:
        word = 0
        for request in range(count):
            blocks = min(offsets[request + 1] - offsets[request], max_blocks)
            _hex_words(words, local, word, offsets[request], blocks)
            word += 2 * blocks
    digits = words.view(np.uint8)
    fixed = _OPEN.size + _BLOCKS.size + _HASHES.size + _TARGET.size + _FALLBACK.size + 4 + 40
    size = 16 * written
    for request in range(count):
        size += fixed + target_lengths[request] + fallback_lengths[request]
    out = np.empty(size, dtype=np.uint8)
    bounds = np.zeros(count + 1, dtype=np.int64)
    position = 0
    at = 0
    for request in range(count):
        blocks = offsets[request + 1] - offsets[request]
        position = _put(out, position, _OPEN)
        position = _put_int(out, position, block_sizes[request])
        position = _put(out, position, _BLOCKS)
        position = _put_int(out, position, blocks)
        position = _put(out, position, _HASHES)
        length = 16 * min(blocks, max_blocks)
        position = copy_bytes(out, position, digits, at, length)
        at += length
        if target_lengths[request] > 0:
            position = _put(out, position, _TARGET)
            position = copy_bytes(out, position, targets, target_starts[request], target_lengths[request])
        out[position] = 34  # the closing quote of the hashes, or of the target
        position += 1
        if fallback_lengths[request] > 0:
            position = _put(out, position, _FALLBACK)
            position = copy_bytes(out, position, fallbacks, fallback_starts[request], fallback_lengths[request])
            out[position] = 34
            position += 1
        out[position] = 125  # }
        position += 1
        bounds[request + 1] = position
    return out[:position], bounds
