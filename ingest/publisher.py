"""JetStream publishing that never drops and never reorders a publisher's batches.

Batches wait in one bounded, ordered buffer until JetStream acknowledges them. They go out
in writes of up to `window` batches, one write at a time: each batch is an `HPUB` whose reply subject is `<inbox><token>`
on our own publishing connection (`ingest/publish_connection.py`; nats-py provisions the
streams), and every reply is read as a JetStream ack — an error reply or a no-responders
status is a failure, never success. (nats-py's `publish_async` costs a future, a
semaphore, a random token, header validation and a dataclass ack per message; this path
does the same checking for a third of the CPU.)
Any failure — an error ack, a timeout, a lost connection, a killed server — sends
everything unacknowledged again, oldest first, with the same `Nats-Msg-Id`, so
JetStream's de-duplication absorbs what had already landed.
A write goes only once every batch written before it is acknowledged. When a stream's
leader dies, the batches routed to it that it had not yet replicated are lost without a
reply, while a batch written a moment later is stored by the next leader; resent after
their ack timeout, the lost ones would land behind it, and the stream would hold a
worker's batches out of the engine's order. The server takes a write's batches in order,
within far less time than an election takes, so what a dying leader leaves of one write is
its first batches; nothing later is written while any of it is unsettled.
The connection does not reconnect by itself: nats-py would otherwise flush its own
buffer of later messages before our retries of earlier ones, and reorder the stream.
When the buffer is full, `publish` waits: the caller stops reading ZMQ (backpressure)
and the engine's replay buffer keeps the rest.
JetStream acknowledges before it fsyncs, so an acknowledged batch can still be lost (an OS
crash, a power loss). On every connection, before anything is sent on it, and between
writes when asked (`request_check`) or before the first write after a quiet spell, the
publisher awaits `check_stream`, which may put batches the stream lost back at the front
of the buffer, in order: they then go out before everything newer. An ack at a stream seq
not above the last one acknowledged says the stream went back under a connection that
stayed up (`on_stream_back`); the check then runs before the next write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import attrs
import nats
import nats.errors
import nats.js.errors

from kvledger.ingest.publish_connection import AckReply, PublishConnection, PublishConnectionError, ServerPool, msg_id_header

from kvledger.core.settings import NatsSettings
from kvledger.runtime.backoff import Backoff
from kvledger.runtime.jetstream_ack import AckError, read_ack
from kvledger.runtime.lifetime import cancel_and_wait
from kvledger.runtime.nats_options import auth_failure, connect_options, describe_server, is_auth_error
from kvledger.runtime.streams import StreamConflictError, StreamSpec, ensure_stream

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from kvledger.ingest.stream_repair import AckedPositions

log = logging.getLogger("kvledger.ingest.publisher")


class StreamCheckIncomplete(Exception):
    """A stream check on a new connection could not ask about every engine stream; `first`
    is what it found for the others. Nothing is sent on that connection: it is tried again."""

    def __init__(self, message: str, first: list[Queued]) -> None:
        super().__init__(message)
        self.first = first


# A write after this long without one checks the stream first: a crashed node takes longer
# to come back (a restart with recovery is rarely under half a second here), and a check is
# one stream lookup per engine stream, paid only by the first write of a burst.
CHECK_AFTER_QUIET_S = 0.25

_RETRYABLE = (
    asyncio.TimeoutError, OSError, nats.errors.Error, nats.js.errors.Error, AckError, StreamCheckIncomplete,
)


class _Watchdog:
    """Calls `wake` every `interval_s` until cancelled."""

    def __init__(self, interval_s: float, wake: Callable[[], None]) -> None:
        self._interval = interval_s
        self._wake = wake
        self._handle = asyncio.get_running_loop().call_later(interval_s, self._tick)

    def _tick(self) -> None:
        self._wake()
        self._handle = asyncio.get_running_loop().call_later(self._interval, self._tick)

    def cancel(self) -> None:
        self._handle.cancel()


@attrs.define
class Queued:
    """One message waiting for its ack; `positions` (with the batch's epoch and seq) learns its stream seq."""

    subject: str
    payload: bytes
    msg_id: str
    enqueued: float
    origin_ts: float | None
    positions: AckedPositions | None = None
    epoch: int = 0
    seq: int = 0


# Given a JetStream context (the fresh connection's, or None between writes), returns what
# to send before everything buffered, in order.
CheckStream = Callable[["JetStreamContext | None"], Awaitable[list[Queued]]]


@attrs.define
class PublisherCounters:
    published: int = 0
    duplicates: int = 0
    retries: int = 0
    reconnects: int = 0


class JetStreamPublisher:
    """Ordered, acknowledged, de-duplicated publishing with a bounded buffer."""

    def __init__(
        self,
        nats_settings: NatsSettings,
        streams: list[StreamSpec],
        *,
        window: int = 256,
        max_buffered: int = 10000,
        ack_timeout_s: float = 5.0,
        on_ack: Callable[[float, float | None], None] | None = None,
        check_stream: CheckStream | None = None,
        on_stream_back: Callable[[], None] | None = None,
    ) -> None:
        self._nats_settings = nats_settings
        self._streams = streams
        self._window = window
        self._ack_timeout = ack_timeout_s
        self._on_ack = on_ack
        self._check_stream = check_stream
        self._on_stream_back = on_stream_back
        self._check_requested = False
        self._last_stream_seq = 0  # the highest stream seq acked for a batch with positions
        self._pending: deque[Queued] = deque()
        self._max_buffered = max_buffered
        self._room = asyncio.Event()  # set when acks made room in a full buffer
        self._wake = asyncio.Event()  # new work, an ack, or a lost connection
        self._drained = asyncio.Event()
        self._drained.set()
        self._connected = asyncio.Event()
        self._broken = asyncio.Event()
        self._connection: PublishConnection | None = None
        self._servers = ServerPool(nats_settings.url)  # kept across connections: what the cluster announced
        self._acks: dict[int, AckReply] = {}  # token -> reply, until the pump takes it in order
        self._next_token = 0
        self._task: asyncio.Task | None = None
        self._closing = False
        self.counters = PublisherCounters()
        self.in_flight = 0
        self.last_error: str | None = None

    async def __aenter__(self) -> JetStreamPublisher:
        self._task = asyncio.create_task(self._run(), name="jetstream-publisher")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Wait until the first connection is up and the streams are provisioned."""
        waiter = asyncio.ensure_future(self._connected.wait())
        done, _ = await asyncio.wait({waiter, self._task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self._task in done:
            waiter.cancel()
            self._task.result()  # re-raises the startup error (e.g. a stream conflict)
        if waiter not in done:
            waiter.cancel()
            raise TimeoutError(
                f"no connection to NATS at {describe_server(self._nats_settings)} within {timeout}s"
                f" (last error: {self.last_error or 'none reported'})"
            )

    @property
    def buffered(self) -> int:
        return len(self._pending)

    @property
    def max_payload(self) -> int:
        """The largest message the server takes (1 MiB, NATS's default, until connected)."""
        connection = self._connection
        return connection.max_payload if connection is not None else 1024 * 1024

    def max_record(self, msg_id: str) -> int:
        """The largest payload the server takes under `msg_id`: its header counts against `max_payload`."""
        return self.max_payload - len(msg_id_header(msg_id))

    @property
    def failed(self) -> bool:
        """Publishing stopped for good (a refused login or a stream conflict)."""
        return self._task is not None and self._task.done() and not self._task.cancelled() and self._task.exception() is not None

    async def finished(self) -> None:
        """Wait for the publishing task to end; re-raise what stopped it."""
        await asyncio.shield(self._task)

    async def publish(
        self, subject: str, payload: bytes, msg_id: str, origin_ts: float | None = None,
        positions: AckedPositions | None = None, epoch: int = 0, seq: int = 0,
    ) -> None:
        """Queue one message; waits while the buffer is full (that wait is the backpressure).

        `origin_ts` (wall clock, e.g. the engine's batch ts) comes back with the ack, for latency;
        `positions` is told where the stream stored batch (`epoch`, `seq`).
        """
        if self._task is not None and self._task.done():
            self._task.result()
        while len(self._pending) >= self._max_buffered:
            # Full: wait for room, unless publishing dies meanwhile (then say why).
            self._room.clear()
            room = asyncio.ensure_future(self._room.wait())
            await asyncio.wait({room, self._task}, return_when=asyncio.FIRST_COMPLETED)
            if not room.done():
                room.cancel()
                self._task.result()
        self._pending.append(Queued(subject, payload, msg_id, time.perf_counter(), origin_ts, positions, epoch, seq))
        self._drained.clear()
        self._wake.set()

    def request_check(self) -> None:
        """Run `check_stream` before the next write (once the one in flight is settled)."""
        self._check_requested = True
        self._wake.set()

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until everything queued so far is acknowledged by JetStream."""
        waiter = asyncio.ensure_future(self._drained.wait())
        done, _ = await asyncio.wait({waiter, self._task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            waiter.cancel()
            if self._task in done:
                self._task.result()
            raise TimeoutError(f"{len(self._pending)} batches still unacknowledged")

    async def close(self, timeout: float = 10.0) -> None:
        if self._task is None:
            return
        if not self._task.done():
            try:
                await self.flush(timeout)
            except (TimeoutError, Exception) as error:  # closing must not hide the caller's own error
                log.warning("closing with unacknowledged batches: %s", error)
        self._closing = True
        await cancel_and_wait([self._task])  # a cancel swallowed while connecting would leave it pumping
        await self._disconnect()

    # --- the pump ---------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = Backoff()
        while not self._closing:
            published_before = self.counters.published
            try:
                await self._connect()
                await self._pump()
            except StreamConflictError:
                raise
            except _RETRYABLE as error:
                if is_auth_error(error):
                    raise auth_failure(self._nats_settings, error) from None
                self.last_error = f"{type(error).__name__}: {error}"
                self.counters.reconnects += 1
                log.warning("JetStream publishing interrupted (%s); resending unacknowledged batches", self.last_error)
                await self._disconnect()
                # Back off until a connection gets something acknowledged: a server that takes
                # the connection but refuses every publish must not be hammered.
                if self.counters.published > published_before:
                    backoff.reset()
                await backoff.wait()

    async def _connect(self) -> None:
        options = connect_options(self._nats_settings, name="kvledger-ingest")
        # The servers the cluster announced too, the one just left last: it may be the one that died.
        options["servers"] = self._servers.candidates()
        self._broken.clear()

        async def failed(error: Exception) -> None:
            # nats-py would print a traceback per attempt; one line in our log says enough.
            self.last_error = f"{type(error).__name__}: {error}"
            log.debug("NATS error: %s", self.last_error)

        # nats-py provisions the streams (and says clearly when a login is refused); publishing
        # has its own connection, which never reconnects by itself (see the module docstring).
        nc = await nats.connect(**options, allow_reconnect=False, max_reconnect_attempts=0, error_cb=failed)
        try:
            js = nc.jetstream()
            for spec in self._streams:
                await ensure_stream(js, spec)
            # Before anything is sent on the new connection: what the stream lost while we
            # were away must land before the resend of what is buffered.
            await self._check(js)
        finally:
            await nc.close()
        self._acks = {}
        connection = PublishConnection(
            self._nats_settings, name="kvledger-ingest", on_reply=self._on_reply, on_lost=self._on_lost,
            servers=self._servers,
        )
        await connection.__aenter__()
        self._connection = connection
        self.last_error = None
        self._connected.set()

    async def _disconnect(self) -> None:
        connection, self._connection = self._connection, None
        self.in_flight = 0
        if connection is not None:
            await connection.close()

    async def _check(self, js: JetStreamContext | None) -> None:
        self._check_requested = False
        if self._check_stream is None:
            return
        try:
            first = await self._check_stream(js)
        except StreamCheckIncomplete as error:
            if error.first:
                self._put_first(error.first)
                self._last_stream_seq = 0
            raise
        if first:
            self._put_first(first)
            # Repaired batches take the lost stream seqs again: that is not the stream going back.
            self._last_stream_seq = 0

    def _put_first(self, first: list[Queued]) -> None:
        if first:
            self._pending.extendleft(reversed(first))
            self._drained.clear()

    def _on_reply(self, reply: AckReply) -> None:
        self._acks[reply.token] = reply
        self._wake.set()

    def _on_lost(self) -> None:
        self._broken.set()
        self._wake.set()

    async def _pump(self) -> None:
        in_flight: deque[tuple[int, float]] = deque()  # (reply token, sent at)
        next_index = 0  # index in _pending of the next message to send
        # Since when nothing was sent (None: writing); the connection was checked just now.
        quiet_since: float | None = time.monotonic()
        # One timer wakes the pump a few times per ack timeout, rather than a timeout per wait.
        watchdog = _Watchdog(self._ack_timeout / 4, self._wake.set)
        try:
            while True:
                self._wake.clear()
                if not in_flight:  # so nothing buffered was sent: next_index is 0
                    # After a quiet spell the stream may have lost what it acknowledged without
                    # our connection noticing (a cluster node holding the stream crashed and came
                    # back meanwhile): check before the first write, not after it landed.
                    quiet = quiet_since is not None and time.monotonic() - quiet_since >= CHECK_AFTER_QUIET_S
                    if self._check_requested or (quiet and next_index < len(self._pending)):
                        await self._check(None)
                        quiet_since = time.monotonic()
                # Everything queued since the last write goes in one write, once that one is settled.
                if next_index < len(self._pending) and not in_flight:
                    quiet_since = None
                    next_index = self._send(in_flight, next_index)
                self.in_flight = len(in_flight)
                if self._broken.is_set():
                    # The server's own words (-ERR), so a permissions violation is told as one.
                    raise PublishConnectionError(self._connection.error or "connection to NATS lost")
                if not in_flight:
                    if not self._pending:
                        self._drained.set()
                        if quiet_since is None:
                            quiet_since = time.monotonic()
                    await self._wake.wait()
                    continue
                if in_flight[0][0] not in self._acks:
                    remaining = in_flight[0][1] + self._ack_timeout - time.monotonic()
                    if remaining <= 0:
                        raise asyncio.TimeoutError(f"no JetStream ack within {self._ack_timeout}s")
                    # Wake for an ack, a lost connection or the watchdog.
                    await self._wake.wait()
                next_index -= self._take_acks(in_flight)
        except BaseException:
            self.counters.retries += len(in_flight)  # all of them go out again on the next connection
            raise
        finally:
            watchdog.cancel()

    def _send(self, in_flight: deque[tuple[int, float]], next_index: int) -> int:
        """Publish up to `window` buffered batches in one write; returns the next index to send."""
        pending = self._pending
        token, sent_at = self._next_token, time.monotonic()
        messages = []
        while len(in_flight) + len(messages) < self._window and next_index < len(pending):
            entry = pending[next_index]
            messages.append((entry.subject, entry.payload, entry.msg_id, token))
            token += 1
            next_index += 1
        self._connection.publish_many(messages)
        in_flight.extend((message[3], sent_at) for message in messages)
        self._next_token = token
        return next_index

    def _take_acks(self, in_flight: deque[tuple[int, float]]) -> int:
        """Retire every batch at the head of the window whose ack is in; returns how many."""
        acks, taken = self._acks, 0
        try:
            while in_flight and in_flight[0][0] in acks:
                reply = acks.pop(in_flight[0][0])
                ack = read_ack(reply.status, reply.description, reply.data)  # an error ack raises: resend from here
                in_flight.popleft()
                entry = self._pending.popleft()
                taken += 1
                self.counters.published += 1
                if ack.duplicate:
                    self.counters.duplicates += 1
                positions = entry.positions
                if positions is not None:
                    if not ack.duplicate:  # a duplicate's ack names the seq of the copy stored before
                        if ack.seq <= self._last_stream_seq:
                            self._stream_went_back(ack.seq)
                        self._last_stream_seq = ack.seq
                    positions.acked(entry.epoch, entry.seq, ack.seq)
                if self._on_ack is not None:
                    self._on_ack(time.perf_counter() - entry.enqueued, entry.origin_ts)
        finally:
            if taken:
                self._room.set()
        return taken

    def _stream_went_back(self, stream_seq: int) -> None:
        log.warning(
            "JetStream acknowledged a new batch at stream seq %d, not after %d acknowledged before: "
            "the stream lost acknowledged batches; checking every engine stream before the next write",
            stream_seq, self._last_stream_seq,
        )
        if self._on_stream_back is not None:
            self._on_stream_back()
        self._check_requested = True
