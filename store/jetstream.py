"""The JetStream side of store: connecting, making sure streams exist as specified, consumers."""

from __future__ import annotations

import asyncio
import functools
import json
import logging

import nats
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, Header, StatusCode
from nats.js.errors import APIError, NotFoundError

from kvledger.core.settings import NatsSettings
from kvledger.runtime.backoff import Backoff
from kvledger.runtime.nats_options import NatsAuthError, auth_failure, connect_options, describe_server, is_auth_error

log = logging.getLogger("kvledger.store")


async def connect(settings: NatsSettings, stop: asyncio.Event) -> nats.NATS | None:
    """Connect, retrying with backoff until it works or `stop` is set (then None).

    A refused login is not retried: it raises NatsAuthError, whose one line says which
    credentials were used (never their values).
    """
    backoff = Backoff(first_s=0.1, limit_s=5.0)
    while not stop.is_set():
        refused = asyncio.Event()
        errors: list[Exception] = []

        async def on_error(error: Exception) -> None:
            # nats-py keeps retrying a refused login on its own; notice it and stop instead.
            if is_auth_error(error):
                errors.append(error)
                refused.set()
            elif "permissions violation" in str(error).lower():
                # The server's words: which subject this user may not use (its request then times out).
                log.error("NATS refused store's user: %s", error)

        # Once connected, never give up: the projector waits out a NATS restart.
        connecting = asyncio.ensure_future(nats.connect(
            **connect_options(settings, name="kvledger-store"), max_reconnect_attempts=-1, reconnect_time_wait=0.5,
            error_cb=on_error,
        ))  # fmt: skip
        watching = asyncio.ensure_future(refused.wait())
        try:
            await asyncio.wait({connecting, watching}, return_when=asyncio.FIRST_COMPLETED)
            if not connecting.done():
                connecting.cancel()
                raise auth_failure(settings, errors[0])
            return connecting.result()
        except NatsAuthError:
            raise
        except Exception as error:  # nats-py raises several unrelated types for "not reachable"
            if is_auth_error(error):
                raise auth_failure(settings, error) from None
            log.warning("NATS at %s not reachable (%s); retrying in %.1fs", describe_server(settings), error, backoff.delay_s)
            await backoff.wait(stop)
        finally:
            watching.cancel()
    return None


async def bind_consumer(
    js: JetStreamContext, stream: str, durable: str, after_seq: int, *, batch_size: int
) -> JetStreamContext.PullSubscription:
    """A durable pull consumer delivering from `after_seq + 1`.

    The SQL checkpoint, not the consumer's ack floor, is the truth about what is done, so
    the consumer is recreated at it on every start: a consumer left ahead of the database
    (a restored or replaced database) would otherwise skip messages.
    """
    try:
        await js.delete_consumer(stream, durable)
    except NotFoundError:
        pass
    config = ConsumerConfig(
        durable_name=durable,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE if after_seq > 0 else DeliverPolicy.ALL,
        opt_start_seq=after_seq + 1 if after_seq > 0 else None,
        # One ack per transaction acknowledges everything before it.
        ack_policy=AckPolicy.ALL,
        ack_wait=120.0,
        max_ack_pending=max(4 * batch_size, 1024),
        max_waiting=16,
    )
    await js.add_consumer(stream, config)
    return await js.pull_subscribe_bind(durable=durable, stream=stream)


# Statuses that end a pull request: nothing (more) to deliver, the request expired, or the
# server ended it (too many waiting requests, a leadership change, the consumer deleted).
_REQUEST_ENDED = frozenset({StatusCode.NO_MESSAGES, StatusCode.REQUEST_TIMEOUT, StatusCode.CONFLICT})


async def fetch(subscription: JetStreamContext.PullSubscription, batch: int, timeout: float) -> list[Msg]:
    """Up to `batch` messages of a pull consumer, as `subscription.fetch(batch, timeout)` returns them.

    nats-py's fetch waits for each message with a task and a timer of its own, which cost
    store more than folding the message (0.48 s of a core for 14 375 messages, against 0.13
    s this way). Here the messages are taken from the subscription's queue under one
    deadline for the whole batch. The requests and the statuses are handled as nats-py does:
    what is queued first; then a no-wait request for the rest (a lingering one when nothing
    was queued), where a status other than the request's end or a heartbeat raises APIError;
    then, when that brought nothing, one lingering request, waited for until the deadline
    whatever status comes. TimeoutError when nothing came.
    """
    sub = getattr(subscription, "_sub", None)
    if not _FAST_FETCH_ATTRIBUTES <= set(vars(subscription)) or not hasattr(sub, "_pending_queue"):
        # A nats-py whose pull subscription is laid out otherwise: its own fetch, slower.
        _warn_slow_fetch()
        return await subscription.fetch(batch, timeout=timeout)
    queue = sub._pending_queue
    deadline = asyncio.get_running_loop().time() + timeout
    messages: list[Msg] = []
    while not queue.empty() and len(messages) < batch:
        message = queue.get_nowait()
        sub._pending_size -= len(message.data)
        if not _status(message):  # a status here ended an earlier request
            messages.append(message)
    if len(messages) == batch:
        return messages
    request = {"batch": batch - len(messages), "no_wait": True}
    if not messages:  # the server then holds it open until it expires
        request["expires"] = int(timeout * 1e9) - 100_000
    await _pull(subscription, request)
    await _collect(sub, messages, batch, deadline, lingering=False)
    if messages:
        return messages
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining * 1e9 > 100_000:
        await _pull(subscription, {"batch": batch, "expires": int(remaining * 1e9) - 100_000})
        await _collect(sub, messages, batch, deadline, lingering=True)
    if not messages:
        raise TimeoutError(f"no message within {timeout} s")
    return messages


_FAST_FETCH_ATTRIBUTES = frozenset({"_sub", "_nc", "_nms", "_deliver"})  # nats-py's, read by `fetch`


@functools.cache
def _warn_slow_fetch() -> None:
    log.warning("nats-py's pull subscription has changed: store fetches through nats-py's own fetch (slower)")


def _status(message: Msg) -> str | None:
    headers = message.headers
    return None if headers is None else headers.get(Header.STATUS)


async def _pull(subscription: JetStreamContext.PullSubscription, request: dict) -> None:
    await subscription._nc.publish(subscription._nms, json.dumps(request).encode(), subscription._deliver)


async def _collect(sub, messages: list[Msg], batch: int, deadline: float, *, lingering: bool) -> None:
    """Add delivered messages to `messages` until the batch is full, the request ends, or the deadline.

    A lingering request is waited for until the deadline whatever status comes (a consumer
    deleted and made again meanwhile answers the next request, not this one).
    """
    queue = sub._pending_queue
    try:
        async with asyncio.timeout_at(deadline):
            while len(messages) < batch:
                message = queue.get_nowait() if not queue.empty() else await queue.get()
                sub._pending_size -= len(message.data)
                status = _status(message)
                if not status:
                    messages.append(message)
                elif lingering or status == StatusCode.CONTROL_MESSAGE:  # a heartbeat: the request is alive
                    continue
                elif status in _REQUEST_ENDED:
                    return
                else:
                    raise APIError.from_msg(message)
    except TimeoutError:
        return


class StalledConsumerError(nats.errors.Error):
    """The durable consumer vanished or stopped delivering; the projector rebinds it."""


class StreamRegressedError(nats.errors.Error):
    """The stream went back (it ends below, or delivers again, a seq already read): the projector
    rebinds, and checks the stream against SQL before it does (store/cursor.py)."""


class SkippedMessagesError(nats.errors.Error):
    """The consumer delivered past messages the stream still holds; the projector rebinds it at its checkpoint."""


_V1_ACK_TOKENS = 9  # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts>.<pending>


def stream_seq(message: Msg) -> int:
    """A JetStream message's stream seq, read from its ack subject.

    nats-py's `metadata` parses the whole subject into objects, its timestamp into a datetime
    (a few microseconds a message, most of what reading the seq cost); this reads the one
    field, at nats-py's own positions, and leaves any other subject to nats-py.
    """
    tokens = message.reply.split(".")
    if len(tokens) == _V1_ACK_TOKENS and tokens[0] == "$JS" and tokens[1] == "ACK":
        return int(tokens[5])
    if len(tokens) > Msg.Ack.NumPending and tokens[0] == "$JS" and tokens[1] == "ACK":
        return int(tokens[Msg.Ack.StreamSeq])
    return message.metadata.sequence.stream


def first_gap(seqs: list[int], checkpoint: int) -> tuple[int, int] | None:
    """The first run of stream seqs after `checkpoint` that `seqs` (delivered, ascending) jumps over, as
    (first missing, first delivered after it), or None when they follow on from the checkpoint."""
    expected = checkpoint + 1
    for seq in seqs:
        if seq > expected:
            return expected, seq
        expected = max(expected, seq + 1)
    return None


class ConsumerWatch:
    """Notices a pull consumer that stopped delivering — lost in a server crash, or a stale
    subscription after a reconnect — so the projector rebinds it instead of idling forever."""

    STALLED_AFTER = 3  # idle fetches in a row while the server says messages are pending

    def __init__(self, js: JetStreamContext, stream: str, durable: str) -> None:
        self._js, self._stream, self._durable = js, stream, durable
        self._idle_with_pending = 0

    async def idle(self, last_stream_seq: int = 0) -> int:
        """Call after a fetch that returned nothing: the messages the server still holds for the consumer (a fetch
        can time out with some pending, on a busy machine); raises a NATS error when a rebind is due.

        A stream that now ends below `last_stream_seq`, the last seq read, lost acknowledged
        messages: StreamRegressedError, so the projector checks it against SQL at once rather
        than wait for the reused seqs to pass its position.
        """
        if last_stream_seq:
            last = (await self._js.stream_info(self._stream)).state.last_seq
            if last < last_stream_seq:
                raise StreamRegressedError(
                    f"{self._stream} ends at seq {last}, below seq {last_stream_seq} already read: checking it against SQL"
                )
        info = await self._js.consumer_info(self._stream, self._durable)  # NotFoundError: it is gone
        if not info.num_pending:
            self._idle_with_pending = 0
            return 0
        self._idle_with_pending += 1
        if self._idle_with_pending >= self.STALLED_AFTER:
            raise StalledConsumerError(
                f"consumer {self._durable} on {self._stream} has {info.num_pending} pending but delivers nothing"
            )
        return info.num_pending

    def delivered(self) -> None:
        self._idle_with_pending = 0

    async def check_no_skip(self, seqs: list[int], checkpoint: int) -> None:
        """Raise SkippedMessagesError when the delivered `seqs` jump past a message the stream holds.

        A consumer's delivery state can run ahead of what was committed: after a leader
        change in a cluster the new consumer leader may resume past messages the old one
        delivered but nobody acknowledged, and with AckPolicy.ALL the next ack would
        acknowledge them unread. A seq missing because the stream no longer has it (limits,
        age, a deleted message) is a real gap, left to the fold to report.
        """
        gap = first_gap(seqs, checkpoint)
        if gap is None:
            return
        missing, delivered = gap
        state = (await self._js.stream_info(self._stream)).state
        for seq in range(max(missing, state.first_seq), delivered):
            try:
                await self._js.get_msg(self._stream, seq)
            except NotFoundError:
                continue
            raise SkippedMessagesError(
                f"consumer {self._durable} on {self._stream} delivered seq {delivered} after checkpoint "
                f"{checkpoint}, but the stream still holds seq {seq}: rewinding to the checkpoint"
            )
