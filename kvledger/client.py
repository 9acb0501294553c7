"""The client a router uses to ask kvledger's decision service for reuse decisions.

    async with await DecideClient.connect_nats("nats://127.0.0.1:4222") as client:
        answer = await client.decide(DecideRequest(token_ids=tokens, block_size=16, target="prefill-0"))

Over NATS (`kvledger.decide`, `kvledger.decide.batch`) or HTTP (`POST /v1/decide[/batch]`),
the same typed values both ways. A call that times out, finds no responder, loses its
connection or meets a service-side failure (HTTP 5xx, an `internal error` answer) is sent
again, with backoff, under the same request id: decide records each answer in
KV_DECISIONS with Nats-Msg-Id = request id, so however many attempts it takes, the
request is on record once. An answer is returned only once it is on record: over NATS a
single request takes its record's acknowledgement from JetStream itself, beside the
answer, rather than waiting for decide to relay it (docs/decide.md, "On record"); a
batch, and every HTTP request, gets its reply after decide saw the acks. A request the
service refuses raises `RequestRefused` and is never sent again. This module talks to
the service only through its wire format; it imports nothing from `decide/`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from datetime import timedelta
from typing import Any, Self, TypeVar

import aiohttp
import attrs
import msgspec
import nats
import nats.errors

# The values on the wire are the decision API's one schema.
from kvledger.core.decision_codec import (
    JSON, MSGPACK, RECORD_ACK_HEADER, RECORD_ACK_TO_CALLER, Answer, Candidate, DecideRequest, ErrorReply, Overlap,
    new_request_id,
)
from kvledger.runtime.backoff import Backoff
from kvledger.runtime.jetstream_ack import AckError, read_ack
from kvledger.runtime.streams import DECIDE_BATCH_SUBJECT, DECIDE_SUBJECT

log = logging.getLogger("kvledger.client")

T = TypeVar("T")
Read = Callable[[bytes, str], T]  # a reply's body and media type → the call's result

DEFAULT_TIMEOUT = timedelta(seconds=2)


# --- errors ----------------------------------------------------------------------------------


class DecideError(Exception):
    """Anything that keeps a call from getting its answer."""


class RequestRefused(DecideError):
    """decide refused the request as malformed; `field` names what is wrong. Never retried: it would be refused again."""

    def __init__(self, request_id: str | None, field: str, message: str) -> None:
        super().__init__(f"request {request_id!r} refused: {field}: {message}")
        self.request_id = request_id
        self.field = field
        self.message = message


class DecideUnavailable(DecideError):
    """Every attempt timed out, found no responder, lost its connection or met a service-side failure."""


class _Transient(Exception):
    """One attempt failed in a way another attempt may not."""


# --- settings --------------------------------------------------------------------------------


def _positive(_instance: object, attribute: attrs.Attribute, value: timedelta) -> None:
    if value <= timedelta(0):
        raise ValueError(f"{attribute.name} must be positive, got {value}")


@attrs.frozen
class RetryPolicy:
    """How often a call is sent, and how long it waits between attempts.

    The wait doubles from `first_backoff` up to `max_backoff`; each is shortened by up to
    `jitter` of itself at random, so routers that lost the service together do not come
    back in step.
    """

    attempts: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    first_backoff: timedelta = attrs.field(default=timedelta(milliseconds=50), validator=_positive)
    max_backoff: timedelta = attrs.field(default=timedelta(seconds=1), validator=_positive)
    jitter: float = attrs.field(default=0.5, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)])

    def backoff(self) -> Backoff:
        return Backoff(self.first_backoff.total_seconds(), self.max_backoff.total_seconds(), self.jitter)

    def backoff_s(self, failed_attempts: int) -> float:
        """Seconds to wait after the `failed_attempts`-th failure (1 for the first)."""
        return self.backoff().delay_after(failed_attempts)


NO_RETRIES = RetryPolicy(attempts=1)


# --- transports ------------------------------------------------------------------------------


class _Replies:
    """Single requests' replies and their records' acks, on one subscription of the client's own.

    An attempt's answer comes on `<inbox>.<token>`, JetStream's ack of its record on
    `kvledger.core.decision_codec.record_ack_subject` of that; whichever comes first waits for the other's reader.
    """

    def __init__(self, inbox: str) -> None:
        self.prefix = inbox + "."
        self._waiting: dict[str, tuple[asyncio.Future, asyncio.Future]] = {}
        self._tokens = itertools.count()
        self.subscription: Any = None

    def open(self) -> tuple[str, asyncio.Future, asyncio.Future]:
        """A new attempt: its reply subject, and futures of its answer and of its record's ack."""
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        answer, ack = self._waiting[token] = (loop.create_future(), loop.create_future())
        return self.prefix + token, answer, ack

    def close(self, reply: str) -> None:
        self._waiting.pop(reply[len(self.prefix):], None)

    async def on_message(self, msg: Any) -> None:
        token, _, rest = msg.subject[len(self.prefix):].partition(".")
        waiting = self._waiting.get(token)
        if waiting is None:
            return  # for an attempt that already gave up
        future = waiting[1] if rest else waiting[0]
        if not future.done():
            future.set_result(msg)


_TAKE_THE_ACK = {RECORD_ACK_HEADER: RECORD_ACK_TO_CALLER}


class _NatsTransport:
    """Request-reply on decide's subjects; replies are JSON."""

    media_type = JSON
    _TRANSIENT = (
        nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionReconnectingError,
        nats.errors.StaleConnectionError, nats.errors.OutboundBufferLimitError,
    )

    def __init__(self, connection: nats.NATS, *, owned: bool) -> None:
        self.connection = connection
        self._owned = owned
        self._replies = _Replies(connection.new_inbox())

    async def start(self) -> _NatsTransport:
        self._replies.subscription = await self.connection.subscribe(
            self._replies.prefix + ">", cb=self._replies.on_message)
        return self

    async def exchange(self, payload: bytes, *, batch: bool, timeout_s: float, read: Read[T]) -> T:
        if not batch:
            return await self._single(payload, timeout_s, read)
        try:
            reply = await self.connection.request(DECIDE_BATCH_SUBJECT, payload, timeout=timeout_s)
        except self._TRANSIENT as error:
            raise _Transient(f"{type(error).__name__} on {DECIDE_BATCH_SUBJECT}") from error
        return read(reply.data, JSON)

    async def _single(self, payload: bytes, timeout_s: float, read: Read[T]) -> T:
        """One attempt: the answer, taken once JetStream's ack says its record is stored."""
        reply_subject, answered, recorded = self._replies.open()
        waiting_for = f"no answer on {DECIDE_SUBJECT}"
        try:
            async with asyncio.timeout(timeout_s):
                await self.connection.publish(DECIDE_SUBJECT, payload, reply=reply_subject, headers=_TAKE_THE_ACK)
                reply = await answered
                headers = reply.headers or {}
                if headers.get("Status") == "503":
                    raise _Transient(f"NoRespondersError on {DECIDE_SUBJECT}") from nats.errors.NoRespondersError()
                value = read(reply.data, JSON)
                # A refusal or a failure is not recorded; an answer sent without the header
                # was sent after decide saw its record acknowledged.
                if headers.get(RECORD_ACK_HEADER) == RECORD_ACK_TO_CALLER and not isinstance(value, RequestRefused):
                    # JetStream says "no stream listens" only to the publisher, decide: a missing
                    # KV_DECISIONS reads here as an ack that never comes.
                    waiting_for = "the answer came, but no ack of its record in KV_DECISIONS"
                    ack = await recorded
                    ack_headers = ack.headers or {}
                    try:
                        read_ack(ack_headers.get("Status"), ack_headers.get("Description", ""), ack.data)
                    except AckError as error:
                        raise _Transient(f"the answer came but was not recorded: {error}") from error
                return value
        except TimeoutError as error:
            raise _Transient(f"{waiting_for} within {timeout_s:g} s") from error
        except self._TRANSIENT as error:
            raise _Transient(f"{type(error).__name__} on {DECIDE_SUBJECT}") from error
        finally:
            self._replies.close(reply_subject)

    async def close(self) -> None:
        if self.connection.is_closed:
            return
        if self._owned:
            await self.connection.close()
        elif self._replies.subscription is not None:
            await self._replies.subscription.unsubscribe()


class _HttpTransport:
    """`POST /v1/decide[/batch]`; a 5xx or a lost connection is transient, a 4xx is not."""

    def __init__(
        self, base_url: str, *, media_type: str, session: aiohttp.ClientSession | None, token: str | None = None,
    ) -> None:
        if media_type not in (JSON, MSGPACK):
            raise ValueError(f"media_type must be {JSON!r} or {MSGPACK!r}, got {media_type!r}")
        self.media_type = media_type
        self._headers = {"Content-Type": media_type}
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        self._single_url = base_url.rstrip("/") + "/v1/decide"
        self._batch_url = self._single_url + "/batch"
        self._session = session
        self._owned = session is None

    def _session_now(self) -> aiohttp.ClientSession:
        # Made on first use, inside the event loop that will use it, as aiohttp requires.
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def exchange(self, payload: bytes, *, batch: bool, timeout_s: float, read: Read[T]) -> T:
        url = self._batch_url if batch else self._single_url
        try:
            async with self._session_now().post(
                url, data=payload, headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                body = await response.read()
                status, media_type = response.status, response.content_type
        except TimeoutError as error:
            raise _Transient(f"no answer from {url} within {timeout_s:g} s") from error
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as error:
            raise _Transient(f"{type(error).__name__} on {url}: {error}") from error
        if status >= 500:
            raise _Transient(f"HTTP {status} from {url}: {_error_text(body)}")
        if status == 401:  # retrying with the same token cannot help
            raise DecideError(f"HTTP 401 from {url}: decide.http_token is set there; pass DecideClient.http(..., token=...)")
        # decide answers, and refuses (400, 415), in JSON or msgpack; a text/plain 404 means a wrong base URL.
        if media_type not in _CODECS:
            raise DecideError(f"HTTP {status} from {url}: {_error_text(body)}")
        return read(body, media_type)

    async def close(self) -> None:
        if self._owned and self._session is not None:
            await self._session.close()


def _error_text(body: bytes) -> str:
    """The message of decide's error object, or the start of whatever else the body is."""
    try:
        return msgspec.json.decode(body, type=ErrorReply).error.message
    except msgspec.DecodeError:
        return body[:300].decode(errors="replace")


# --- reading replies ---------------------------------------------------------------------------


@attrs.frozen
class _Codec:
    """Encoder and decoders for one media type (decide answers in the media type it was asked in)."""

    encode: Callable[[object], bytes]
    answer: Any  # a msgspec Decoder of Answer
    error: Any  # a msgspec Decoder of ErrorReply
    batch: Any  # a msgspec Decoder of a list of raw elements, or a batch-wide ErrorReply

    @classmethod
    def for_json(cls) -> _Codec:
        return cls(msgspec.json.Encoder().encode, msgspec.json.Decoder(Answer), msgspec.json.Decoder(ErrorReply),
                   msgspec.json.Decoder(list[msgspec.Raw] | ErrorReply))

    @classmethod
    def for_msgpack(cls) -> _Codec:
        return cls(msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder(Answer),
                   msgspec.msgpack.Decoder(ErrorReply), msgspec.msgpack.Decoder(list[msgspec.Raw] | ErrorReply))


_CODECS = {JSON: _Codec.for_json(), MSGPACK: _Codec.for_msgpack()}


def _refusal_or_failure(reply: ErrorReply, request_id: str | None) -> RequestRefused:
    # decide names a field for every refusal; a failure on its side (KV_DECISIONS
    # unreachable, say) has none, and another attempt may well succeed.
    if reply.error.field is None:
        raise _Transient(reply.error.message)
    return RequestRefused(request_id, reply.error.field, reply.error.message)


def _answer_or_refusal(codec: _Codec, data: bytes, request_id: str) -> Answer | RequestRefused:
    try:
        answer = codec.answer.decode(data)
    except msgspec.DecodeError:
        try:
            reply = codec.error.decode(data)
        except msgspec.DecodeError as error:
            raise DecideError(f"unreadable answer to {request_id!r}: {error}: {bytes(data)[:200]!r}") from None
        return _refusal_or_failure(reply, request_id)
    if answer.request_id != request_id:
        raise DecideError(f"asked about {request_id!r}, answered about {answer.request_id!r}")
    return answer


def _read_batch(codec: _Codec, data: bytes, request_ids: list[str]) -> list[Answer | RequestRefused]:
    try:
        elements = codec.batch.decode(data)
    except msgspec.DecodeError as error:
        raise DecideError(f"unreadable batch answer: {error}: {data[:200]!r}") from None
    if isinstance(elements, ErrorReply):
        raise _refusal_or_failure(elements, None)
    if len(elements) != len(request_ids):
        raise DecideError(f"asked {len(request_ids)} requests, got {len(elements)} answers")
    return [_answer_or_refusal(codec, element, request_id) for element, request_id in zip(elements, request_ids)]


# --- the client --------------------------------------------------------------------------------


class DecideClient:
    """Asks decide for reuse decisions; `async with`, or `close()` when done. Safe to share between tasks.

    `timeout` bounds each attempt; a call makes at most `retry.attempts` of them, so it
    gives up after about attempts × timeout plus the backoffs.
    """

    def __init__(self, transport: _NatsTransport | _HttpTransport, *, timeout: timedelta = DEFAULT_TIMEOUT,
                 retry: RetryPolicy = RetryPolicy()) -> None:
        if timeout <= timedelta(0):
            raise ValueError(f"timeout must be positive, got {timeout}")
        self._transport = transport
        self._codec = _CODECS[transport.media_type]
        self.timeout = timeout
        self.retry = retry
        self._closed = False

    @classmethod
    async def connect_nats(
        cls, servers: str | Sequence[str] | nats.NATS = "nats://127.0.0.1:4222", *,
        timeout: timedelta = DEFAULT_TIMEOUT, retry: RetryPolicy = RetryPolicy(), **connect_options: Any,
    ) -> DecideClient:
        """A client over NATS: on a connection of its own (closed with the client) or on one given (left open)."""
        if isinstance(servers, nats.NATS):
            if connect_options:
                raise TypeError(f"connect options {sorted(connect_options)} given with an open connection")
            transport = _NatsTransport(servers, owned=False)
        else:
            connect_options.setdefault("name", "kvledger-client")
            servers = [servers] if isinstance(servers, str) else list(servers)
            transport = _NatsTransport(await nats.connect(servers, **connect_options), owned=True)
        return cls(await transport.start(), timeout=timeout, retry=retry)

    @classmethod
    def http(
        cls, base_url: str, *, timeout: timedelta = DEFAULT_TIMEOUT, retry: RetryPolicy = RetryPolicy(),
        media_type: str = JSON, session: aiohttp.ClientSession | None = None, token: str | None = None,
    ) -> DecideClient:
        """A client over decide's HTTP front (`http://host:decide.http_port`); a session given is left open.

        `token` is decide's `decide.http_token`, sent as `Authorization: Bearer <token>`.
        """
        return cls(_HttpTransport(base_url, media_type=media_type, session=session, token=token), timeout=timeout, retry=retry)

    async def decide(self, request: DecideRequest) -> Answer:
        """The answer to one request; raises RequestRefused, or DecideUnavailable once every attempt failed."""
        payload = self._codec.encode(request)
        answer = await self._with_retries(
            f"request {request.request_id!r}", lambda data, media: _answer_or_refusal(_CODECS[media], data, request.request_id),
            payload, batch=False,
        )
        if isinstance(answer, RequestRefused):
            raise answer
        return answer

    async def decide_batch(self, requests: Sequence[DecideRequest]) -> list[Answer | RequestRefused]:
        """Answers in request order, a RequestRefused in place of each request decide refused.

        Ranked in one call of the service; a retry sends the whole batch again under the
        same ids. Raises RequestRefused if decide refuses the batch as a whole.
        """
        if not requests:
            return []
        request_ids = [request.request_id for request in requests]
        payload = self._codec.encode(list(requests))
        return await self._with_retries(
            f"batch of {len(requests)} from {request_ids[0]!r}",
            lambda data, media: _read_batch(_CODECS[media], data, request_ids), payload, batch=True,
        )

    async def _with_retries(self, what: str, read: Read[T], payload: bytes, *, batch: bool) -> T:
        if self._closed:
            raise DecideError("the client is closed")
        timeout_s = self.timeout.total_seconds()
        backoff = self.retry.backoff()
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return await self._transport.exchange(payload, batch=batch, timeout_s=timeout_s, read=read)
            except _Transient as failure:
                if attempt == self.retry.attempts:
                    raise DecideUnavailable(
                        f"{what}: no answer after {attempt} attempt(s); the last: {failure}"
                    ) from (failure.__cause__ or failure)
                log.info("%s: attempt %d failed (%s); again in at most %.0f ms, same request id", what, attempt,
                         failure, backoff.delay_s * 1000)
                await backoff.wait()
        raise AssertionError("unreachable: RetryPolicy.attempts is at least 1")

    async def close(self) -> None:
        self._closed = True
        await self._transport.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


# --- from synchronous code ----------------------------------------------------------------------


class DecideClientSync:
    """DecideClient for synchronous code: the client lives on an event loop in a thread of its own.

    `with DecideClientSync.connect_nats(url) as client: client.decide(request)`. Call it
    from any thread but not from inside a running event loop, which it would block (use
    DecideClient there).
    """

    def __init__(self, connect: Callable[[], Awaitable[DecideClient]]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvledger-decide-client", daemon=True)
        self._thread.start()
        try:
            self._client = self._run(connect())
        except BaseException:
            self._stop_loop()
            raise

    @classmethod
    def connect_nats(cls, servers: str | Sequence[str] = "nats://127.0.0.1:4222", **options: Any) -> DecideClientSync:
        """As DecideClient.connect_nats, on a connection of its own."""
        return cls(lambda: DecideClient.connect_nats(servers, **options))

    @classmethod
    def http(cls, base_url: str, **options: Any) -> DecideClientSync:
        """As DecideClient.http."""

        async def make() -> DecideClient:
            return DecideClient.http(base_url, **options)

        return cls(make)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("DecideClientSync called from its own event loop; use DecideClient there")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def decide(self, request: DecideRequest) -> Answer:
        """As DecideClient.decide."""
        return self._run(self._client.decide(request))

    def decide_batch(self, requests: Sequence[DecideRequest]) -> list[Answer | RequestRefused]:
        """As DecideClient.decide_batch."""
        return self._run(self._client.decide_batch(requests))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = [
    "Answer", "Candidate", "DecideClient", "DecideClientSync", "DecideError", "DecideRequest", "DecideUnavailable",
    "NO_RETRIES", "Overlap", "RequestRefused", "RetryPolicy", "new_request_id",
]
